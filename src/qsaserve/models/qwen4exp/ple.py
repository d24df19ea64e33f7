"""PLE, the hashed n-gram per-layer embedding: each token's n-grams (continuing from the
sequence's last ngram-1 ids) hash to rows of a large table; the rows, projected and gated
against the residual streams, pass a dilated causal conv and are added to the residual. The
table lives wherever the runner placed it (gpu / host / disk, ple_table.py) and is reached
only through its row lookup. Everything else is replicated over the TP ranks."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qsaserve.models.qwen4exp.sharding import REPLICATED
from qsaserve.models.qwen4exp.state import PLEState, Step, by_row
from qsaserve.models.qwen4exp.weights import PackedWeight, Weight
from qsaserve.ops import gemv
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.fused import one_centred_rms_norm
from qsaserve.ops.ple import (PLEHashParams, dilated_conv_decode_, ngram_rows_decode_, ple_embed, ple_initial_context,
                              ple_layer_forward, stream_gate)


class PLE(nn.Module):
    """`Qwen4ExpTextPLELayer` of decoder layer `layer_idx` (0-based) over per-slot state."""

    # key_proj | value_proj read the same table rows: one parameter, one GEMM on the fused path.
    packed_names = {"key_proj.weight": ("key_value_proj.weight", "key"),
                    "value_proj.weight": ("key_value_proj.weight", "value")}

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        h, streams = cfg.hidden_size, cfg.hc_count * cfg.hidden_size
        self.hidden_size, self.hc_count, self.eps = h, cfg.hc_count, cfg.rms_norm_eps
        self.conv_span = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
        self.hash_params = PLEHashParams.from_config(cfg, layer_idx)
        self.table_row_dim = cfg.ple_embed_dim // self.hash_params.ngram_heads  # one head's embedding per row
        self.key_value_proj = PackedWeight(cfg.ple_embed_dim, [("key", streams, REPLICATED), ("value", h, REPLICATED)])
        self.norm_key = Weight((streams,))
        self.norm_query = Weight((streams,))
        self.norm_conv = Weight((streams,))
        self.conv1d = Weight((streams, 1, cfg.ple_conv_kernel_size))
        self.table = None  # row lookup (ple_table.py), bound by the runner
        self.state: PLEState | None = None

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> PLEState:
        # Hash constants live where the ids are, so hashing never copies them host->device.
        p = self.hash_params
        self.hash_params = p = dataclasses.replace(p, multipliers=p.multipliers.to(device),
                                                   head_vocab_sizes=p.head_vocab_sizes.to(device),
                                                   head_offsets=p.head_offsets.to(device))
        self.state = PLEState(ple_initial_context(p, num_slots, device),
                              torch.zeros(num_slots, self.hc_count * self.hidden_size, self.conv_span, dtype=dtype,
                                          device=device), p.eos_token_id)
        return self.state

    def forward(self, hyper: torch.Tensor, input_ids: torch.Tensor, step: Step) -> torch.Tensor:
        """The delta to add to the residual streams hyper [T, hc * H]."""
        if step.decode and use_triton(hyper):
            return self._decode_fused(hyper, input_ids, step)
        if step.decode:
            return self._decode_reference(hyper, input_ids, step)
        return self._prefill(hyper, input_ids, step)

    def _rows(self, step: Step) -> list[Step]:
        """The one-token steps of a decode step: itself, or its rows (decode rows)."""
        return step.rows or [step]

    def reference_weights(self) -> dict[str, torch.Tensor]:
        """ple_layer_forward's weights, by checkpoint name relative to `ple.`."""
        part = self.key_value_proj.part
        return {"key_proj.weight": part("key"), "value_proj.weight": part("value"),
                "norm_key.weight": self.norm_key.weight, "norm_query.weight": self.norm_query.weight,
                "norm_conv.weight": self.norm_conv.weight, "conv1d.weight": self.conv1d.weight}

    def _decode_reference(self, hyper, input_ids, step: Step) -> torch.Tensor:
        """Every sequence at once: [B, 1] chunks continuing from their slots, row by row for a
        decode-rows step (the state after each of a verify's rows saved)."""
        st, params, steps = self.state, self.hash_params, self._rows(step)
        n, out = len(steps), []
        for j, row in enumerate(steps):
            slots, fresh = row.slot_idx, row.fresh[:, None]
            ctx = torch.where(fresh, params.eos_token_id, st.ngram_context[slots])
            conv = torch.where(fresh[:, :, None], 0, st.conv[slots])
            delta, ctx, conv = ple_layer_forward(by_row(hyper, n, j)[:, None], by_row(input_ids, n, j)[:, None],
                                                 self.reference_weights(), params, self.table, self.hc_count, self.eps,
                                                 ctx, conv)
            st.ngram_context[slots] = ctx
            st.conv[slots] = conv
            step.save_row_state(st, j)
            out.append(delta[:, 0])
        return out[0] if n == 1 else torch.stack(out, dim=1).flatten(0, 1)

    def _prefill(self, hyper, input_ids, step: Step) -> torch.Tensor:
        st, w = self.state, self.reference_weights()
        out = torch.empty_like(hyper)
        snaps = step.snapshots
        ctx_at, conv_at = [], []  # states at the prefix cache's boundaries inside the chunks
        for i, ((a, b), slot) in enumerate(zip(step.spans, step.slots)):
            offsets = snaps.offsets[i] if snaps is not None and snaps.offsets[i] else None
            delta, ctx, conv, *at = ple_layer_forward(
                hyper[None, a:b], input_ids[None, a:b], w, self.hash_params, self.table, self.hc_count, self.eps,
                st.ngram_context[slot : slot + 1], st.conv[slot : slot + 1], state_offsets=offsets,
            )
            out[a:b] = delta[0]
            st.ngram_context[slot] = ctx[0]
            st.conv[slot] = conv[0]
            if at:
                ctx_at.append(at[0][:, 0])
                conv_at.append(at[1][:, 0])
        if ctx_at:
            st.snapshot_pools["ngram_context"].index_copy_(0, snaps.rows, torch.cat(ctx_at))
            st.snapshot_pools["conv"].index_copy_(0, snaps.rows, torch.cat(conv_at))
        return out

    def _decode_fused(self, hyper, input_ids, step: Step) -> torch.Tensor:
        """_decode_reference as the decode ops (the hashing, stream gate and dilated conv: one
        Triton kernel each on CUDA), the key | value projections as one GEMM, state slots updated
        in place."""
        st, params, h, eps = self.state, self.hash_params, self.hidden_size, self.eps
        steps = self._rows(step)
        n = len(steps)
        if n == 1:
            rows = ngram_rows_decode_(input_ids, st.ngram_context, step.slot_idx, step.fresh, params)
        else:  # decode rows: the n-gram contexts advance row by row, the rows' embeddings go at once
            per_row = []
            for j, row in enumerate(steps):
                per_row.append(ngram_rows_decode_(by_row(input_ids, n, j), st.ngram_context, row.slot_idx, row.fresh,
                                                  params))
                step.save_row_state(st, j, ("ngram_context",))
            rows = torch.stack(per_row, dim=1).flatten(0, 1)
        emb = ple_embed(rows, self.table).to(hyper.dtype)
        key, value = torch.split(gemv.linear(emb, self.key_value_proj.weight), self.key_value_proj.sizes(), dim=-1)
        key = one_centred_rms_norm(key, self.norm_key.weight, eps, h)
        query = one_centred_rms_norm(hyper, self.norm_query.weight, eps, h)
        gated = stream_gate(key, query, value, self.hc_count)
        normed = one_centred_rms_norm(gated, self.norm_conv.weight, eps, h)
        if n == 1:
            return dilated_conv_decode_(normed, gated, self.conv1d.weight, st.conv, step.slot_idx, step.fresh,
                                        params.ngram_size)
        outs = []
        for j, row in enumerate(steps):
            outs.append(dilated_conv_decode_(by_row(normed, n, j), by_row(gated, n, j), self.conv1d.weight, st.conv,
                                             row.slot_idx, row.fresh, params.ngram_size))
            step.save_row_state(st, j, ("conv",))
        return torch.stack(outs, dim=1).flatten(0, 1)
