"""SamplingParams: the per-request decoding options, validated on construction (vLLM-compatible fields)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from qsaserve.errors import InvalidRequestError
from qsaserve.stop_strings import StopStringMatcher

# Logprob requests above this need more host<->device traffic than a serving engine should
# spend per token; vLLM uses the same default.
MAX_LOGPROBS = 20
# Temperatures below this sample greedily, as in vLLM (its _SAMPLING_EPS): dividing float32
# logits by a smaller one overflows to inf, and the distribution is an argmax by then anyway.
MIN_SAMPLING_TEMPERATURE = 1e-5
# Stop strings per request, and their total length: matching is linear in the text whatever
# they are, but building the automaton and validating them is not free.
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 8192
# Stop token ids are looked up for every generated token.
MAX_STOP_TOKEN_IDS = 1024


# Grammar specs are compiled and cached by their text: bound what one request may send.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's StructuredOutputsParams): exactly one of `json`
    (a JSON schema, as a dict or its text), `regex`, `choice` (the output is one of the strings),
    `grammar` (EBNF, as xgrammar and llama.cpp's GBNF spell it) or `json_object` (any JSON
    object). `disable_any_whitespace`: JSON without free whitespace between tokens (a small
    model given the choice can emit whitespace until max_tokens)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", f"give exactly one of {', '.join(self.KINDS)}; got {given or 'none'}")
        kind = given[0]
        if kind == "json":
            if isinstance(self.json, dict):
                try:
                    text = _json_text(self.json)
                except (TypeError, ValueError) as e:
                    raise InvalidRequestError("structured_outputs.json", f"the schema is not JSON: {e}") from None
            elif isinstance(self.json, str):
                text = self.json
                try:
                    if not isinstance(json.loads(text), (dict, bool)):
                        raise ValueError("a schema is an object")
                except ValueError as e:
                    raise InvalidRequestError("structured_outputs.json", f"the schema is not a JSON object: {e}") from None
            else:
                raise InvalidRequestError("structured_outputs.json", f"must be a JSON schema (object or its text), got {type(self.json).__name__}")
            self._spec = text
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequestError("structured_outputs.choice", f"must be 1 to {MAX_CHOICES} non-empty strings, got {self.choice!r}")
            self._spec = _json_text(list(self.choice))
        elif kind == "json_object":
            if self.json_object is not True:
                raise InvalidRequestError("structured_outputs.json_object", f"must be true, got {self.json_object!r}")
            self._spec = ""
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise InvalidRequestError(f"structured_outputs.{kind}", f"must be a non-empty string, got {value!r}")
            self._spec = value
        if len(self._spec) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"structured_outputs.{kind}", f"has {len(self._spec)} characters; at most {MAX_GRAMMAR_CHARS}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("structured_outputs.disable_any_whitespace", "must be true or false")
        self._kind = kind

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the compile cache's key)."""
        return self._kind, self._spec, self.disable_any_whitespace

    @property
    def spec(self) -> str:
        """The grammar as text: the schema's JSON, the regex, the EBNF, the choices' JSON list."""
        return self._spec


def _json_text(value: Any) -> str:
    # Keys keep their order: a schema's property order is the order the output writes them in.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    structured_outputs: StructuredOutputsParams | None = None  # the output follows this grammar
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)
    _stop_matcher: StopStringMatcher | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(param, msg)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not _is_number(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not _is_number(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self._stop_list = list(self.stop)
        else:
            raise bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self._stop_list):
            raise bad("stop", "stop strings must be non-empty")
        if len(self._stop_list) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self._stop_list)}")
        stop_chars = sum(map(len, self._stop_list))
        if stop_chars > MAX_STOP_CHARS:
            raise bad("stop", f"the stop strings have {stop_chars} characters in all; at most {MAX_STOP_CHARS}")
        self._stop_matcher = StopStringMatcher(self._stop_list) if self._stop_list else None
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", f"must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def stop_matcher(self) -> StopStringMatcher | None:
        """One automaton over the stop strings (None without any)."""
        return self._stop_matcher

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def clone(self, **changes) -> "SamplingParams":
        kwargs = {f: getattr(self, f) for f in self.__dataclass_fields__ if not f.startswith("_")}
        kwargs.update(changes)
        return SamplingParams(**kwargs)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
