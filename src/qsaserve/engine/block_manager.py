"""Block manager: owns the KV-cache pages, with prefix caching.

A full block is identified by a hash chained over every token before it (hash of the parent
block's hash + this block's token ids), so equal hashes mean equal prefixes. Freed blocks that
hold a hash stay in the free list as cached blocks; a new prefix can revive them until they are
evicted, least recently freed first. Block 0 is the null block: never allocated, used as padding
in block tables so kernels always index valid memory.

Hybrid models (recurrent state beside the KV) reuse a prefix only up to a block boundary where the
state cache (state_cache.py) holds a snapshot of the state, keyed by the same chain hash: a hit is
the deepest such boundary inside the cached KV chain, and its snapshot is restored into the
sequence's state slot before its first step. Snapshots are planned per step
(plan_state_snapshots) and published with the blocks they end.

With a host tier (host_kv_tier.py, --kv-offload-gib) an evicted cached block or snapshot is copied
to host memory, and a prefix may continue on the host: such blocks (ON_HOST in a CachedPrefix) get
fresh GPU blocks that the step's plan fills before the forward.

Besides each sequence's own list, the block tables are mirrored into one persistent int32 array
(BlockTables), written only when a block is appended or freed, so a step's tables are one gather
instead of a nested list rebuilt every step.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from qsaserve.cache.kv_cache import blocks_for, usable_blocks
from qsaserve.engine.host_kv_tier import HostKVTier
from qsaserve.engine.sequence import Sequence
from qsaserve.engine.state_cache import StateSnapshotCache

NULL_BLOCK = 0
ON_HOST = -1  # a CachedPrefix entry whose block lives only in the host tier (host_kv_tier.py)


def chain_hash(parent: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh3_64()
    h.update((parent if parent is not None else 0).to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockTables:
    """Every sequence holding blocks owns one row of a persistent int32 array [rows, width], its
    block ids from column 0 and null blocks after them. Rows and width grow by doubling."""

    def __init__(self, rows: int = 64, width: int = 16):
        self.array = np.zeros((rows, width), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))

    def acquire(self) -> int:
        if not self._free_rows:
            rows, width = self.array.shape
            self.array = np.concatenate([self.array, np.zeros((rows, width), dtype=np.int32)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Sets columns [start, start + len(block_ids)) of the row."""
        end = start + len(block_ids)
        if end > self.array.shape[1]:
            width = 1 << (end - 1).bit_length()
            grown = np.zeros((self.array.shape[0], width), dtype=np.int32)
            grown[:, : self.array.shape[1]] = self.array
            self.array = grown
        self.array[row, start:end] = block_ids

    def release(self, row: int, length: int) -> None:
        """Gives the row back, reset to null blocks."""
        self.array[row, :length] = NULL_BLOCK
        self._free_rows.append(row)

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """The tables of `rows`, `width` columns each: a new [len(rows), width] int32 array."""
        return self.array[rows, :width]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its KV is computed


class CachedPrefix(list):
    """Block ids of a cached prefix (a list); state_row: the snapshot row to restore with it
    (hybrid models), None when the prefix needs no state or is empty. With a host tier, entries
    ON_HOST are copied back from host_slots[i] (their chain hash hashes[i]), and state_host_slot
    names a snapshot to copy back from the host (state_row is then None)."""

    state_row: int | None = None
    hashes: list[int] | None = None
    host_slots: dict[int, int] | None = None
    state_host_slot: int | None = None
    state_key: int | None = None


