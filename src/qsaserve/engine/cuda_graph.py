"""Host-sync-free step inputs and CUDA graphs for decode-only steps.

A decode step of a small model is bound by kernel launches, not by the GPU: replaying a
captured graph launches the whole forward pass (and the LM head) with one call. A graph
reads fixed device addresses, so every step copies its inputs into static buffers first,
from pinned host memory with non_blocking copies: the host never waits on the device here.

One graph per batch-size bucket; a batch of B sequences runs in the smallest bucket >= B and
the extra rows are padding that the attention kernels skip: slot -1 (no KV write), seq_len 0
(no KV read), a block table of null blocks, and the scratch recurrent-state slot 0 that the
block manager never hands to a request.

Under tensor / decode-context parallelism the graphs hold the step's NCCL collectives too. Every
rank captures the same buckets in the same order, so their captured collective sequences match,
and replays the same bucket at the same step (the bucket is a function of the broadcast batch
alone). Collectives run only during the eager warm-ups, all of which come before the first
capture: a capture that fails on one rank (a capture runs nothing) leaves no peer waiting in a
collective, and the ranks then agree to drop graphs together (engine/executor/rank.py).
"""
from __future__ import annotations

import bisect
import collections
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from qsaserve.cache.kv_cache import KVCacheSpec
from qsaserve.engine.batch import BatchInput, TokenFeed
from qsaserve.layers.attention import AttentionMetadata

logger = logging.getLogger("qsaserve")

PAD_SLOT = -1  # KV cache slot of a padding row: nothing is written
PAD_STATE_SLOT = 0  # recurrent-state slot of a padding row (reserved scratch slot)


@dataclass
class StepMetadata(AttentionMetadata):
    """AttentionMetadata plus the state slots as a device tensor: a graph-safe model reads
    `state_slots_t` (int64 [B]) instead of the host list, whose values a graph cannot see."""

    state_slots_t: torch.Tensor | None = None
    # Prefill steps of the hybrid prefix cache (models/interfaces.py SupportsStateSnapshots): per
    # sequence, the chunk offsets whose state goes to a snapshot row, and those rows (int64).
    snapshot_offsets: list[list[int]] | None = None
    snapshot_rows: torch.Tensor | None = None


class PinnedStaging:
    """One pinned host buffer and its device twin: a step's integers are written on the host and
    land on the device with a single non_blocking copy. Before the host buffer is rewritten the
    previous copy must be done; its event has completed by then in steady state (the previous
    step's sampled tokens were read back), so the wait costs nothing."""

    def __init__(self, dtype: torch.dtype, capacity: int, device: torch.device, growable: bool = True):
        self.dtype, self.device, self.growable = dtype, device, growable
        self._pinned = device.type == "cuda"
        self._event = torch.cuda.Event() if self._pinned else None
        self._recorded = False
        self._alloc(max(capacity, 1))

    def _alloc(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=self.dtype, pin_memory=self._pinned)
        # On CPU the host buffer is the step's tensor: no copy to make.
        self.dev = torch.empty(capacity, dtype=self.dtype, device=self.device) if self._pinned else self.host

    def upload(self, values: list[int] | np.ndarray) -> torch.Tensor:
        """Copies `values` to the device; returns the device view [len(values)]. The view stays
        valid until the next upload."""
        n = len(values)
        if self._recorded:
            self._event.synchronize()
        if n > self.host.numel():
            if not self.growable:
                raise ValueError(f"staging: {n} values exceed the fixed capacity {self.host.numel()}")
            self._alloc(1 << (n - 1).bit_length())
        if n:
            self.host[:n].copy_(torch.as_tensor(values, dtype=self.dtype))
            if self._pinned:
                self.dev[:n].copy_(self.host[:n], non_blocking=True)
        if self._pinned:
            self._event.record(torch.cuda.current_stream(self.device))
            self._recorded = True
        return self.dev[:n]


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    from qsaserve.config import EngineConfig

    return EngineConfig(max_num_seqs=max_num_seqs, device="cpu").cuda_graph_capture_sizes


