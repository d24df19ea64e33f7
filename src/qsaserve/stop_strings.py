"""One Aho-Corasick automaton over a request's stop strings.

The engine feeds it each sequence's new text once (its state persists between tokens), so finding
a stop costs O(new characters) whatever the number and length of the stop strings; the server
reads the same state's depth to know how much streamed text could still become a stop."""
from __future__ import annotations

from collections import deque
from typing import NamedTuple, Sequence


class StopMatch(NamedTuple):
    start: int  # index in the scanned text where the stop string begins
    end: int  # index just past it
    stop: str


class StopStringMatcher:
    """State 0 is the empty prefix. A state is the longest suffix of the text scanned so far that
    is a prefix of some stop string; depth(state) is its length."""

    def __init__(self, stops: Sequence[str]):
        goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        ends: list[str | None] = [None]  # the stop string that ends exactly at a state
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    self._depth.append(self._depth[state] + 1)
                    ends.append(None)
                state = nxt
            ends[state] = stop
        fail = [0] * len(goto)
        # The longest stop string that is a suffix of a state (itself included), via failure links.
        self._match: list[str | None] = list(ends)
        queue = deque(goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, child in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if goto[f].get(ch, 0) != child else 0
                if self._match[child] is None:
                    self._match[child] = self._match[fail[child]]
                queue.append(child)
        self._goto, self._fail = goto, fail

    def depth(self, state: int) -> int:
        return self._depth[state]

    def advance(self, state: int, text: str, start: int = 0) -> tuple[int, StopMatch | None]:
        """Feeds text[start:]; returns the new state and, of the stop strings that end in the fed
        part, the one that begins first (ties: the one that ends first)."""
        goto, fail, match = self._goto, self._fail, self._match
        best: StopMatch | None = None
        for i in range(start, len(text)):
            ch = text[i]
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            stop = match[state]
            if stop is not None and (best is None or i + 1 - len(stop) < best.start):
                best = StopMatch(i + 1 - len(stop), i + 1, stop)
        return state, best
