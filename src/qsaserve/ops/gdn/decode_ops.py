"""The small ops around the gated delta rule in a GDN decode step, in plain torch (the references,
and the CPU path): the gates, the one-token causal conv with its per-slot state, and the gated
output norm. `triton_decode.py` runs each as one kernel; ops/gdn/__init__.py dispatches.

* gdn_gates: beta = sigmoid(b) (model dtype), g = -exp(A_log) * softplus(a + dt_bias) (fp32:
  exp(A_log) may overflow half precision).
* conv1d_decode_: depthwise causal conv of one token per sequence continuing from its state slot
  (zeros for a fresh sequence), SiLU; the slot's state (the last W-1 inputs) is updated in place.
* delta_rule_decode_: the gated delta rule for one token per sequence, continuing from its
  state slot (zeros for a fresh sequence), the slot advanced in place. The reference gathers the
  states, runs `delta_rule.gated_delta_rule` (fla-core's recurrent kernel on CUDA) and scatters them
  back; the Triton kernel reads and writes each state once, in its slot.
* gated_rms_norm: the GDN output norm (weight * norm(x), times act(gate) in fp32), also the
  model's CPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qsaserve.ops.gdn.delta_rule import gated_delta_rule


def gdn_gates_reference(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
                        dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [T, Hv] (projection outputs) -> (beta [T, Hv] in b's dtype, g [T, Hv] fp32)."""
    beta = torch.sigmoid(b)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return beta, g


def conv1d_decode_reference_(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                             fresh: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [B, C] (one token per sequence), weight [C, 1, W] or [C, W], states [N, C, W-1] (in place:
    slots[b]'s state becomes its last W-1 inputs), fresh [B] bool (start from zeros) -> act(y) [B, C]
    in x's dtype. fp32 math, like causal_conv1d_reference."""
    state = torch.where(fresh[:, None, None], 0, states[slots])
    w = weight.reshape(weight.shape[0], -1).float()  # [C, W]
    ext = torch.cat([state.float(), x.float()[:, :, None]], dim=-1)
    y = (ext[:, :, ext.shape[-1] - w.shape[-1]:] * w).sum(-1)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    states[slots] = ext[:, :, 1:].to(states.dtype)
    return y.to(x.dtype)


def delta_rule_decode_reference_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                                 fresh: torch.Tensor) -> torch.Tensor:
    """q, k [B, Hk, Dk], v [B, Hv, Dv], g [B, Hv] (fp32 log decay), beta [B, Hv]; states
    [N, Hv, Dk, Dv] fp32, slots [B], fresh [B] bool -> o [B, Hv, Dv] in q's dtype. q and k are
    L2-normalized inside, q scaled by Dk^-0.5; states[slots[b]] becomes the state after the token."""
    start = torch.where(fresh[:, None, None, None], 0, states[slots])
    o, final = gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], start, None,
                                single_token=True)  # a batch of one-token sequences: no cu_seqlens
    states[slots] = final.float()
    return o[:, 0]


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "silu"
) -> torch.Tensor:
    """GDN output norm (``Qwen4ExpTextRMSNormGated``), per head over the last dim.

    ``weight * norm(x)`` (plain weight, norm in fp32 then cast to the input dtype) times
    ``act(gate)`` in fp32; ``activation`` is ``config.output_gate_type or config.hidden_act``.
    """
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    act = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}.get(activation)
    if act is None:
        raise ValueError(f"unsupported activation {activation!r}")
    return ((weight * normed) * act(gate.float())).to(dtype)


def delta_rule_decode_rows_reference_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                                      fresh: torch.Tensor, live: torch.Tensor, snapshots: torch.Tensor | None = None,
                                      snapshot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """n tokens per sequence in order (a verify's rows): q, k [B, n, Hk, Dk], v [B, n, Hv, Dv], g,
    beta [B, n, Hv]; states [N, Hv, Dk, Dv] fp32, slots [B], fresh [B] (the sequence starts from
    zeros), live [B, n] bool (a dead row leaves the state as it is; its output is unspecified);
    snapshots [R, Hv, Dk, Dv] fp32 with snapshot_rows [B, n - 1]: the state after row j goes to
    row snapshot_rows[b, j]. -> o [B, n, Hv, Dv]; states[slots] end after the last live row."""
    b, n = q.shape[:2]
    state = torch.where(fresh[:, None, None, None], 0, states[slots])
    outs = []
    for j in range(n):
        o, new = gated_delta_rule(q[:, j, None], k[:, j, None], v[:, j, None], g[:, j, None], beta[:, j, None], state,
                                  None, single_token=True)
        state = torch.where(live[:, j, None, None, None], new.float(), state)
        outs.append(o[:, 0])
        if snapshots is not None and j < n - 1:
            snapshots[snapshot_rows[:, j]] = state
    states[slots] = state
    return torch.stack(outs, dim=1)


def conv1d_decode_rows_reference_(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                                  fresh: torch.Tensor, live: torch.Tensor, activation: str = "silu",
                                  snapshots: torch.Tensor | None = None,
                                  snapshot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """n tokens per sequence in order: x [B, n, C], live [B, n] (a dead row leaves the state; its
    output is unspecified, here zeros), snapshots [R, C, W-1] with snapshot_rows [B, n - 1] (the
    state after row j) -> act(y) [B, n, C]; states[slots] end after the last live row."""
    b, n, _ = x.shape
    state = torch.where(fresh[:, None, None], 0, states[slots])
    outs = []
    for j in range(n):
        scratch = state.clone()
        y = conv1d_decode_reference_(x[:, j], weight, scratch, torch.arange(b), torch.zeros(b, dtype=torch.bool),
                                     activation)
        keep = live[:, j]
        state = torch.where(keep[:, None, None], scratch, state)
        outs.append(torch.where(keep[:, None], y, 0))
        if snapshots is not None and j < n - 1:
            snapshots[snapshot_rows[:, j]] = state.to(snapshots.dtype)
    states[slots] = state.to(states.dtype)
    return torch.stack(outs, dim=1)
