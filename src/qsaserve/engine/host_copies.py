"""One rank's half of the host KV tier: its pinned host rows for KV blocks and state snapshots and
the copies a step's HostTransferPlan asks for (engine/host_kv_tier.py decides, once, for every
rank; each rank moves its own tensors: its TP shard, its DCP pages, FP8 pages as raw bytes).
A block's host row holds every page the block's id addresses: the attention layers' and, with MTP
drafts, the draft head's own QSA pages, so a restored block drafts as it did before eviction."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from qsaserve.cache.geometry import CacheSplit, split_cache_budget
from qsaserve.cache.host_pool import HostPool, TransferStream, row_bytes
from qsaserve.cache.kv_cache import LayerCache
from qsaserve.engine.host_kv_tier import HostTransferPlan

logger = logging.getLogger("qsaserve")


def host_split(gib: float, bytes_per_block: int, block_tokens: int, snapshot_bytes: int, interval: int) -> CacheSplit:
    """KV blocks and snapshot slots `gib` GiB of host memory holds: the GPU tier's split
    (cache/geometry.py), one snapshot per interval of KV it holds."""
    return split_cache_budget(int(gib * 2**30), bytes_per_block, block_tokens, snapshot_bytes, interval)


def kv_rows(caches: list[LayerCache]) -> list[tuple[torch.Tensor, int]]:
    """The tensors a KV block is a row of: every layer's K/V pages (dim 1), its index pages (dim 0)."""
    rows = [(c.kv, 1) for c in caches]
    return rows + [(c.block_keys, 0) for c in caches if c.block_keys is not None]


def host_block_bytes(caches: list[LayerCache]) -> int:
    """Bytes of one block's host row: its page in every one of `caches`."""
    return row_bytes(kv_rows(caches))


class RankHostTier:
    def __init__(self, device: torch.device, num_blocks: int, block_bytes: int, num_snapshots: int = 0,
                 snapshot_bytes: int = 0):
        self.stream = TransferStream(device)
        self.kv = HostPool(num_blocks, block_bytes, device)
        self.snapshots = HostPool(num_snapshots, snapshot_bytes, device) if num_snapshots else None

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.snapshots.nbytes if self.snapshots else 0)

    def apply(self, plan: HostTransferPlan, caches: list[LayerCache], snapshot_pools: Callable[[], list[torch.Tensor]]
              ) -> None:
        """Runs the plan's copies, out before in, ordered before the step's forward (host_pool.py);
        caches: the pages a block row holds (host_block_bytes), snapshot_pools: the model's
        snapshot pools (rows along dim 1), asked for only when this tier keeps snapshots."""
        rows = kv_rows(caches)
        if row_bytes(rows) != self.kv.row_bytes:
            raise RuntimeError(f"host KV tier: a block is {row_bytes(rows)} bytes, the host rows {self.kv.row_bytes}")
        snapshot_pools = [(pool, 1) for pool in snapshot_pools()] if self.snapshots is not None else []
        with self.stream.ordered():
            if plan.kv_out_blocks:
                self.kv.offload(rows, plan.kv_out_blocks, plan.kv_out_slots)
            if plan.snap_out_rows:
                self.snapshots.offload(snapshot_pools, plan.snap_out_rows, plan.snap_out_slots)
            if plan.kv_in_slots:
                self.kv.load(rows, plan.kv_in_slots, plan.kv_in_blocks)
            if plan.snap_in_slots:
                self.snapshots.load(snapshot_pools, plan.snap_in_slots, plan.snap_in_rows)
