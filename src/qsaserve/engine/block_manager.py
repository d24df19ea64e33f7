"""Block manager: owns the KV-cache pages, with prefix caching.

A full block is identified by a hash chained over every token before it (hash of the parent
block's hash + this block's token ids), so equal hashes mean equal prefixes. Freed blocks that
hold a hash stay in the free list as cached blocks; a new prefix can revive them until they are
evicted, least recently freed first. Block 0 is the null block: never allocated, used as padding
in block tables so kernels always index valid memory.

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
from qsaserve.engine.sequence import Sequence

NULL_BLOCK = 0


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


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_state_slots: int = 1 << 16):
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
        since the last position's logits are needed."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        parent = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = chain_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

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
        num_revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        have = len(seq.block_table) + len(cached_blocks)
        total = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = max(0, self.blocks_needed(total) - have)
        if need + num_revived > self.num_free_blocks:
            return False
        if seq.state_slot is None:
            if not self.free_state_slots:
                return False
            seq.state_slot = self.free_state_slots.pop()
        if seq.table_row is None:
            seq.table_row = self.tables.acquire()
        old_len = len(table)
        if cached_blocks:
            hashes = self.block_hashes.setdefault(seq.seq_id, [])
            for b in cached_blocks:
                block = self.blocks[b]
                if block.ref_count == 0:
                    del self.free[b]
                block.ref_count += 1
                table.append(b)
                hashes.append(block.hash)
            seq.num_computed_tokens += len(cached_blocks) * self.block_size
        for _ in range(need):
            table.append(self._take_free_block())
        if len(table) > old_len:
            self.tables.write(seq.table_row, old_len, table[old_len:])
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register seq's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes.setdefault(seq.seq_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        if num_full == len(hashes):
            return
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            h = chain_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = h
                # First writer wins; a duplicate block with equal content is simply not shared.
                self.hash_to_block.setdefault(h, block.block_id)

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

    def reset_prefix_cache(self) -> None:
        for block_id in self.free:
            self.blocks[block_id].hash = None
        self.hash_to_block = {h: b for h, b in self.hash_to_block.items() if self.blocks[b].ref_count > 0}
