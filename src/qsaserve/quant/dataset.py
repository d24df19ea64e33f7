"""Text for calibration and evaluation.

The default is the CPython documentation shipped with every Python (`pydoc_data.topics`, ~80
topics, ~110k SmolLM2 tokens), split by topic name into a calibration part and a held-out
evaluation part. The split is a hash of the topic name, so it is the same on every machine and
does not shift when a Python release adds or drops topics; a text shared by several topics goes
to one side only, so calibration never reads any evaluation text.
"""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass

HOLDOUT_MODULUS = 4  # one topic in four (by name hash) is held out for evaluation


@dataclass
class TextSet:
    texts: list[str]
    description: dict  # recorded in scales files and quality reports


def _is_held_out(topic: str) -> bool:
    return int(hashlib.sha256(topic.encode()).hexdigest()[:8], 16) % HOLDOUT_MODULUS == 0


def pydoc_topics(part: str) -> TextSet:
    """part: "calibration" (3/4 of the topics) or "evaluation" (the held-out 1/4)."""
    if part not in ("calibration", "evaluation"):
        raise ValueError(f"part must be calibration or evaluation, got {part!r}")
    from pydoc_data.topics import topics

    # Some topics share one text (e.g. "if" and "else"): split distinct texts, each named by
    # its first topic name, so no text lands on both sides.
    first_name: dict[str, str] = {}
    for name in sorted(topics):
        first_name.setdefault(topics[name], name)
    names = sorted(n for n in first_name.values() if _is_held_out(n) == (part == "evaluation"))
    texts = [topics[n] for n in names]
    return TextSet(texts, {
        "name": "pydoc_data.topics (CPython documentation)",
        "python": sys.version.split()[0],
        "part": part,
        "split_rule": f"distinct topic text (named by its first topic name) held out for evaluation iff "
                      f"int(sha256(name)[:8 hex], 16) % {HOLDOUT_MODULUS} == 0",
        "topics": len(names),
        "chars": sum(len(t) for t in texts),
        "sha256": _digest(texts),
    })


def text_file(path: str) -> TextSet:
    """A UTF-8 text file, used whole."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"dataset: cannot read {path}: {e}") from None
    if not text.strip():
        raise ValueError(f"dataset: {path} is empty")
    return TextSet([text], {"name": os.path.basename(path), "path": os.path.abspath(path), "chars": len(text),
                            "sha256": _digest([text])})


def token_windows(tokenizer, texts: list[str], window: int, max_tokens: int) -> list[list[int]]:
    """Texts joined by blank lines, tokenized once, cut into consecutive windows of `window`
    tokens (the last may be shorter), at most `max_tokens` tokens in all."""
    ids = tokenizer.encode("\n\n".join(texts), add_special_tokens=False)[:max_tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]


def _digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(len(t.encode()).to_bytes(8, "little"))
        h.update(t.encode())
    return h.hexdigest()
