"""The stop strings' Aho-Corasick automaton against a brute-force search, fed in random chunks
as the engine feeds it new text; and the request limits on stop strings."""
import random

import pytest

from qsaserve.errors import InvalidRequestError
from qsaserve.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from qsaserve.stop_strings import StopStringMatcher


def first_stop(text: str, fed_from: int, stops: list[str]):
    """Of the stops ending in text[fed_from:], the one starting first (ties: ending first)."""
    best = None
    for end in range(fed_from + 1, len(text) + 1):
        for s in stops:
            start = end - len(s)
            if start >= 0 and text[start:end] == s and (best is None or start < best[0]):
                best = (start, end, s)
    return best


def held_back(text: str, stops: list[str]) -> int:
    """The longest suffix of text that is a prefix of some stop."""
    return max((k for s in stops for k in range(1, min(len(s), len(text)) + 1) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(500):
        alphabet = "ab c"
        stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))})
        matcher = StopStringMatcher(stops)
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        state, fed = 0, 0
        while fed < len(text):
            end = min(len(text), fed + rng.randint(1, 4))
            state, match = matcher.advance(state, text[:end], fed)
            expected = first_stop(text[:end], fed, stops)
            assert (tuple(match) if match else None) == expected, (stops, text[:end], fed)
            if match:
                break
            assert matcher.depth(state) == held_back(text[:end], stops), (stops, text[:end])
            fed = end


def test_limits_in_sampling_params():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(stop=["y" * MAX_STOP_CHARS])
    for stop in (["x"] * (MAX_STOP_STRINGS + 1), ["y" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(stop=stop)
        assert e.value.param == "stop"
    SamplingParams(stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    assert e.value.param == "stop_token_ids"
    assert SamplingParams().stop_matcher is None and SamplingParams(stop="ab").stop_matcher is not None
