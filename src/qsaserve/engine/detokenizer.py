"""Incremental detokenization.

Decoding token by token breaks multi-byte characters and merged spaces, so each step decodes a
short window twice: the tokens already emitted (from prefix_offset to read_offset) and the same
window plus the new tokens; the difference is the new text. A trailing U+FFFD means a
character is still incomplete, so the new tokens are held back until it completes.
"""
from __future__ import annotations

from qsaserve.engine.sequence import Sequence

# Tokens of left context kept in the window, enough for any tokenizer's merge of leading spaces.
_WINDOW_CONTEXT = 6


def detokenize_incrementally(tokenizer, seq: Sequence) -> str:
    """Appends the newly decodable text to seq.output_text and returns it."""
    ids = seq.output_token_ids
    skip = seq.params.skip_special_tokens
    prefix_text = tokenizer.decode(ids[seq.detok_prefix_offset : seq.detok_read_offset], skip_special_tokens=skip)
    full_text = tokenizer.decode(ids[seq.detok_prefix_offset :], skip_special_tokens=skip)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    new_text = full_text[len(prefix_text) :]
    seq.detok_prefix_offset = max(0, len(ids) - _WINDOW_CONTEXT)
    seq.detok_read_offset = len(ids)
    seq.output_text += new_text
    return new_text
