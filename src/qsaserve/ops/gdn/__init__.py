"""Gated DeltaNet ops (fla-core argument conventions), dispatched (`ops.dispatch.use_triton`):

* `gated_delta_rule`: fla-core's chunked / recurrent kernels, else the torch references.
* The decode step's small ops, one Triton launch each (triton_decode.py), else the torch
  references (decode_ops.py): `gdn_gates`, `conv1d_decode_` and `delta_rule_decode_` (per-slot
  state advanced in place), `conv1d_decode_rows_` and `delta_rule_decode_rows_` (a verify's rows
  of each sequence in one launch, the state after each row to its snapshot row), `gated_norm`.
* `causal_conv1d`: the prefill conv over every packed sequence of a step, each from its conv
  state (triton_conv.py), else `causal_conv1d_reference`."""
from __future__ import annotations

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.gdn.decode_ops import (conv1d_decode_reference_, conv1d_decode_rows_reference_,
                                         delta_rule_decode_reference_, delta_rule_decode_rows_reference_,
                                         gated_rms_norm, gdn_gates_reference)
from qsaserve.ops.gdn.delta_rule import gated_delta_rule, gated_delta_rule_with_states, warm_up_chunked
from qsaserve.ops.gdn.reference import (
    causal_conv1d_reference,
    causal_conv1d_update_reference,
    gdn_chunk_reference,
    gdn_recurrent_reference,
    l2norm,
)

try:  # CPU-only installs keep the references
    from qsaserve.ops.gdn import triton_conv, triton_decode
except ImportError:
    triton_conv = triton_decode = None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  conv_state: torch.Tensor | None = None, activation: str | None = "silu",
                  cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, C, T] (with cu_seqlens [N + 1]: B = 1, N sequences packed along T), weight [C, 1, W],
    conv_state [N, C, S] -> (act(causal conv over state ++ chunk) [B, C, T] in x.dtype, the new
    states [N, C, S]: the last S inputs of each). `causal_conv1d_reference` is the contract."""
    fn = triton_conv.causal_conv1d_triton if use_triton(x) else causal_conv1d_reference
    return fn(x, weight, bias, conv_state, activation=activation, cu_seqlens=cu_seqlens)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [T, Hv] (projection outputs) -> (beta = sigmoid(b) in b's dtype, g = -exp(A_log) *
    softplus(a + dt_bias) fp32), each [T, Hv]."""
    fn = triton_decode.gdn_gates_triton if use_triton(b) else gdn_gates_reference
    return fn(b, a, a_log, dt_bias)


def conv1d_decode_(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                   fresh: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [B, C] (one token per sequence), weight [C, 1, W], states [N, C, W-1] (slots[b]'s state
    advanced in place), fresh [B] bool (start from zeros) -> act(causal conv) [B, C]."""
    fn = triton_decode.conv1d_decode_triton_ if use_triton(x) else conv1d_decode_reference_
    return fn(x, weight, states, slots, fresh, activation)


def delta_rule_decode_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; states [N, Hv, Dk, Dv] fp32 (slots[b]'s
    state advanced in place), fresh [B] bool -> o [B, Hv, Dv]: one token of each sequence."""
    fn = triton_decode.delta_rule_decode_triton_ if use_triton(q) else delta_rule_decode_reference_
    return fn(q, k, v, g, beta, states, slots, fresh)


def conv1d_decode_rows_(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                        fresh: torch.Tensor, live: torch.Tensor, activation: str = "silu",
                        snapshots: torch.Tensor | None = None, snapshot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """n tokens of each sequence in order (a verify's rows): x [B, n, C], live [B, n] (a dead row
    leaves the state), snapshots [R, C, W-1] with snapshot_rows [B, n - 1] (the state after row j)
    -> act(causal conv) [B, n, C]; states[slots] advanced."""
    fn = triton_decode.conv1d_decode_rows_triton_ if use_triton(x) else conv1d_decode_rows_reference_
    return fn(x, weight, states, slots, fresh, live, activation, snapshots, snapshot_rows)


def delta_rule_decode_rows_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, live: torch.Tensor,
                            snapshots: torch.Tensor | None = None,
                            snapshot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """n tokens of each sequence in order (a verify's rows): q, k [B, n, Hk, Dk], v [B, n, Hv, Dv],
    g, beta [B, n, Hv], live [B, n] (a dead row leaves the state), snapshots [R, Hv, Dk, Dv] with
    snapshot_rows [B, n - 1] (the state after row j) -> o [B, n, Hv, Dv]; states[slots] advanced."""
    fn = triton_decode.delta_rule_decode_rows_triton_ if use_triton(q) else delta_rule_decode_rows_reference_
    return fn(q, k, v, g, beta, states, slots, fresh, live, snapshots, snapshot_rows)


def gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
               activation: str = "silu") -> torch.Tensor:
    """x, gate [T, Hv, Dv] -> weight * norm(x) * act(gate) per head (`gated_rms_norm`)."""
    if use_triton(x):
        return triton_decode.gated_rms_norm_triton(x, gate, weight, eps, activation)
    return gated_rms_norm(x, gate, weight, eps, activation)


__all__ = [
    "causal_conv1d",
    "causal_conv1d_reference",
    "causal_conv1d_update_reference",
    "conv1d_decode_",
    "conv1d_decode_rows_",
    "delta_rule_decode_",
    "delta_rule_decode_rows_",
    "gated_delta_rule",
    "gated_delta_rule_with_states",
    "gated_norm",
    "gated_rms_norm",
    "gdn_chunk_reference",
    "gdn_gates",
    "gdn_recurrent_reference",
    "l2norm",
    "warm_up_chunked",
]
