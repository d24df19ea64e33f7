"""Host-sync-free step inputs and CUDA graphs for decode-only steps.

A decode step of a small model is bound by kernel launches, not by the GPU: replaying a
captured graph launches the whole forward pass (and the LM head) with one call. A graph
reads fixed device addresses, so every step copies its inputs into static buffers first,
from pinned host memory with non_blocking copies: the host never waits on the device here.

One graph per batch-size bucket; a batch of B sequences runs in the smallest bucket >= B and
the extra rows are padding that the attention kernels skip: slot -1 (no KV write), seq_len 0
(no KV read), a block table of null blocks, and the scratch recurrent-state slot 0 that the
block manager never hands to a request.

With speculative decoding a bucket also has verify graphs for n = 2 .. k + 1 rows per sequence:
a step where every sequence verifies n - 1 drafts (BatchInput.verify_rows; a prompt chunk of the
same shape is not one). The model serves it as n decode rows (Qwen4Exp: state after each row into the
verify's per-position snapshot rows, staged like the other inputs); the graph gathers the rows
in the step's logits order before the LM head, and keeps the hidden rows (the MTP head reads them).

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
from qsaserve.layers.attention import Attention, AttentionMetadata

try:  # CPU-only installs: no Triton, no graphs
    from qsaserve.ops.attention.decode_triton import decode_qlen_cap
except ImportError:
    def decode_qlen_cap(group: int) -> int:
        return 1

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


# Verify graphs keep [bucket * (k + 1), vocab] logits: capture them up to this many sequences (a
# larger verify batch runs eagerly, where drafting rarely pays anyway: engine/draft_policy.py).
MAX_VERIFY_GRAPH_SEQS = 64


def verify_graph_plan(spec, config, attention_layers, state_rows_base: int) -> tuple[dict[int, list[int]], list[int]]:
    """DecodeGraphs' verify_sizes and pad_snapshot_rows for a speculative config (None: none):
    n = 2 .. k + 1 rows per sequence (a verify of fewer drafts: a request near its max_tokens,
    a head drafting fewer) in the decode buckets up to MAX_VERIFY_GRAPH_SEQS whose rows fit the
    step's token budget, where every paged-attention layer's decode kernel takes n query rows
    (ops/attention: decode_qlen_cap); the scratch slot 0's per-position rows start at
    state_rows_base (engine/spec_decode.py: base + slot * k + j)."""
    if spec is None:
        return {}, []
    k = spec.num_speculative_tokens
    cap = min([decode_qlen_cap(layer.num_heads // layer.num_kv_heads) for layer in attention_layers
               if isinstance(layer, Attention)], default=k + 1)
    if cap < k + 1:
        logger.info("CUDA graphs: verify steps of more than %d rows run eagerly (the paged-attention decode "
                    "kernel takes at most %d query rows per sequence at this head grouping)", cap, cap)
    sizes = {n: [b for b in config.cuda_graph_capture_sizes if b <= MAX_VERIFY_GRAPH_SEQS and b * n <= config.token_budget]
             for n in range(2, min(k + 1, cap) + 1)}
    return sizes, [state_rows_base + j for j in range(k)]


def aligned_starts(sizes: list[int], align: int) -> list[int]:
    """Start of each segment when every one begins at a multiple of `align` elements, then the
    total: a staged input at a 16-byte aligned offset (Triton specializes kernels on pointer
    alignment, so an offset that follows the step's counts would build new variants mid-serving)."""
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += -(-n // align) * align
    return starts + [at]


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
    """A decode or verify batch padded to `bucket` sequences of `rows` rows each, laid out as the
    graph's staging expects (Layout)."""

    bucket: int
    rows: int
    width: int  # block-table columns uploaded (the batch's longest table)
    int64: np.ndarray  # Layout(bucket, rows) segments
    int32: np.ndarray  # [seq_lens (bucket) | block tables (bucket x width, row-major)]


@dataclass(frozen=True)
class Layout:
    """Where a (bucket, rows) graph's int64 inputs sit in the staging buffer, each segment at a
    16-byte aligned start (Triton specializes on pointer alignment): input ids, positions and KV
    slots (bucket * rows each), state slots (bucket), and for verify graphs (rows > 1) the
    per-position snapshot rows (bucket * (rows - 1), sequence-major) and the logits order
    (bucket * rows)."""

    bucket: int
    rows: int

    @property
    def starts(self) -> list[int]:
        t, b = self.bucket * self.rows, self.bucket
        return aligned_starts([t, t, t, b] + ([b * (self.rows - 1), t] if self.rows > 1 else []), 2)

    def segment(self, buf: torch.Tensor | np.ndarray, i: int):
        starts, t, b = self.starts, self.bucket * self.rows, self.bucket
        sizes = [t, t, t, b, b * (self.rows - 1), t]
        return buf[starts[i] : starts[i] + sizes[i]]


def pad_decode(batch: BatchInput, bucket: int, rows: int = 1, pad_snapshot_rows: list[int] | None = None) -> PaddedDecode:
    """batch (B <= bucket sequences of `rows` rows) padded with rows that do nothing: token 0 at
    position 0, slot -1, seq_len 0, a null-block table, the scratch state slot, and (verify)
    pad_snapshot_rows[j], the scratch slot's row j, for their per-position snapshots."""
    b = len(batch.query_lens)
    if b > bucket:
        raise ValueError(f"bucket: batch of {b} sequences does not fit bucket {bucket}")
    t = b * rows
    tables = batch.block_tables[:b]
    width = tables.shape[1]
    layout = Layout(bucket, rows)
    int64 = np.zeros(layout.starts[-1], dtype=np.int64)
    layout.segment(int64, 0)[:t] = batch.input_ids
    layout.segment(int64, 1)[:t] = batch.positions
    slots = layout.segment(int64, 2)
    slots[:t] = batch.slot_mapping
    slots[t:] = PAD_SLOT
    states = layout.segment(int64, 3)
    states[:b] = [PAD_STATE_SLOT if s is None else s for s in batch.state_slots]
    states[b:] = PAD_STATE_SLOT
    if rows > 1:
        snaps = layout.segment(int64, 4).reshape(bucket, rows - 1)
        interior = batch.state_snapshots.interior_rows if batch.state_snapshots is not None else []
        if interior:
            snaps[:b] = np.asarray(interior, dtype=np.int64).reshape(b, rows - 1)
        snaps[b if interior else 0:] = pad_snapshot_rows[: rows - 1] if pad_snapshot_rows else 0
        order = layout.segment(int64, 5)
        order[:t] = batch.logits_indices
        order[t:] = np.arange(t, bucket * rows)
    int32 = np.zeros(bucket + bucket * width, dtype=np.int32)  # padding: seq_len 0, null-block tables
    int32[:b] = batch.seq_lens
    int32[bucket : bucket + b * width] = tables.reshape(-1)
    return PaddedDecode(bucket, rows, width, int64, int32)


class DecodeGraphs:
    """Captured decode graphs, one per bucket (and per bucket and verify row count), sharing one
    memory pool, one set of static input buffers and one pair of output buffers (hidden rows and
    logits, the largest graph's size: each graph copies its outputs into their head, so the
    graphs do not each keep a [rows, vocab] float32 tensor alive). Logits for every bucket row are
    computed inside the graph."""

    def __init__(self, model, sizes: list[int], max_model_len: int, kv_spec: KVCacheSpec, device: torch.device,
                 verify_sizes: dict[int, list[int]] | None = None, pad_snapshot_rows: list[int] | None = None):
        """verify_sizes: rows per sequence (k + 1) -> the buckets to capture a verify graph for;
        pad_snapshot_rows: the scratch state slot's per-position snapshot rows (padding rows
        of a verify graph write their states there)."""
        if not sizes:
            raise ValueError("cuda_graph_sizes: no batch size to capture")
        self.model, self.sizes, self.max_model_len, self.device = model, sorted(sizes), max_model_len, device
        self.verify_sizes = {n: sorted(b) for n, b in (verify_sizes or {}).items() if b and n > 1}
        self.pad_snapshot_rows = pad_snapshot_rows
        self.max_bs = self.sizes[-1]
        self.max_blocks = kv_spec.blocks_for(max_model_len)
        capacity = max([Layout(self.max_bs, 1).starts[-1]]
                       + [Layout(max(b), n).starts[-1] for n, b in self.verify_sizes.items()])
        max_seqs = max([self.max_bs] + [max(b) for b in self.verify_sizes.values()])
        self.stage64 = PinnedStaging(torch.long, capacity, device, growable=False)
        self.stage32 = PinnedStaging(torch.int32, max_seqs * (1 + self.max_blocks), device, growable=False)
        self.block_tables = torch.zeros(max_seqs, self.max_blocks, dtype=torch.int32, device=device)
        self.cu_query_lens = {n: torch.arange(0, (max_seqs + 1) * n, n, dtype=torch.int32, device=device)
                              for n in (1, *self.verify_sizes)}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self.replays: collections.Counter[int] = collections.Counter()  # replays per bucket (tests, benchmarks)
        self.verify_replays: collections.Counter[tuple[int, int]] = collections.Counter()  # per (bucket, rows)

    def _keys(self) -> list[tuple[int, int]]:
        """(bucket, rows) of every graph, largest first."""
        keys = [(b, 1) for b in self.sizes] + [(b, n) for n, bs in self.verify_sizes.items() for b in bs]
        return sorted(keys, key=lambda key: key[0] * key[1], reverse=True)

    def _inputs(self, bucket: int, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        """The static views a graph reads (fixed addresses inside the staging buffers)."""
        b, d64, d32, layout = bucket, self.stage64.dev, self.stage32.dev, Layout(bucket, rows)
        meta = StepMetadata(
            slot_mapping=layout.segment(d64, 2),
            block_tables=self.block_tables[:b],
            seq_lens=d32[:b],
            cu_query_lens=self.cu_query_lens[rows][: b + 1],
            query_lens=[rows] * b,
            seq_lens_list=[self.max_model_len] * b,  # a static upper bound; the device lengths are exact
            state_slots=[PAD_STATE_SLOT] * b,
            state_slots_t=layout.segment(d64, 3),
        )
        if rows > 1:
            meta.snapshot_offsets = [list(range(1, rows))] * b
            meta.snapshot_rows = layout.segment(d64, 4)
        return layout.segment(d64, 0), layout.segment(d64, 1), meta

    def _stage(self, padded: PaddedDecode) -> None:
        self.stage64.upload(padded.int64)
        d32 = self.stage32.upload(padded.int32)
        b, w = padded.bucket, padded.width
        self.block_tables[:b, :w].copy_(d32[b:].view(b, w))

    def _forward(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden rows [bucket * rows, ...], logits [bucket * rows, V] in the step's logits order)."""
        bucket, rows = key
        input_ids, positions, meta = self._inputs(bucket, rows)
        hidden = self.model(input_ids, positions, meta)
        if rows == 1:
            return hidden, self.model.compute_logits(hidden)
        return hidden, self.model.compute_logits(hidden[Layout(bucket, rows).segment(self.stage64.dev, 5)])

    def _pad(self, batch: BatchInput, key: tuple[int, int]) -> PaddedDecode:
        return pad_decode(batch, key[0], key[1], self.pad_snapshot_rows)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms every graph's shape up, then captures every one; largest first both times, so the
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
            keys = self._keys()
            for key in keys:
                self._stage(self._pad(empty, key))
                hidden, logits = self._forward(key)
                if key == keys[0]:  # the largest: one output buffer each, which every graph writes the head of
                    self.hidden_out = torch.empty_like(hidden)
                    self.logits_out = torch.empty_like(logits)
                del hidden, logits
            torch.cuda.synchronize()
            self.pool = torch.cuda.graph_pool_handle()
            for key in keys:
                self._stage(self._pad(empty, key))
                graph = torch.cuda.CUDAGraph()
                # thread_local: on rank 0 of a parallel engine the capture runs in a startup thread,
                # and CUDA calls of other threads (NCCL's watchdog) must not invalidate it.
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    hidden, logits = self._forward(key)
                    self.hidden[key] = self.hidden_out[: hidden.shape[0]]
                    self.hidden[key].copy_(hidden)
                    self.logits[key] = self.logits_out[: logits.shape[0]]
                    self.logits[key].copy_(logits)
                    del hidden, logits  # their pool blocks go back: the next capture reuses them
                self.graphs[key] = graph
            torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        verify = "".join(f", verify {n} rows x {len(b)} sizes" for n, b in self.verify_sizes.items())
        logger.info("CUDA graphs: captured %d decode sizes (1..%d)%s in %.1f s, %.1f MiB of graph memory",
                    len(self.sizes), self.max_bs, verify, time.perf_counter() - start, used / 2**20)

    def bucket_for(self, batch: BatchInput) -> tuple[int, int] | None:
        """The (bucket, rows) graph that serves batch, or None (eager)."""
        if is_pure_decode(batch):
            bucket = pick_bucket(len(batch.query_lens), self.sizes)
            return None if bucket is None else (bucket, 1)
        n, b = batch.verify_rows, len(batch.query_lens)
        if n not in self.verify_sizes or len(batch.input_ids) != b * n or len(batch.logits_indices) != b * n:
            return None
        plan = batch.state_snapshots
        if plan is not None and plan.interior_rows and len(plan.interior_rows) != b * (n - 1):
            return None
        bucket = pick_bucket(b, self.verify_sizes[n])
        return None if bucket is None else (bucket, n)

    def replay(self, batch: BatchInput, key: tuple[int, int], feed: TokenFeed | None = None) -> torch.Tensor:
        """Runs a batch through its graph; returns a view [N, V] of the graph's logits buffer (rows
        in the batch's logits order), valid until the next replay. feed: input ids taken on the
        device."""
        bucket, rows = key
        self._stage(self._pad(batch, key))
        if feed is not None:  # the graph's input ids are the first values of stage64
            feed.apply(self.stage64.dev[: bucket * rows])
        self.graphs[key].replay()
        if rows == 1:
            self.replays[bucket] += 1
        else:
            self.verify_replays[key] += 1
        return self.logits[key][: len(batch.logits_indices)]

    def hidden_rows(self, key: tuple[int, int], num_rows: int) -> torch.Tensor:
        """The last replay's hidden rows [num_rows, ...] (the model's forward output, row order)."""
        return self.hidden[key][:num_rows]