@dataclass
class StateSnapshotPlan:
    """One step's state-snapshot copies (picklable: every rank applies the same plan)."""

    restore_rows: list[int]  # before the step: snapshot row -> state slot
    restore_slots: list[int]
    save_slots: list[int]  # after the step: state slot -> snapshot row (chunks ending on a boundary)
    save_rows: list[int]
    interior_offsets: list[list[int]]  # per chunk of the step: boundaries strictly inside it
    interior_rows: list[int]  # their rows, chunk by chunk

    def __bool__(self) -> bool:
        return bool(self.restore_rows or self.save_rows or self.interior_rows)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_state_slots: int = 1 << 16,
                 state_cache: StateSnapshotCache | None = None, host_tier: HostKVTier | None = None):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order = eviction order (LRU): the first entry is reused first.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.block_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its full computed blocks
        self.stats = PrefixCacheStats()
        # Recurrent-state slots (hybrid models) follow the blocks: held while a sequence holds
        # blocks. Slot 0 is the padding slot, like the null block.
        self.free_state_slots = list(range(num_state_slots - 1, 0, -1))
        self.tables = BlockTables()
        self.state_cache = state_cache if enable_prefix_caching else None
        self._launched_restores: list[int] = []
        self.host_tier = host_tier if enable_prefix_caching else None
        if self.host_tier is not None and self.state_cache is not None:
            self.state_cache.on_evict = self.host_tier.evict_snapshot

    # ---- capacity ----
    @property
    def num_blocks(self) -> int:
        return usable_blocks(len(self.blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ---- prefix cache ----
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of seq. At least one token is left to compute,
        since the last position's logits are needed. With a host tier a block may come from either
        tier (ON_HOST entries); the GPU copy is preferred."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits, hashes = CachedPrefix(), []
        host, tier = {}, self.host_tier
        parent = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = chain_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                slot = tier.kv.find(h) if tier is not None else None
                if slot is None:
                    break
                block_id, host[i] = ON_HOST, slot
            hits.append(block_id)
            hashes.append(h)
            parent = h
        if self.state_cache is None:
            if host:
                hits.hashes, hits.host_slots = hashes, host
            return hits
        # The deepest snapshot boundary inside the KV chain.
        per = self.state_cache.interval // self.block_size
        for n in range(len(hits) // per * per, 0, -per):
            row = self.state_cache.find(hashes[n - 1])
            state_slot = None
            if row is None and tier is not None and tier.snapshots is not None:
                state_slot = tier.snapshots.find(hashes[n - 1])
            if row is not None or state_slot is not None:
                prefix = CachedPrefix(hits[:n])
                prefix.state_row, prefix.state_host_slot, prefix.state_key = row, state_slot, hashes[n - 1]
                prefix.hashes, prefix.host_slots = hashes[:n], {i: s for i, s in host.items() if i < n}
                return prefix
        return CachedPrefix()

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_hit_tokens

    # ---- allocation ----
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow seq's block table to cover num_computed_tokens (+ cached prefix) + num_new_tokens.
        Returns False, changing nothing, when the free pool is too small."""
        table = seq.block_table
        if not cached_blocks and seq.state_slot is not None \
                and seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return True  # the common decode step: the last block still has room
        prefix = cached_blocks if isinstance(cached_blocks, CachedPrefix) else None
        host = (prefix.host_slots or {}) if prefix is not None else {}
        num_revived = sum(1 for b in cached_blocks if b != ON_HOST and self.blocks[b].ref_count == 0)
        have = len(seq.block_table) + len(cached_blocks)
        total = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = max(0, self.blocks_needed(total) - have)
        if need + num_revived + len(host) > self.num_free_blocks:
            return False
        if seq.state_slot is None and not self.free_state_slots:
            return False
        if prefix is not None and (host or prefix.state_host_slot is not None) and not self._hold_host_prefix(prefix):
            return False
        if seq.state_slot is None:
            seq.state_slot = self.free_state_slots.pop()
        if seq.table_row is None:
            seq.table_row = self.tables.acquire()
        if self.state_cache is not None and prefix is not None:
            if prefix.state_row is not None:
                self.state_cache.acquire(prefix.state_row)
                seq.restore_state_row = prefix.state_row
                self.state_cache.stats.hits += 1
            else:
                self.state_cache.stats.misses += 1
        old_len = len(table)
        if cached_blocks:
            hashes = self.block_hashes.setdefault(seq.seq_id, [])
            for b in cached_blocks:  # GPU hits first: the blocks taken for host hits must not evict them
                if b != ON_HOST:
                    block = self.blocks[b]
                    if block.ref_count == 0:
                        del self.free[b]
                    block.ref_count += 1
            for i, b in enumerate(cached_blocks):
                if b == ON_HOST:  # a fresh block, filled from the host before the step's forward
                    b = self._take_free_block()
                    self.blocks[b].hash = prefix.hashes[i]
                    self.hash_to_block[prefix.hashes[i]] = b
                    self.host_tier.load_block(host[i], b)
                table.append(b)
                hashes.append(self.blocks[b].hash)
            seq.num_computed_tokens += len(cached_blocks) * self.block_size
        for _ in range(need):
            table.append(self._take_free_block())
        if len(table) > old_len:
            self.tables.write(seq.table_row, old_len, table[old_len:])
        return True

    def _hold_host_prefix(self, prefix: CachedPrefix) -> bool:
        """Holds the host entries a hit copies back (before any block or row is taken, since taking
        one may offload into the host tier) and gives a host snapshot a GPU row. False, holding
        nothing, when every snapshot row is in use."""
        tier = self.host_tier
        if prefix.state_host_slot is not None:
            slot = prefix.state_host_slot
            tier.hold(tier.snapshots, slot)
            row = self.state_cache.reserve()  # may offload an older snapshot
            if row is None:
                tier.unhold(tier.snapshots, slot)
                return False
            tier.load_snapshot(slot, row)
            self.state_cache.publish(row, prefix.state_key, restored=True)
            prefix.state_row, prefix.state_host_slot = row, None
        for slot in (prefix.host_slots or {}).values():
            tier.hold(tier.kv, slot)
        tier.stats.hits += 1
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.host_tier is not None:  # copied out before this step's forward
                    self.host_tier.evict_block(block.hash, block_id)
            block.hash = None
        block.ref_count = 1
        return block_id

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register seq's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes.setdefault(seq.seq_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            h = chain_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = h
                # First writer wins; a duplicate block with equal content is simply not shared.
                self.hash_to_block.setdefault(h, block.block_id)
        if seq.pending_state_saves:  # snapshots written by the steps these blocks came from
            done = [(b, row) for b, row in seq.pending_state_saves if b <= seq.num_computed_tokens]
            seq.pending_state_saves = seq.pending_state_saves[len(done):]
            for b, row in done:
                self.state_cache.publish(row, hashes[b // self.block_size - 1])

    def rollback(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Speculative decoding: seq's computed length goes back to num_computed_tokens (its
        rejected drafts), and the blocks past the one its next token goes into are freed. They hold
        no hash: only full blocks of computed tokens get one (cache_computed_blocks)."""
        seq.num_computed_tokens = num_computed_tokens
        keep = self.blocks_needed(num_computed_tokens + 1)
        dropped = seq.block_table[keep:]
        if not dropped:
            return
        for block_id in dropped:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        del seq.block_table[keep:]
        self.tables.write(seq.table_row, keep, [NULL_BLOCK] * len(dropped))

    def free_seq(self, seq: Sequence, cacheable: bool = True) -> None:
        """Release seq's blocks. Tail blocks are queued for eviction before head blocks, since
        a shared prefix is worth more than one request's tail. cacheable=False (e.g. a request
        whose logits went non-finite) drops the blocks' hashes so they are never reused."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if not cacheable and block.hash is not None and block.ref_count == 0:
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash = None
            if block.ref_count == 0:
                self.free[block_id] = None
        if seq.table_row is not None:
            self.tables.release(seq.table_row, len(seq.block_table))
            seq.table_row = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        self.block_hashes.pop(seq.seq_id, None)
        if seq.restore_state_row is not None:  # admitted, never launched
            self.state_cache.release(seq.restore_state_row)
            seq.restore_state_row = None
        for _, row in seq.pending_state_saves:
            self.state_cache.drop(row)
        seq.pending_state_saves = []

    # ---- recurrent-state snapshots (hybrid models) ----
    def plan_state_snapshots(self, chunks) -> StateSnapshotPlan | None:
        """The step's snapshot copies: restores for sequences starting from a cached prefix, and a
        row for every snapshot boundary (a multiple of the interval) a chunk reaches, written after
        the step when the chunk ends on it, by the model inside the chunk otherwise. A boundary
        gets no snapshot when every row is in use. None when there is nothing to copy."""
        cache = self.state_cache
        if cache is None:
            return None
        interval = cache.interval
        plan = StateSnapshotPlan([], [], [], [], [], [])
        for chunk in chunks:
            seq = chunk.seq
            if seq.restore_state_row is not None:
                plan.restore_rows.append(seq.restore_state_row)
                plan.restore_slots.append(seq.state_slot)
                self._launched_restores.append(seq.restore_state_row)
                seq.restore_state_row = None
            if chunk.num_drafts:  # a verify chunk: no boundary of it is known to be kept (spec_decode.py)
                plan.interior_offsets.append([])
                continue
            start = seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            inside = []
            for b in range((start // interval + 1) * interval, end + 1, interval):
                row = cache.reserve()
                if row is None:
                    break
                seq.pending_state_saves.append((b, row))
                if b == end:
                    plan.save_slots.append(seq.state_slot)
                    plan.save_rows.append(row)
                else:
                    inside.append(b - start)
                    plan.interior_rows.append(row)
            plan.interior_offsets.append(inside)
        return plan if plan else None

    def release_launched_restores(self) -> None:
        """The step's restores are launched (stream-ordered before any later write to their rows)."""
        for row in self._launched_restores:
            self.state_cache.release(row)
        self._launched_restores.clear()

    def reset_prefix_cache(self) -> None:
        """Forgets every unreferenced cached block and snapshot, in both tiers."""
        self.reset_gpu_tier()
        if self.host_tier is not None:
            self.host_tier.reset()

    def offload_prefix_cache(self) -> None:
        """Moves every unreferenced cached block and snapshot of the GPU tier to the host tier (the
        copies run before the next step's forward): the next hit on them is a host hit."""
        tier = self.host_tier
        if tier is None:
            raise ValueError("kv_offload_gib: there is no host tier to offload to")
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                tier.evict_block(block.hash, block_id)
        if self.state_cache is not None:
            for row in list(self.state_cache.lru):
                tier.evict_snapshot(self.state_cache.key_of[row], row)
        self.reset_gpu_tier()

    def reset_gpu_tier(self) -> None:
        """Forgets every unreferenced cached block and snapshot of the GPU tier."""
        if self.state_cache is not None:
            self.state_cache.reset()
        for block_id in self.free:
            self.blocks[block_id].hash = None
        self.hash_to_block = {h: b for h, b in self.hash_to_block.items() if self.blocks[b].ref_count > 0}

    # ---- host tier (host_kv_tier.py) ----
    def take_host_transfers(self):
        """The copies between the tiers the next step must run before its forward (None: none)."""
        return self.host_tier.take_plan() if self.host_tier is not None else None

    def release_launched_host_transfers(self) -> None:
        if self.host_tier is not None:
            self.host_tier.release_launched()
