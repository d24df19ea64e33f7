"""N-gram (prompt lookup) drafting on the host, for every model: the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) are looked up earlier in the sequence, prompt
and output alike, and the tokens that followed an earlier occurrence are the draft: the most
recent occurrence that k tokens follow, else the earliest (the most tokens follow it), its copy
continuing over the draft itself where fewer than k follow (as an overlapping copy does: the
repeat goes on), so that a matching sequence drafts k tokens and a step of matching sequences
is a uniform verify (a CUDA graph's). No model runs; a sequence without a match drafts nothing
that step."""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray | list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to k draft tokens continuing token_ids (an int64 array, or a list), or [] when no suffix of lookup_min..lookup_max
    tokens recurs. One pass over the sequence for the positions holding its last token, then the
    match length behind each (this runs for every decoding sequence after every step)."""
    n_tokens = len(token_ids)
    if k <= 0 or n_tokens < lookup_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)  # no copy for an int64 array
    ends = np.flatnonzero(arr[: n_tokens - 1] == arr[-1])  # earlier positions a match could end at
    if not ends.size:
        return []
    longest = min(lookup_max, n_tokens - 1)
    length = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched behind each end, up to longest
    alive = np.ones(ends.size, dtype=bool)
    for m in range(1, longest):
        back = ends - m
        alive &= back >= 0
        alive[alive] = arr[back[alive]] == arr[n_tokens - 1 - m]
        length += alive
    for n in range(longest, lookup_min - 1, -1):
        hits = ends[length >= n]
        if hits.size:
            # The most recent occurrence that k tokens follow, else the earliest (the most follow).
            full = hits[hits + 1 + k <= n_tokens]
            start = int(full[-1] if full.size else hits[0]) + 1
            if start + k <= n_tokens:
                return arr[start : start + k].tolist()
            # Fewer than k tokens follow: the copy continues over its own output (the repeat of
            # period n_tokens - start goes on), so a sequence drafts k whenever it matches.
            period = n_tokens - start
            return [int(arr[start + i % period]) for i in range(k)]
    return []
