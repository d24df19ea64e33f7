"""speculative_config, spelled as vLLM spells it: `{"method": "ngram", "num_speculative_tokens": 3,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}` (the LLM keyword or `--speculative-config JSON`).
Model-independent checks here; whether the model can draft with the method is checked once the
model is built (engine/model_runner.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from qsaserve.errors import InvalidRequestError

METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 8
_PREFIX = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: longest suffix looked up in the sequence (default 4)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix that may match (default 1)
    # No drafts in a step while more sequences than this run (verifying costs more than it saves
    # in large batches; benchmarks/bench_spec_decode.py measures where). None: always draft.
    disable_by_batch_size: int | None = None
    # No drafts in a step whose batch size measured slower verify steps than plain ones, per token
    # (engine/draft_policy.py); disable_by_batch_size applies first.
    disable_when_slower: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"{_PREFIX}.method", f"must be one of {', '.join(METHODS)}; got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if not isinstance(self.disable_when_slower, bool):
            raise InvalidRequestError(f"{_PREFIX}.disable_when_slower", f"must be true or false, got "
                                      f"{self.disable_when_slower!r}")
        if self.method != "ngram":
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise InvalidRequestError(f"{_PREFIX}.{name}",
                                              f"applies to method 'ngram' only, not {self.method!r}")
            return
        if self.prompt_lookup_max is None:
            object.__setattr__(self, "prompt_lookup_max", 4)
        if self.prompt_lookup_min is None:
            object.__setattr__(self, "prompt_lookup_min", 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, None)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, None)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError(f"{_PREFIX}.prompt_lookup_min", f"must be <= prompt_lookup_max "
                                      f"({self.prompt_lookup_max}); got {self.prompt_lookup_min}")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a dict of its fields or that dict as a JSON string."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(_PREFIX, f"is not valid JSON ({exc.msg}): {value!r}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(_PREFIX, f"must be a JSON object (a dict), got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequestError(f"{_PREFIX}.{unknown[0]}", f"unknown field; known: {', '.join(sorted(known))}")
    for name in ("method", "num_speculative_tokens"):
        if name not in value:
            raise InvalidRequestError(f"{_PREFIX}.{name}", "is required")
    return SpeculativeConfig(**value)


def _check_int(name: str, value, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{_PREFIX}.{name}", f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequestError(f"{_PREFIX}.{name}", f"must be {bound}, got {value}")
