"""The recurrent-state half of the hybrid prefix cache: which snapshot row holds the state at the
end of which cached prefix.

A hybrid model's KV prefix is reusable only together with the recurrent state (GDN, PLE, QSA
index tail) at its end, so the model keeps copies of its state slots at block boundaries every
`interval` tokens, in a pool of rows (models/qwen4exp/snapshots.py). This module owns the rows:

  * a row is keyed by the chain hash of the prefix it ends (the hash of the boundary's last
    block, block_manager.chain_hash): equal keys mean equal prefixes, so a row is valid wherever
    the same tokens recur, whatever physical KV blocks hold them;
  * reserved (ref 1) when a step is planned to write it, published under its key once the step's
    results are in and finite, dropped back to free if the sequence stops first;
  * referenced while a step that restores from it is being launched (the copy is stream-ordered
    before anything that could overwrite the row later);
  * evicted least recently used first, among published rows nobody references.

Lookups and evictions are counted for the engine's stats. With a host tier (host_kv_tier.py),
`on_evict(key, row)` hears of every published row about to be overwritten, in time to copy it out.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


@dataclass
class StateCacheStats:
    hits: int = 0  # prefix lookups that restored a snapshot
    misses: int = 0  # prefix lookups (of requests that may use the cache) that found none
    saved: int = 0  # snapshots published
    evicted: int = 0  # published snapshots overwritten by newer ones


class StateSnapshotCache:
    def __init__(self, num_rows: int, interval: int, row_bytes: int):
        if num_rows < 1:
            raise ValueError(f"state snapshots: need at least one row, got {num_rows}")
        self.num_rows, self.interval, self.row_bytes = num_rows, interval, row_bytes
        self.free: list[int] = list(range(num_rows - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()  # published, unreferenced: eviction order
        self.key_of: dict[int, int] = {}  # row -> prefix hash (published rows)
        self.row_of: dict[int, int] = {}  # prefix hash -> row
        self.refs: dict[int, int] = {}  # row -> pending restores (published) or 1 (reserved)
        self.stats = StateCacheStats()
        self.on_evict: Callable[[int, int], None] | None = None

    # ---- capacity ----
    @property
    def num_cached(self) -> int:
        """Published snapshots."""
        return len(self.key_of)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    # ---- lookups ----
    def find(self, prefix_hash: int) -> int | None:
        return self.row_of.get(prefix_hash)

    def acquire(self, row: int) -> None:
        """A step will restore from this published row: keep it until release()."""
        self.lru.pop(row, None)
        self.refs[row] = self.refs.get(row, 0) + 1

    def release(self, row: int) -> None:
        """The restore from the row has been launched."""
        self.refs[row] -= 1
        if not self.refs[row]:
            del self.refs[row]
            self.lru[row] = None  # most recently used

    # ---- saves ----
    def reserve(self) -> int | None:
        """A row a step may write a new snapshot into (a free one, else the least recently used
        published one, evicted); None when every row is referenced."""
        if self.free:
            row = self.free.pop()
        elif self.lru:
            row, _ = self.lru.popitem(last=False)
            key = self.key_of.pop(row)
            del self.row_of[key]
            self.stats.evicted += 1
            if self.on_evict is not None:
                self.on_evict(key, row)
        else:
            return None
        self.refs[row] = 1
        return row

    def publish(self, row: int, prefix_hash: int, restored: bool = False) -> None:
        """The reserved row now holds the state at the end of the prefix with this hash (restored:
        copied back from the host tier, not a new snapshot)."""
        del self.refs[row]
        if prefix_hash in self.row_of:  # the same prefix was saved meanwhile: keep the older row
            self.free.append(row)
            return
        self.key_of[row] = prefix_hash
        self.row_of[prefix_hash] = row
        self.lru[row] = None
        self.stats.saved += not restored

    def drop(self, row: int) -> None:
        """A reserved row whose content will never be published."""
        del self.refs[row]
        self.free.append(row)

    def reset(self) -> None:
        """Forgets every unreferenced published snapshot."""
        for row in list(self.lru):
            del self.row_of[self.key_of.pop(row)]
            self.free.append(row)
        self.lru.clear()
