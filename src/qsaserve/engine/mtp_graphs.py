"""CUDA graphs of the MTP head's drafting (engine/mtp_drafter.py `mtp_uniform_drafts`): after a
decode or verify step where every sequence brought n rows, the head's catch-up over those rows
and its k - 1 draft rows replay as one graph per (bucket, n), k drafts always (a sequence that
wants fewer keeps its first ones); a step where no sequence drafts (the automatic fallback's plain
steps, sequences out of room) replays the catch-up rows alone, a second graph per (bucket, n). Eagerly the head's rows cost more than the target's replayed
step at batch 1 (docs/benchmarks.md, speculative decoding: its catch-up alone made the step
5.91 ms instead of 2.79 on an H200).

Padding sequences of a bucket are dead rows (slot -1, seq_len 0, the scratch state slot, empty
tables): the head reads and writes nothing for them. The inputs are staged into fixed buffers
with one non_blocking copy per dtype; the head reads the decode graphs' hidden output buffer,
where a replayed step's rows already are (an eager step's are copied in).
Under tensor parallelism every rank captures the same keys in the same order and replays the
same one (the request is broadcast), as the decode graphs do.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from qsaserve.engine.batch import BatchInput
from qsaserve.engine.cuda_graph import PinnedStaging, aligned_starts, pick_bucket
from qsaserve.engine.mtp_drafter import (DeferredDrafts, MtpDraftRequest, UniformDraftInputs, apply_device_tokens,
                                         draft_table_width, mtp_uniform_drafts, uniform_host_inputs)

logger = logging.getLogger("qsaserve")


class MtpDraftGraphs:
    def __init__(self, model, buckets: list[int], rows: list[int], k: int, max_blocks: int, block_size: int,
                 hidden_dim: int, dtype: torch.dtype, device: torch.device, hidden: torch.Tensor | None = None):
        """buckets: sequence counts to capture; rows: rows per sequence (1 = decode, 2..k+1 =
        verifies); max_blocks: block-table columns the longest sequence (and its drafts) needs."""
        self.model, self.buckets, self.rows, self.k = model, sorted(buckets), sorted(rows), k
        self.block_size, self.device = block_size, device
        b, n = self.buckets[-1], self.rows[-1]
        self.width = max_blocks
        self.stage64 = PinnedStaging(torch.long, 5 * b * n + 4 * b, device, growable=False)
        self.stage32 = PinnedStaging(torch.int32, b * (1 + max_blocks), device, growable=False)
        # The rows the head reads: `hidden` (the decode graphs' output buffer, where a replayed
        # step's rows already are) when given and large enough, else a buffer of its own.
        fits = hidden is not None and hidden.shape[0] >= b * n and hidden.shape[1] == hidden_dim
        self.hidden = hidden if fits else torch.zeros(b * n, hidden_dim, dtype=dtype, device=device)
        # keyed (bucket, rows, drafts): drafts k, or 0 for the catch-up rows alone
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.drafts: dict[tuple[int, int, int], torch.Tensor] = {}
        self.replays = 0
        self.catch_up_replays = 0  # of which the catch-up rows alone

    def _layout(self, bucket: int, rows: int) -> list[int]:
        t = bucket * rows  # next ids | slots | positions | table lens | state slots | last, 16-byte aligned
        return aligned_starts([t, t, t, bucket, bucket, bucket], 2)

    def _inputs(self, bucket: int, rows: int, steps: int | None = None) -> UniformDraftInputs:
        at, d64, d32, t = self._layout(bucket, rows), self.stage64.dev, self.stage32.dev, bucket * rows
        seg = lambda i, n: d64[at[i] : at[i] + n]  # noqa: E731
        return UniformDraftInputs(next_ids=seg(0, t), slots=seg(1, t), positions=seg(2, t), seq_lens=d32[:bucket],
                                  block_tables=d32[bucket : bucket + bucket * self.width].view(bucket, self.width),
                                  table_lens=seg(3, bucket), state_slots=seg(4, bucket), last=seg(5, bucket),
                                  steps=self.k if steps is None else steps)

    def _stage(self, bucket: int, rows: int, batch: BatchInput | None, request: MtpDraftRequest | None) -> None:
        """The padded host arrays into the staging buffers (no request: all padding)."""
        at = self._layout(bucket, rows)
        arrays = uniform_host_inputs(batch, request, rows, bucket, self.width)
        flat64 = np.zeros(at[-1], dtype=np.int64)
        for i, name in enumerate(("next_ids", "slots", "positions", "table_lens", "state_slots", "last")):
            flat64[at[i] : at[i] + len(arrays[name])] = arrays[name]
        self.stage64.upload(flat64)
        self.stage32.upload(np.concatenate([arrays["seq_lens"], arrays["block_tables"].reshape(-1)]))

    def _keys(self) -> list[tuple[int, int, int]]:
        return sorted(((b, n, d) for b in self.buckets for n in self.rows for d in (self.k, 0)),
                      key=lambda key: (key[0] * key[1], key[2]), reverse=True)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Warms every key up (eager: builds kernels, runs any collective), then captures each,
        largest first, sharing `pool` (the decode graphs' memory pool)."""
        with torch.cuda.device(self.device):
            start = time.perf_counter()
            keys = self._keys()
            for bucket, rows, steps in keys:
                self._stage(bucket, rows, None, None)
                mtp_uniform_drafts(self.model, self.hidden[: bucket * rows], self._inputs(bucket, rows, steps),
                                   self.block_size)
            torch.cuda.synchronize()
            for key in keys:
                bucket, rows, steps = key
                self._stage(bucket, rows, None, None)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.drafts[key] = mtp_uniform_drafts(self.model, self.hidden[: bucket * rows],
                                                          self._inputs(bucket, rows, steps), self.block_size)
                self.graphs[key] = graph
            torch.cuda.synchronize()
        logger.info("CUDA graphs: captured the MTP head's drafting (and catch-up alone) for %d sizes x %s rows in %.1f s", len(self.buckets),
                    self.rows, time.perf_counter() - start)

    def fits(self, batch: BatchInput, request: MtpDraftRequest, rows: int) -> bool:
        return (rows in self.rows and pick_bucket(len(batch.query_lens), self.buckets) is not None
                and max(request.drafts) <= self.k and draft_table_width(batch, request, self.block_size) <= self.width)

    def run(self, batch: BatchInput, hidden: torch.Tensor, request: MtpDraftRequest, rows: int,
            fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> DeferredDrafts:
        """The drafts of a uniform step (mtp_drafter.uniform_rows > 0 and fits()), on the device: a
        view of the graph's output, which the next replay overwrites; its copy to the host and
        the next step's feed (spec_decode.draft_feed) are queued before that replay."""
        b = len(batch.query_lens)
        bucket = pick_bucket(b, self.buckets)
        self._stage(bucket, rows, batch, request)
        if fed is not None:  # the step's tokens, still on the device, into the staged inputs
            inp = self._inputs(bucket, rows)
            apply_device_tokens(inp.next_ids, inp.slots, inp.last, rows, *fed)
        if hidden.data_ptr() != self.hidden.data_ptr():  # an eager step's rows (a replay's are in place)
            self.hidden[: b * rows].copy_(hidden[: b * rows])
        key = (bucket, rows, self.k if max(request.drafts) else 0)
        self.graphs[key].replay()
        self.replays += 1
        if not key[2]:  # the catch-up rows alone: no drafts
            self.catch_up_replays += 1
            return DeferredDrafts(None, {}, request.drafts)
        return DeferredDrafts(self.drafts[key][:b], {i: i for i in range(b)}, request.drafts)


def capture_mtp_draft_graphs(model, decode_graphs, config, kv_spec, max_model_len: int, device: torch.device):
    """The head's draft graphs beside the target's decode graphs (their buckets up to the verify
    graphs' largest, rows 1..k+1), or None with the reason logged (the head then runs eagerly)."""
    k = config.speculative_config.num_speculative_tokens
    buckets = sorted({b for sizes in decode_graphs.verify_sizes.values() for b in sizes})
    if not buckets:
        return None
    rows = next(iter(decode_graphs.hidden.values()))  # the forward's output rows the head reads
    graphs = MtpDraftGraphs(model, buckets, list(range(1, k + 2)), k, kv_spec.blocks_for(max_model_len + k + 1),
                            kv_spec.block_size, rows.shape[1], rows.dtype, device, decode_graphs.hidden_out)
    try:
        graphs.capture(decode_graphs.pool)
    except RuntimeError as exc:
        torch.cuda.synchronize(device)
        logger.warning("CUDA graphs: the MTP head drafts eagerly (capture failed: %s)", exc)
        return None
    return graphs
