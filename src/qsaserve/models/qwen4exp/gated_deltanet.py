"""Gated DeltaNet (the linear-attention layers): a causal depthwise conv over q | k | v, the gated
delta rule continuing from each sequence's recurrent state, a gated RMSNorm and the output
projection. This rank holds its key / value heads (outputs summed over the TP ranks)."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.models.interfaces import WarmsUpKernels
from qsaserve.models.qwen4exp.sharding import RankLayout
from qsaserve.models.qwen4exp.snapshots import state_windows
from qsaserve.models.qwen4exp.state import GDNState, Step
from qsaserve.models.qwen4exp.quantized import packed, project
from qsaserve.models.qwen4exp.weights import PackedWeight, ShardLoader, Weight, parameter
from qsaserve.ops.gdn import (causal_conv1d, conv1d_decode_, conv1d_decode_rows_, delta_rule_decode_,
                              delta_rule_decode_rows_, gated_delta_rule, gated_delta_rule_with_states, gated_norm,
                              gdn_gates, warm_up_chunked)


class GatedDeltaNet(nn.Module, WarmsUpKernels):
    """`Qwen4ExpTextGatedDeltaNet` on the paged runtime: all sequences of a step in one packed
    call, each continuing from its state slot (`reference.gdn_layer_forward` is the per-request
    reference)."""

    # in_proj_qkv | z | b | a read the same input: row ranges of one parameter, one GEMM.
    packed_names = {"in_proj_qkv.weight": ("in_proj.weight", "qkv"), "in_proj_z.weight": ("in_proj.weight", "z"),
                    "in_proj_b.weight": ("in_proj.weight", "b"), "in_proj_a.weight": ("in_proj.weight", "a")}

    def __init__(self, cfg, layout: RankLayout, quant=None, prefix: str = ""):
        super().__init__()
        self.ctx = layout.ctx
        self.key_heads = layout.gdn_key_heads[1] - layout.gdn_key_heads[0]
        self.value_heads = layout.gdn_value_heads[1] - layout.gdn_value_heads[0]
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        self.activation, self.eps = cfg.hidden_act, cfg.rms_norm_eps
        self.output_activation = cfg.output_gate_type or cfg.hidden_act
        hv, dv = self.value_heads, self.value_dim
        self.conv_dim = 2 * self.key_heads * self.key_dim + hv * dv
        qkv, per_head = layout.gdn_qkv_channels(), layout.gdn_per_head()
        in_parts = [("qkv", self.conv_dim, qkv), ("z", hv * dv, layout.gdn_value_rows()), ("b", hv, per_head),
                    ("a", hv, per_head)]
        self.in_proj = packed(cfg.hidden_size, in_parts, quant, prefix + "in_proj_qkv",
                              lambda: PackedWeight(cfg.hidden_size, in_parts))
        self.conv1d = Weight((self.conv_dim, 1, self.conv_kernel), qkv)
        self.dt_bias = parameter((hv,), ShardLoader(per_head))
        self.A_log = parameter((hv,), ShardLoader(per_head))
        self.norm = Weight((dv,))
        self.out_proj = packed(hv * dv, [(None, cfg.hidden_size, layout.gdn_out_proj())], quant, prefix + "out_proj",
                               lambda: Weight((cfg.hidden_size, hv * dv), layout.gdn_out_proj()),
                               full_in=cfg.linear_num_value_heads * dv)
        self.state: GDNState | None = None

    def warm_up_kernels(self, dtype: torch.dtype, max_tokens: int) -> int:
        """fla-core tunes its fused L2 norm by the step's tokens (ops.gdn.warm_up_chunked)."""
        return warm_up_chunked(self.key_heads, self.value_heads, self.key_dim, self.value_dim, dtype,
                               self.dt_bias.device, max_tokens)

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> GDNState:
        self.state = GDNState.zeros(num_slots, self.conv_dim, self.conv_kernel, self.value_heads, self.key_dim,
                                    self.value_dim, dtype, device)
        return self.state

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        hk, hv, dk, dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        t, st, slot_idx = x.shape[0], self.state, step.slot_idx
        mixed, z, b, a = torch.split(project(x, self.in_proj), self.in_proj.sizes(), dim=-1)
        z = z.reshape(t, hv, dv)
        # beta = sigmoid(b); decay g in fp32 (exp(A_log) may overflow half precision).
        beta, g = gdn_gates(b, a, self.A_log, self.dt_bias)
        conv_weight = self.conv1d.weight
        if step.decode and step.rows is None:
            o = self._decode_token(mixed, g, beta, step)
        elif step.decode:  # decode rows: the conv and the delta rule over all rows, one op each
            n, b = len(step.rows), t // len(step.rows)
            live, fresh, rows = torch.stack([row.valid for row in step.rows], dim=1), step.rows[0].fresh, step.row_snapshots
            pools = st.snapshot_pools if rows is not None else {"conv": None, "recurrent": None}
            conv = conv1d_decode_rows_(mixed.view(b, n, -1), conv_weight, st.conv, slot_idx, fresh, live, self.activation,
                                       pools["conv"], rows)
            q, k, v = torch.split(conv, [hk * dk, hk * dk, hv * dv], dim=-1)
            o = delta_rule_decode_rows_(q.reshape(b, n, hk, dk), k.reshape(b, n, hk, dk), v.reshape(b, n, hv, dv),
                                        g.view(b, n, hv), beta.view(b, n, hv), st.recurrent, slot_idx, fresh, live,
                                        pools["recurrent"], rows).view(t, hv, dv)
        else:
            old_conv = st.conv[slot_idx]
            conv, new_conv = causal_conv1d(mixed.t()[None], conv_weight, None, old_conv, activation=self.activation,
                                           cu_seqlens=step.cu_seqlens)
            st.conv[slot_idx] = new_conv
            q, k, v = torch.split(conv[0].t(), [hk * dk, hk * dk, hv * dv], dim=-1)
            args = (q.reshape(1, t, hk, dk), k.reshape(1, t, hk, dk), v.reshape(1, t, hv, dv), g[None], beta[None],
                    st.recurrent[slot_idx])
            if step.snapshots is None:
                o, final = gated_delta_rule(*args, step.cu_seqlens, single_token=t == len(step.spans),
                                            lengths=[b - a for a, b in step.spans])
            else:  # the prefix cache wants the state at block boundaries inside the chunks
                o, final, states = gated_delta_rule_with_states(*args, step.spans, step.snapshots.offsets)
                self._snapshot_prefill(mixed, old_conv, states, step)
            o = o[0]
            st.recurrent[slot_idx] = final.float()
        o = gated_norm(o, z, self.norm.weight, self.eps, self.output_activation)
        return self.ctx.all_reduce(project(o.reshape(t, hv * dv), self.out_proj))

    def _decode_token(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, step: Step) -> torch.Tensor:
        """One token per sequence (mixed [B, conv_dim]) from its conv and delta-rule state slots
        (both advanced in place; zeros when fresh) -> o [B, Hv, Dv]."""
        hk, hv, dk, dv, st, b = self.key_heads, self.value_heads, self.key_dim, self.value_dim, self.state, mixed.shape[0]
        conv = conv1d_decode_(mixed, self.conv1d.weight, st.conv, step.slot_idx, step.fresh, self.activation)
        q, k, v = torch.split(conv, [hk * dk, hk * dk, hv * dv], dim=-1)
        return delta_rule_decode_(q.view(b, hk, dk), k.view(b, hk, dk), v.view(b, hv, dv), g, beta, st.recurrent,
                                  step.slot_idx, step.fresh)

    def _snapshot_prefill(self, mixed: torch.Tensor, old_conv: torch.Tensor, recurrent: torch.Tensor,
                          step: Step) -> None:
        """Writes the states at step.snapshots' chunk offsets into the snapshot pool: the conv state
        there is the last Kc-1 conv inputs before the offset (the old state ++ the chunk's inputs),
        the delta-rule state comes from gated_delta_rule_with_states."""
        snaps, pools = step.snapshots, self.state.snapshot_pools
        span = old_conv.shape[-1]
        conv = [state_windows(torch.cat([old_conv[i], mixed[a:b].t().to(old_conv.dtype)], dim=-1), cut, span)
                for i, ((a, b), cut) in enumerate(zip(step.spans, snaps.offsets)) if cut]
        pools["conv"].index_copy_(0, snaps.rows, torch.cat(conv))
        pools["recurrent"].index_copy_(0, snaps.rows, recurrent)
