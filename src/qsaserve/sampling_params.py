"""SamplingParams: the per-request decoding options, validated on construction (vLLM-compatible fields)."""
from __future__ import annotations

from dataclasses import dataclass, field

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