def pick_bucket(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= batch_size (sizes ascending), or None when it is too big."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def is_pure_decode(batch: BatchInput) -> bool:
    """Every sequence adds exactly one token and wants its logits row, in order."""
    b = len(batch.query_lens)
    return b > 0 and len(batch.input_ids) == b and batch.logits_indices == list(range(b))


@dataclass
class PaddedDecode:
    """A decode batch padded to `bucket` rows, laid out as the graph's staging expects."""

    bucket: int
    width: int  # block-table columns uploaded (the batch's longest table)
    int64: np.ndarray  # [input_ids | positions | slot_mapping | state_slots], bucket each
    int32: np.ndarray  # [seq_lens (bucket) | block tables (bucket x width, row-major)]


def pad_decode(batch: BatchInput, bucket: int) -> PaddedDecode:
    b = len(batch.query_lens)
    if b > bucket:
        raise ValueError(f"bucket: batch of {b} sequences does not fit bucket {bucket}")
    tables = batch.block_tables[:b]
    width = tables.shape[1]
    int64 = np.zeros(4 * bucket, dtype=np.int64)  # padding: token 0 at position 0
    int64[:b] = batch.input_ids
    int64[bucket : bucket + b] = batch.positions
    int64[2 * bucket : 2 * bucket + b] = batch.slot_mapping
    int64[2 * bucket + b : 3 * bucket] = PAD_SLOT
    int64[3 * bucket : 3 * bucket + b] = [PAD_STATE_SLOT if s is None else s for s in batch.state_slots]
    int64[3 * bucket + b :] = PAD_STATE_SLOT
    int32 = np.zeros(bucket + bucket * width, dtype=np.int32)  # padding: seq_len 0, null-block tables
    int32[:b] = batch.seq_lens
    int32[bucket : bucket + b * width] = tables.reshape(-1)
    return PaddedDecode(bucket, width, int64, int32)


class DecodeGraphs:
    """Captured decode graphs, one per bucket, sharing one memory pool and one set of static
    input buffers. Logits for every bucket row are computed inside the graph."""

    def __init__(self, model, sizes: list[int], max_model_len: int, kv_spec: KVCacheSpec, device: torch.device):
        if not sizes:
            raise ValueError("cuda_graph_sizes: no batch size to capture")
        self.model, self.sizes, self.max_model_len, self.device = model, sorted(sizes), max_model_len, device
        self.max_bs = self.sizes[-1]
        self.max_blocks = kv_spec.blocks_for(max_model_len)
        self.stage64 = PinnedStaging(torch.long, 4 * self.max_bs, device, growable=False)
        self.stage32 = PinnedStaging(torch.int32, self.max_bs * (1 + self.max_blocks), device, growable=False)
        self.block_tables = torch.zeros(self.max_bs, self.max_blocks, dtype=torch.int32, device=device)
        self.cu_query_lens = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays: collections.Counter[int] = collections.Counter()  # replays per bucket (tests, benchmarks)

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        """The static views a bucket's graph reads (fixed addresses inside the staging buffers)."""
        b, d64, d32 = bucket, self.stage64.dev, self.stage32.dev
        meta = StepMetadata(
            slot_mapping=d64[2 * b : 3 * b],
            block_tables=self.block_tables[:b],
            seq_lens=d32[:b],
            cu_query_lens=self.cu_query_lens[: b + 1],
            query_lens=[1] * b,
            seq_lens_list=[self.max_model_len] * b,  # a static upper bound; the device lengths are exact
            state_slots=[PAD_STATE_SLOT] * b,
            state_slots_t=d64[3 * b : 4 * b],
        )
        return d64[:b], d64[b : 2 * b], meta

    def _stage(self, padded: PaddedDecode) -> None:
        self.stage64.upload(padded.int64)
        d32 = self.stage32.upload(padded.int32)
        b, w = padded.bucket, padded.width
        self.block_tables[:b, :w].copy_(d32[b:].view(b, w))

    def _forward(self, bucket: int) -> torch.Tensor:
        input_ids, positions, meta = self._inputs(bucket)
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms every bucket up, then captures every bucket; largest first both times, so the
        smaller graphs reuse the largest one's pool memory. Inputs are all padding rows while
        capturing; the graphs never depend on their values.

        The warm-ups (eager: compile kernels, size workspaces, initialise NCCL communicators)
        all run before the first capture, because under tensor parallelism they are the only
        step that executes collectives: a capture records them without running anything, so a
        rank whose capture raises cannot leave its peers blocked in a warm-up collective."""
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            start = time.perf_counter()
            empty = BatchInput([], [], [], [], [], [[]], [], [])
            buckets = list(reversed(self.sizes))
            for bucket in buckets:
                self._stage(pad_decode(empty, bucket))
                self._forward(bucket)
            torch.cuda.synchronize()
            self.pool = torch.cuda.graph_pool_handle()
            for bucket in buckets:
                self._stage(pad_decode(empty, bucket))
                graph = torch.cuda.CUDAGraph()
                # thread_local: on rank 0 of a parallel engine the capture runs in a startup thread,
                # and CUDA calls of other threads (NCCL's watchdog) must not invalidate it.
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    self.logits[bucket] = self._forward(bucket)
                self.graphs[bucket] = graph
            torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("CUDA graphs: captured %d decode sizes (1..%d) in %.1f s, %.1f MiB of graph memory",
                    len(self.sizes), self.max_bs, time.perf_counter() - start, used / 2**20)

    def bucket_for(self, batch: BatchInput) -> int | None:
        if not is_pure_decode(batch):
            return None
        return pick_bucket(len(batch.query_lens), self.sizes)

    def replay(self, batch: BatchInput, bucket: int, feed: TokenFeed | None = None) -> torch.Tensor:
        """Runs a decode batch through its bucket's graph; returns a view [B, V] of the graph's
        logits buffer, valid until the next replay. feed: input ids taken on the device."""
        self._stage(pad_decode(batch, bucket))
        if feed is not None:  # the graph's input ids are the first bucket values of stage64
            feed.apply(self.stage64.dev[:bucket])
        self.graphs[bucket].replay()
        self.replays[bucket] += 1
        return self.logits[bucket][: len(batch.query_lens)]
