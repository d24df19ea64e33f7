"""Qwen4Exp per-layer n-gram embedding (PLE): hashing (hashing.py), the layer reference and the
decode-step references (reference.py), and the decode-step ops, dispatched
(`ops.dispatch.use_triton`) to their Triton kernels (triton_ple.py) or references:

* `ngram_rows_decode_`: each token's hashed table rows from its slot's context (advanced in place).
* `stream_gate`: the per-stream sigmoid gate of the value by <key, query>.
* `dilated_conv_decode_`: residual + silu(dilated causal conv), the slot's conv state advanced.
* `gather_rows_`: table rows (`RowShards`, row_shards.py) by device-side row ids, from GPU memory
  or page-locked host memory over UVA (triton_gather.py); the host and disk placements' gather
  (models/ple_table.py)."""
from __future__ import annotations

import torch

from qsaserve.ops.dispatch import triton_runs, use_triton
from qsaserve.ops.ple.hashing import PLEHashParams, ple_initial_context, ple_ngram_ids
from qsaserve.ops.ple.row_shards import RowShards
from qsaserve.ops.ple.reference import (TableLookup, TensorRowTable, dilated_conv_decode_reference_,
                                        gather_rows_reference_, ngram_rows_decode_reference_, ple_embed,
                                        ple_layer_forward, ple_short_conv, stream_gate_reference)

try:  # CPU-only installs keep the references
    from qsaserve.ops.ple import triton_gather, triton_ple
except ImportError:
    triton_gather = triton_ple = None


def ngram_rows_decode_(tokens: torch.Tensor, contexts: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                       params: PLEHashParams) -> torch.Tensor:
    """tokens [B] (one per sequence); contexts [num_slots, n-1] (slots[b]'s row advanced in place);
    slots [B]; fresh [B] bool (start from EOS) -> table rows [B, ngram_heads] int64."""
    fn = triton_ple.ngram_rows_decode_ if use_triton(tokens) else ngram_rows_decode_reference_
    return fn(tokens, contexts, slots, fresh, params)


def stream_gate(key: torch.Tensor, query: torch.Tensor, value: torch.Tensor, hc: int) -> torch.Tensor:
    """key, query [B, hc*H], value [B, H] -> sigmoid(gate_s) * value per stream s, [B, hc*H]."""
    fn = triton_ple.stream_gate if use_triton(key) else stream_gate_reference
    return fn(key, query, value, hc)


def dilated_conv_decode_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                         slots: torch.Tensor, fresh: torch.Tensor, dilation: int) -> torch.Tensor:
    """x, residual [B, C]; weight [C, 1, K]; states [num_slots, C, (K-1)*dilation] (slots[b]'s row
    advanced in place); fresh [B] bool (start from zeros) -> residual + silu(conv) [B, C]."""
    fn = triton_ple.dilated_conv_decode_ if use_triton(x) else dilated_conv_decode_reference_
    return fn(x, residual, weight, states, slots, fresh, dilation)


def gather_rows_(out: torch.Tensor, table: RowShards, rows: torch.Tensor) -> torch.Tensor:
    """out [N, D]; table: row shards [R_s, D] (on rows' device, or page-locked mapped host memory
    when rows are on CUDA); rows [N] int64, each in [0, table.rows) -> out, out[i] = table row
    rows[i] in out's dtype. The kernel stays on with QSASERVE_FUSED_KERNELS=0 (`triton_runs`):
    its reference gathers a host table on the host, which a CUDA graph would freeze."""
    fn = triton_gather.gather_rows_ if triton_runs(rows) else gather_rows_reference_
    return fn(out, table, rows)


__all__ = ["PLEHashParams", "RowShards", "TableLookup", "TensorRowTable", "dilated_conv_decode_", "gather_rows_",
           "ngram_rows_decode_", "ple_embed", "ple_initial_context", "ple_layer_forward", "ple_ngram_ids",
           "ple_short_conv", "stream_gate"]
