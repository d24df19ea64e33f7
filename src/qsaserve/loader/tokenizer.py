"""Tokenizers: built from GGUF metadata, or loaded from an HF directory.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.*` metadata. We rebuild an
equivalent `tokenizers.Tokenizer` and wrap it in `PreTrainedTokenizerFast` so the engine sees
one interface (encode/decode/chat template) for both checkpoint formats.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .checkpoint import ModelLoadError

logger = logging.getLogger("qsaserve")

# llama.cpp token types (llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# GPT-2's split; tokenizers' ByteLevel(use_regex=True) applies exactly this one.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                 r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# `tokenizer.ggml.pre` values grouped by the pre-tokenization their original HF tokenizer.json uses
# (llama.cpp groups them the same way in llama-vocab.cpp).
_PRE_GPT2 = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"}
# StarCoder-style vocabularies (SmolLM among them) split every digit before the GPT-2 regex.
_PRE_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx"}
_PRE_QWEN2 = {"qwen2", "deepseek-r1-qwen", "megrez"}


def _byte_level_pre_tokenizer(pre: str | None):
    """Pre-tokenizer + normalizer for a byte-level BPE vocabulary, chosen by `tokenizer.ggml.pre`."""
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _PRE_DIGITS_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex]), None
    if pre in _PRE_LLAMA3:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level_plain]), None
    if pre in _PRE_QWEN2:
        # Qwen2's own tokenizer NFC-normalises input; its merges were learned on NFC text.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level_plain]), normalizers.NFC()
    if pre is not None and pre not in _PRE_GPT2:
        logger.warning("tokenizer.ggml.pre=%r is not known; using GPT-2 pre-tokenization", pre)
    return byte_level_regex, None


def _split_merge(merge: str, vocab: Mapping[str, int]) -> tuple[str, str]:
    """Split a "left right" merge line. Pieces may themselves contain spaces (some SPM vocabularies),
    so for an ambiguous line pick the split whose halves are both in the vocabulary."""
    left, sep, right = merge.partition(" ")
    if sep and " " not in right:
        return left, right
    for i, ch in enumerate(merge):
        if ch == " " and merge[:i] in vocab and merge[i + 1:] in vocab:
            return merge[:i], merge[i + 1:]
    if not sep:
        raise ModelLoadError(f"model: malformed tokenizer merge {merge!r} in GGUF metadata")
    return left, right


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the vocabulary: every split of a piece into two pieces, ranked by
    the merged piece's score (higher first), as llama.cpp's SPM tokenizer ranks its bigrams."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[pid]), pid, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _token_at(tokens: list[str], token_id: Any) -> str | None:
    if token_id is None:
        return None
    token_id = int(token_id)
    return tokens[token_id] if 0 <= token_id < len(tokens) else None


def _add_gguf_added_tokens(tok: Tokenizer, tokens: list[str], types: list[int], vocab: Mapping[str, int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so both are matched
    whole in text (as llama.cpp does) instead of being split by BPE. Only ids the vocabulary owns are added,
    so the vocabulary size never grows."""
    special, user = [], []
    for i, (token, ttype) in enumerate(zip(tokens, types)):
        if vocab.get(token) != i or not token:
            continue
        if ttype == TOKEN_CONTROL:
            special.append(AddedToken(token, special=True, normalized=False))
        elif ttype == TOKEN_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def build_gguf_tokenizer(meta: Mapping[str, Any]):
    """Build a `PreTrainedTokenizerFast` from a GGUF's `tokenizer.*` metadata (a plain key -> value mapping)."""
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("model: GGUF file has no tokenizer.ggml.tokens; cannot build a tokenizer")
    tokens = list(tokens)
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError("model: GGUF tokenizer.ggml.token_type length differs from tokenizer.ggml.tokens")
    # Later duplicates win, as in llama.cpp's token-to-id map.
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges_raw = meta.get("tokenizer.ggml.merges")

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    unk_token = _token_at(tokens, meta.get("tokenizer.ggml.unknown_token_id"))

    if kind == "gpt2":
        merges = [_split_merge(m, vocab) for m in (merges_raw or [])]
        pre = meta.get("tokenizer.ggml.pre")
        # No unk in the model: byte-level BPE covers every input; `unk_token` only names it for the wrapper.
        tok = Tokenizer(models.BPE(
            vocab=vocab, merges=merges, dropout=None, fuse_unk=False, byte_fallback=False,
            # llama.cpp (and Llama 3's tokenizer.json) take a whole pre-token straight from the vocabulary.
            ignore_merges=pre in _PRE_LLAMA3,
        ))
        tok.pre_tokenizer, normalizer = _byte_level_pre_tokenizer(pre)
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.decoder = decoders.ByteLevel()
        add_bos = bool(add_bos) if add_bos is not None else False
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if merges_raw:
            merges = [_split_merge(m, vocab) for m in merges_raw]
        elif scores is not None and len(scores) == len(tokens):
            merges = _merges_from_scores(tokens, list(scores))
        else:
            raise ModelLoadError("model: GGUF SentencePiece tokenizer has neither merges nor per-token scores")
        tok = Tokenizer(models.BPE(
            vocab=vocab, merges=merges, dropout=None, unk_token=unk_token, fuse_unk=True, byte_fallback=True,
        ))
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        # llama.cpp escapes spaces as U+2581 and prefixes one after BOS/any special token; a per-segment
        # normalizer gives exactly that, since added tokens are split off before normalization.
        steps = [normalizers.Replace(" ", "\u2581")]
        if add_space_prefix:
            steps.insert(0, normalizers.Prepend("\u2581"))
        tok.normalizer = normalizers.Sequence(steps)
        tok.pre_tokenizer = None
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space_prefix:
            dec.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(dec)
        # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise.
        add_bos = bool(add_bos) if add_bos is not None else True
    else:
        raise ModelLoadError(
            f"model: unsupported GGUF tokenizer.ggml.model={kind!r} (supported: 'gpt2', 'llama')")

    _add_gguf_added_tokens(tok, tokens, types, vocab)

    bos_token = _token_at(tokens, meta.get("tokenizer.ggml.bos_token_id"))
    eos_token = _token_at(tokens, meta.get("tokenizer.ggml.eos_token_id"))
    pad_token = _token_at(tokens, meta.get("tokenizer.ggml.padding_token_id"))
    if add_bos and bos_token is None:
        raise ModelLoadError("model: GGUF asks to add a BOS token but has no tokenizer.ggml.bos_token_id")

    kwargs = dict(tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                  pad_token=pad_token, add_bos_token=add_bos, add_eos_token=add_eos,
                  clean_up_tokenization_spaces=False)
    hf_tok = PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})
    template = meta.get("tokenizer.chat_template")
    if template:
        hf_tok.chat_template = template
    return hf_tok


def load_hf_tokenizer(directory: str):
    """The tokenizer of an HF model directory, via `AutoTokenizer` (local files only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, KeyError...)
        raise ModelLoadError(f"model: cannot load tokenizer from {directory}: {exc}") from exc
