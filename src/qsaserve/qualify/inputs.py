"""What every configuration is fed, built once from the baseline engine and reused for all.

Text comes from the held-out part of CPython's documentation (quant/dataset.py, never read by
`qsaserve calibrate`) or a --dataset file. A model without a tokenizer (random-weight presets,
test checkpoints) gets the same text through a character-level stand-in (`CharCodec`: one token
id per printable character), so every stage runs on every model; its task scores then measure
agreement between configurations, not ability.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass

ALPHABET = string.printable[:95] + "\n"  # digits, letters, punctuation, space, newline
CHAR_OFFSET = 4  # ids below are left to the model's special tokens


class CharCodec:
    """Character-level stand-in for a missing tokenizer: character i of ALPHABET is token
    CHAR_OFFSET + i (mod the vocabulary when it is smaller, which makes decoding lossy)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.lossless = vocab_size >= CHAR_OFFSET + len(ALPHABET)
        self._ids = {c: (CHAR_OFFSET + i) % vocab_size for i, c in enumerate(ALPHABET)}
        self._chars = {} if not self.lossless else {v: c for c, v in self._ids.items()}
        self.description = f"character-level stand-in ({len(ALPHABET)} characters from id {CHAR_OFFSET}; the model has no tokenizer)"

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, self._ids[" "]) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self._chars.get(i, "\ufffd") for i in ids)


class TokenizerCodec:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.description = f"the model's tokenizer ({type(tokenizer).__name__})"

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def codec_for(engine):
    return TokenizerCodec(engine.tokenizer) if engine.tokenizer is not None else CharCodec(engine.vocab_size)


@dataclass
class Corpus:
    """The evaluation text as one token stream."""

    ids: list[int]
    description: dict

    def windows(self, window: int, max_tokens: int) -> list[list[int]]:
        ids = self.ids[:max_tokens]
        return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]

    def sample(self, seed: int, length: int) -> list[int]:
        """`length` consecutive tokens from an offset drawn with `seed`."""
        if len(self.ids) <= length:
            return list(self.ids)
        start = random.Random(seed).randrange(0, len(self.ids) - length)
        return self.ids[start : start + length]

    def filler(self, length: int, offset: int = 0) -> list[int]:
        """`length` tokens of running text (cycled when the corpus is shorter)."""
        out: list[int] = []
        while len(out) < length:
            out += self.ids[offset:offset + length - len(out)]
            offset = 0
        return out


def build_corpus(codec, dataset) -> Corpus:
    ids = codec.encode("\n\n".join(dataset.texts))
    return Corpus(ids, {**dataset.description, "tokens": len(ids), "tokenization": codec.description})


# ---- stage 2's built-in prompts ----
SHORT_PROMPT = "The capital of France is"
CODE_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
MARKER = "MARKER-7Q2: the launch code is 4417. "
MARKER_QUESTION = "\nQuestion: what is the launch code? Answer: the launch code is"
PREFIX_SUFFIXES = ("\nIn one sentence, the text above says that", "\nThe most important word in the text above is")
REPEATED_PROMPT = "Write a list of the first ten prime numbers:"


@dataclass
class GatePrompt:
    """One fixed prompt; `after` names a prompt that must have run first (the prefix-cache cases)."""

    name: str
    ids: list[int]
    after: str | None = None


def gate_prompts(codec, corpus: Corpus, max_model_len: int, new_tokens: int, long_tokens: int) -> list[GatePrompt]:
    room = max_model_len - new_tokens - 1
    long_len = max(16, min(long_tokens, room))
    marker, question = codec.encode(MARKER), codec.encode(MARKER_QUESTION)
    body = corpus.filler(max(0, long_len - len(marker) - len(question)))
    half = len(body) // 2
    long_ids = body[:half] + marker + body[half:] + question
    prefix = corpus.filler(max(8, min(long_len // 2, room - 16)), offset=len(corpus.ids) // 3)
    prompts = [
        GatePrompt("short", codec.encode(SHORT_PROMPT)),
        GatePrompt("code", codec.encode(CODE_PROMPT)),
        GatePrompt("long_marked", long_ids[:room]),
        GatePrompt("prefix_first", (prefix + codec.encode(PREFIX_SUFFIXES[0]))[:room]),
        GatePrompt("prefix_changed_suffix", (prefix + codec.encode(PREFIX_SUFFIXES[1]))[:room], after="prefix_first"),
        GatePrompt("repeat_first", codec.encode(REPEATED_PROMPT)),
        GatePrompt("repeat_second", codec.encode(REPEATED_PROMPT), after="repeat_first"),
    ]
    return prompts
