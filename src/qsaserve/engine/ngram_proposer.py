"""N-gram (prompt lookup) drafting on the host, for every model: the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) are looked up earlier in the sequence, prompt
and output alike, and the tokens that followed an earlier occurrence are the draft: the most
recent occurrence that k tokens follow, else the earliest (the most tokens follow it). No model
runs; a sequence without a match drafts nothing that step."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to k draft tokens continuing token_ids, or [] when no suffix of lookup_min..lookup_max
    tokens recurs."""
    n_tokens = len(token_ids)
    if k <= 0 or n_tokens < lookup_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, n_tokens - 1), lookup_min - 1, -1):
        suffix = arr[n_tokens - n:]
        # Windows starting at 0 .. n_tokens - n - 1: every earlier occurrence that a token follows.
        windows = sliding_window_view(arr[: n_tokens - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # The most recent occurrence that k tokens follow, else the earliest (the most follow).
            full = hits[hits + n + k <= n_tokens]
            start = int(full[-1] if full.size else hits[0]) + n
            return arr[start : start + k].tolist()
    return []
