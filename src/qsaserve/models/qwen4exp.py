"""Qwen4Exp (Qwen3.8-Flash-Next) text model on the engine's paged runtime.

Layers (see docs/qwen4exp.md for the math, checked piecewise against transformers):
  hyper = embed(ids) repeated over hc streams
  per layer: [PLE] -> GatedResidual -> GDN or QSA -> inject -> GatedResidual -> MoE -> inject
  final GatedResidual mixer -> lm_head
Per-request state lives in slots owned by the engine: GDN conv + recurrent state, PLE n-gram
context + conv state, and per QSA layer the raw index keys of the open group (< r tokens). QSA
layers keep K/V and pooled block keys in pages addressed by the request's block table. A sequence whose chunk starts at position 0 begins from
a fresh state, so preemption by recompute needs nothing special.
"""
from __future__ import annotations

import dataclasses
import logging
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qsaserve.cache.kv_cache import KVCacheSpec, LayerCache
from qsaserve.layers.attention import AttentionMetadata
from qsaserve.models.interfaces import (HasRecurrentState, HasSideTables, SideTableSpec, SupportsCudaGraphs,
                                        SupportsDcpCudaGraphs, SupportsDummyWeights)
from qsaserve.models.qwen4exp_blocks import (
    hc_expand,
    hc_inject,
    rms_norm,
    qsa_attention_output,
    qsa_norm_rope_qk,
    sparse_moe_block,
)
from qsaserve.ops.attention import write_kv
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.fused import norm_rope_heads, sigmoid_gated_add, silu_mul
from qsaserve.ops.gdn import (causal_conv1d_reference, conv1d_decode_, delta_rule_decode_, gated_delta_rule, gated_norm,
                              gdn_gates)
from qsaserve.ops.hyper_connection import hc_step
from qsaserve.ops.moe import moe_experts, moe_experts_sync_free, moe_route
from qsaserve.ops.ple import (PLEHashParams, dilated_conv_decode_, ngram_rows_decode_, ple_embed, ple_initial_context,
                              ple_layer_forward, stream_gate)
from qsaserve.ops.qsa_attention import sparse_attention_paged
from qsaserve.ops.qsa_indexer import (indexer_project, pool_chunk_groups, pool_completed_groups, rope_cos_sin,
                                      rope_inv_freq, select_decode, select_prefill)
from qsaserve.parallel.state import ParallelContext
from qsaserve.layers.vocab_parallel import vocab_parallel_embedding, vocab_parallel_logits
from qsaserve.parallel.tp import even_range, kv_head_range, shard_vocab, take

logger = logging.getLogger("qsaserve")

GDN = "linear_attention"
# transformers has called the QSA layer type each of these across releases.
QSA_NAMES = ("indexed_attention", "qwen_sparse_attention", "full_attention")


def parse_config(hf_config: dict):
    """A transformers Qwen4ExpTextConfig (it owns the defaults and validation) from a checkpoint's
    config: the `text_config` of a multimodal config, or a bare text config."""
    from transformers import Qwen4ExpTextConfig

    text = dict(hf_config.get("text_config") or hf_config)
    text.pop("model_type", None)
    text.pop("architectures", None)
    if "eos_token_id" not in text and "eos_token_id" in hf_config:
        text["eos_token_id"] = hf_config["eos_token_id"]
    return Qwen4ExpTextConfig(**text)


def weight_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every dense parameter of the text model, by HF name (without the `model.` prefix).
    PLE tables are not here: they are gathered by row from wherever they are placed."""
    H, hc, lr = cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank
    HC = hc * H
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, H), "lm_head.weight": (cfg.vocab_size, H)}

    def mixer(prefix: str, inject: bool) -> None:
        shapes[f"{prefix}.hc_norm.weight"] = (HC,)
        shapes[f"{prefix}.input_mix_weight_down.weight"] = (lr, HC)
        shapes[f"{prefix}.input_mix_weight_up.weight"] = (HC, lr)
        if inject:
            shapes[f"{prefix}.block_inject_weight.weight"] = (hc, HC)

    mixer("hyper_connection_mixer", inject=False)
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}"
        mixer(f"{p}.attn_hyper_connection", inject=True)
        mixer(f"{p}.mlp_hyper_connection", inject=True)
        if kind == GDN:
            conv_dim = 2 * Hk * Dk + Hv * Dv
            shapes.update({
                f"{p}.linear_attn.in_proj_qkv.weight": (conv_dim, H),
                f"{p}.linear_attn.in_proj_z.weight": (Hv * Dv, H),
                f"{p}.linear_attn.in_proj_b.weight": (Hv, H),
                f"{p}.linear_attn.in_proj_a.weight": (Hv, H),
                f"{p}.linear_attn.conv1d.weight": (conv_dim, 1, cfg.linear_conv_kernel_dim),
                f"{p}.linear_attn.dt_bias": (Hv,),
                f"{p}.linear_attn.A_log": (Hv,),
                f"{p}.linear_attn.norm.weight": (Dv,),
                f"{p}.linear_attn.out_proj.weight": (H, Hv * Dv),
            })
            if i + 1 in cfg.ple_layer_ids:
                Ep = cfg.ple_embed_dim
                shapes.update({
                    f"{p}.ple.key_proj.weight": (HC, Ep),
                    f"{p}.ple.value_proj.weight": (H, Ep),
                    f"{p}.ple.norm_key.weight": (HC,),
                    f"{p}.ple.norm_query.weight": (HC,),
                    f"{p}.ple.norm_conv.weight": (HC,),
                    f"{p}.ple.conv1d.weight": (HC, 1, cfg.ple_conv_kernel_size),
                })
        else:
            Hi, Di = cfg.indexer_n_heads, cfg.indexer_head_dim
            shapes.update({
                f"{p}.self_attn.q_proj.weight": (Hq * 2 * D, H),
                f"{p}.self_attn.k_proj.weight": (Hkv * D, H),
                f"{p}.self_attn.v_proj.weight": (Hkv * D, H),
                f"{p}.self_attn.o_proj.weight": (H, Hq * D),
                f"{p}.self_attn.q_norm.weight": (D,),
                f"{p}.self_attn.k_norm.weight": (D,),
                f"{p}.self_attn.indexer.index_qk_proj.weight": ((Hi + 1) * Di, H),
                f"{p}.self_attn.indexer.q_layernorm.weight": (Di,),
                f"{p}.self_attn.indexer.k_layernorm.weight": (Di,),
            })
            if cfg.attention_bias:
                for proj, n in (("q_proj", Hq * 2 * D), ("k_proj", Hkv * D), ("v_proj", Hkv * D), ("o_proj", H)):
                    shapes[f"{p}.self_attn.{proj}.bias"] = (n,)
        shapes.update({
            f"{p}.mlp.gate.weight": (E, H),
            f"{p}.mlp.experts.gate_up_proj": (E, 2 * I, H),
            f"{p}.mlp.experts.down_proj": (E, H, I),
            f"{p}.mlp.shared_expert.gate_proj.weight": (Is, H),
            f"{p}.mlp.shared_expert.up_proj.weight": (Is, H),
            f"{p}.mlp.shared_expert.down_proj.weight": (H, Is),
            f"{p}.mlp.shared_expert_gate.weight": (1, H),
        })
    return shapes


class QSACacheLayer:
    """What the runner binds a QSA layer's pages to (same interface as layers.attention.Attention)."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.cache: LayerCache | None = None

    def warm_up(self, dtype: torch.dtype) -> int:
        return 0  # no warm-up: the QSA kernels compile on first use (graph capture builds its buckets')


@dataclass
class _LayerState:
    conv: torch.Tensor | None = None  # GDN conv state [slots, conv_dim, Kc-1]
    recurrent: torch.Tensor | None = None  # GDN state [slots, Hv, Dk, Dv] fp32
    ngram_context: torch.Tensor | None = None  # PLE [slots, ngram-1] int64
    ple_conv: torch.Tensor | None = None  # PLE [slots, HC, (Kp-1)*ngram]
    index_tail: torch.Tensor | None = None  # QSA raw index keys [slots, r, Di]: row j = latest position = j (mod r)


class Qwen4ExpForCausalLM(nn.Module, HasRecurrentState, HasSideTables, SupportsCudaGraphs, SupportsDcpCudaGraphs,
                          SupportsDummyWeights):
    # CUDA graphs: steps where every sequence decodes one token take a path free of host syncs and
    # of data-dependent shapes (see _decode_step), DCP slots included (derived on the device).

    def __init__(self, hf_config: dict, max_positions: int, parallel: ParallelContext | None = None):
        super().__init__()
        self.ctx = parallel or ParallelContext()
        cfg = parse_config(hf_config)
        self.cfg = cfg
        # This rank's head counts (tensor parallel; see _tp_shard). KV / GDN key heads are duplicated
        # when there are fewer than ranks.
        t = self.ctx.tp_size
        self.num_heads = cfg.num_attention_heads // t
        self.num_kv_heads = -(-cfg.num_key_value_heads // t)
        self.gdn_key_heads = -(-cfg.linear_num_key_heads // t)
        self.gdn_value_heads = cfg.linear_num_value_heads // t
        self.ple_tables: dict[int, object] = {}  # layer index -> row lookup, set by the loader
        self.ple_params = {i: PLEHashParams.from_config(cfg, i) for i in range(cfg.num_hidden_layers) if i + 1 in cfg.ple_layer_ids}
        for i in self.ple_params:
            if cfg.layer_types[i] != GDN:
                raise ValueError(f"model: PLE layer {i + 1} must be a linear_attention layer")
        # Parameters are kept by HF name, this rank's shard; torch.empty: every one is overwritten on load.
        self.weights: dict[str, torch.Tensor] = {
            n: torch.empty(self._tp_shard(n, torch.empty(s, device="meta")).shape) for n, s in weight_shapes(cfg).items()}
        if cfg.tie_word_embeddings:
            self.weights["lm_head.weight"] = self.weights["embed_tokens.weight"]
        # Projections that read the same input share one tensor, each name a row range of it, so a
        # step can run them as one GEMM (loading still copies into each name's rows).
        self.fused_inputs: dict[object, tuple[torch.Tensor, list[int]]] = {}
        self.fused_mlp_inputs: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for i, kind in enumerate(cfg.layer_types):
            names = _GDN_INPUTS if kind == GDN else _QSA_INPUTS
            self.fused_inputs[i] = self._share_rows([f"layers.{i}.{n}" for n in names])
            self.fused_mlp_inputs[i] = self._share_rows([f"layers.{i}.{n}" for n in _MLP_INPUTS])
            if i in self.ple_params:  # key and value projections of the table embedding
                self.fused_inputs[("ple", i)] = self._share_rows([f"layers.{i}.ple.key_proj.weight",
                                                                  f"layers.{i}.ple.value_proj.weight"])
        self.layer_weights = [self._sub(f"layers.{i}.") for i in range(cfg.num_hidden_layers)]
        # Each layer's module weights by short name, grouped once (the tensors are shared, and
        # loading copies into them in place): a step does no per-layer name filtering.
        self.layer_parts = [{part: _strip(w, part + ".") for part in ("mlp", "ple", "linear_attn", "self_attn")}
                            for w in self.layer_weights]
        if getattr(cfg, "attention_bias", False):  # the QSA projections here carry no bias terms
            raise ValueError("model: Qwen4Exp checkpoints with attention_bias=True are not supported")
        unknown = sorted(set(cfg.layer_types) - {GDN, *QSA_NAMES})
        if unknown:
            raise ValueError(f"model: unsupported Qwen4Exp layer types {unknown}")
        self.qsa_layers = {i: QSACacheLayer(self.num_kv_heads, cfg.head_dim) for i, k in enumerate(cfg.layer_types) if k != GDN}
        rotary = int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        self.inv_freq = rope_inv_freq(cfg.head_dim, rotary / cfg.head_dim, cfg.rope_parameters["rope_theta"])
        self.state: list[_LayerState] = [_LayerState() for _ in cfg.layer_types]

    def _share_rows(self, names: list[str]) -> tuple[torch.Tensor, list[int]]:
        """One [sum of rows, in] tensor whose row ranges become `names`' weights; (it, row counts)."""
        parts = [self.weights[n] for n in names]
        fused = torch.empty((sum(p.shape[0] for p in parts), parts[0].shape[1]), dtype=parts[0].dtype,
                            device=parts[0].device)
        rows, start = [], 0
        for n, p in zip(names, parts):
            self.weights[n] = fused[start:start + p.shape[0]]
            rows.append(p.shape[0])
            start += p.shape[0]
        return fused, rows

    def _sub(self, prefix: str) -> dict[str, torch.Tensor]:
        return _strip(self.weights, prefix)

    # ---- caches and state ----
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """This rank's pages at DCP1 (B tokens each); the runner scales it for DCP."""
        c = self.cfg
        return KVCacheSpec(len(self.qsa_layers), self.num_kv_heads, c.head_dim, dtype, block_size,
                           index_head_dim=c.indexer_head_dim, index_ratio=c.indexer_compress_ratio)

    def attention_layers(self) -> list[QSACacheLayer]:
        return list(self.qsa_layers.values())

    def attention_layer_ids(self) -> list[int]:
        return list(self.qsa_layers)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return self.weights

    def side_table_layers(self) -> dict[int, SideTableSpec]:
        c = self.cfg
        row_dim = c.ple_embed_dim // ((c.ngram_size - 1) * c.heads_per_ngram)
        return {i: SideTableSpec(p.table_rows, row_dim) for i, p in self.ple_params.items()}

    def bind_side_tables(self, tables) -> None:
        self.ple_tables = dict(tables)

    def allocate_state(self, num_slots: int, device: torch.device) -> None:
        c = self.cfg
        dtype = self.weights["embed_tokens.weight"].dtype
        conv_dim = 2 * self.gdn_key_heads * c.linear_key_head_dim + self.gdn_value_heads * c.linear_value_head_dim
        total = 0
        for i, kind in enumerate(c.layer_types):
            st = self.state[i]
            if kind != GDN:
                # Raw index keys are kept only until their group completes and is pooled into a
                # block key: the open group's (< r) are read, r rows keep the slot's layout fixed.
                st.index_tail = torch.zeros(num_slots, c.indexer_compress_ratio, c.indexer_head_dim, dtype=dtype,
                                            device=device)
                total += st.index_tail.nbytes
                continue
            st.conv = torch.zeros(num_slots, conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
            st.recurrent = torch.zeros(num_slots, self.gdn_value_heads, c.linear_key_head_dim,
                                       c.linear_value_head_dim, dtype=torch.float32, device=device)
            total += st.conv.nbytes + st.recurrent.nbytes
            if i in self.ple_params:
                # Hash constants live where the ids are, so hashing never copies them host->device.
                params = self.ple_params[i] = dataclasses.replace(
                    self.ple_params[i], multipliers=self.ple_params[i].multipliers.to(device),
                    head_vocab_sizes=self.ple_params[i].head_vocab_sizes.to(device),
                    head_offsets=self.ple_params[i].head_offsets.to(device))
                st.ngram_context = ple_initial_context(params, num_slots, device)
                span = (c.ple_conv_kernel_size - 1) * c.ngram_size
                st.ple_conv = torch.zeros(num_slots, c.hc_count * c.hidden_size, span, dtype=dtype, device=device)
                total += st.ngram_context.nbytes + st.ple_conv.nbytes
        logger.info("recurrent state: %d slots x %.1f KiB = %.1f MiB", num_slots, total / num_slots / 1024, total / 2**20)

    def _reset_fresh_slots(self, slots: list[int], meta: AttentionMetadata) -> None:
        fresh = [s for s, n, length in zip(slots, meta.query_lens, meta.seq_lens_list) if length == n]
        if not fresh:
            return
        for i, st in enumerate(self.state):
            if st.index_tail is not None:
                st.index_tail[torch.tensor(fresh, device=st.index_tail.device)] = 0
            if st.conv is None:
                continue
            idx = torch.tensor(fresh, device=st.conv.device)
            st.conv[idx] = 0
            st.recurrent[idx] = 0
            if st.ngram_context is not None:
                st.ngram_context[idx] = self.ple_params[i].eos_token_id
                st.ple_conv[idx] = 0

    # ---- forward ----
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        c = self.cfg
        self.inv_freq = self.inv_freq.to(input_ids.device)
        step = self._decode_step(input_ids, meta) if _is_decode(input_ids, meta) else self._prefill_step(input_ids, meta)
        embeds = vocab_parallel_embedding(self.weights["embed_tokens.weight"], input_ids, c.vocab_size, self.ctx)
        hyper = hc_expand(embeds, c.hc_count)
        pending = None  # (block output, injection weights) not yet added to hyper
        for i, kind in enumerate(c.layer_types):
            w = self.layer_weights[i]
            if i in self.ple_params:
                if pending is not None:
                    hyper, pending = hc_inject(hyper, *pending), None
                hyper = hyper + self._ple(i, hyper, input_ids, step)
            # Each hyper-connection step adds the previous block's output, then mixes the next input.
            hyper, mixed, inject = self._hc_step(w, "attn_hyper_connection.", hyper, pending)
            if kind == GDN:
                out = self._gdn(i, mixed, step)
            elif step.decode:
                out = self._qsa_decode(i, mixed, positions, meta, step)
            else:
                out = self._qsa(i, mixed, positions, step, meta)
            hyper, mixed, inject2 = self._hc_step(w, "mlp_hyper_connection.", hyper, (out, inject))
            pending = (self.ctx.all_reduce(self._moe(i, mixed, step)), inject2)
        return hc_inject(hyper, *pending) if pending is not None else hyper

    def _prefill_step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> "_Step":
        """Any step with a multi-token query: per-sequence loops over host lists."""
        self._reset_fresh_slots(meta.state_slots, meta)
        spans = _spans(meta.query_lens)
        dev = input_ids.device
        return _Step(decode=False, spans=spans, slots=list(meta.state_slots),
                     slot_idx=torch.tensor(meta.state_slots, device=dev),
                     cu_seqlens=torch.tensor([0] + [b for _, b in spans], device=dev))

    def _decode_step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> "_Step":
        """One token per sequence: everything comes from device tensors, shapes from tensor shapes,
        so the step has no host syncs and can be captured in a CUDA graph. Padding rows (seq_len 0,
        slot -1, null block table, a scratch state slot) see nothing and write no real cache."""
        slot_idx = getattr(meta, "state_slots_t", None)
        if slot_idx is None:  # built once per step, shared by every layer
            slot_idx = torch.tensor(meta.state_slots, dtype=torch.long, device=input_ids.device)
        seq_lens = meta.seq_lens.long()
        valid = seq_lens > 0
        step = _Step(decode=True, slot_idx=slot_idx.long(), valid=valid,
                     # A one-token prompt's state starts here; padding rows (seq_len 0) also start
                     # from zeros, not from what other padding rows left in the shared scratch slot.
                     fresh=seq_lens <= 1,
                     query_pos=torch.where(valid, seq_lens - 1, -1))
        dcp = self.ctx.dcp
        if dcp.enabled:
            step.kv_slots = dcp.decode_slots(meta.slot_mapping)
        else:
            step.kv_slots = meta.slot_mapping
        return step

    def compute_logits(self, hyper: torch.Tensor) -> torch.Tensor:
        _, final, _ = hc_step(
            hyper, None, None, self.weights["hyper_connection_mixer.hc_norm.weight"],
            self.weights["hyper_connection_mixer.input_mix_weight_down.weight"],
            self.weights["hyper_connection_mixer.input_mix_weight_up.weight"], None, self.cfg.hc_count, self.cfg.rms_norm_eps,
        )
        return vocab_parallel_logits(final, self.weights["lm_head.weight"], self.cfg.vocab_size, self.ctx)

    def _moe(self, i: int, x: torch.Tensor, step: "_Step") -> torch.Tensor:
        """The sparse MoE block (`qwen4exp_blocks.sparse_moe_block` is the reference and the CPU
        path). CUDA: the router, the shared expert's gate/up projections and its gate in one GEMM,
        SiLU-mul fused, the routed experts through ops.moe's in-place kernels at decode."""
        c, mlp = self.cfg, self.layer_parts[i]["mlp"]
        if not use_triton(x) or x.dim() != 2 or c.hidden_act not in ("silu", "swish"):
            return sparse_moe_block(x, mlp, c.num_experts_per_tok, c.norm_topk_prob, c.hidden_act, sync_free=step.decode)
        fused, rows = self.fused_mlp_inputs[i]  # router | shared gate_proj | shared up_proj | shared gate
        logits, gate_up, shared_gate = torch.split(F.linear(x, fused), [rows[0], rows[1] + rows[2], rows[3]], dim=-1)
        top_w, top_i = moe_route(logits, c.num_experts_per_tok, c.norm_topk_prob)
        experts = moe_experts_sync_free if step.decode else moe_experts
        routed = experts(x, top_i, top_w, mlp["experts.gate_up_proj"], mlp["experts.down_proj"], c.hidden_act)
        shared = F.linear(silu_mul(gate_up), mlp["shared_expert.down_proj.weight"])
        return sigmoid_gated_add(routed, shared, shared_gate)  # routed + sigmoid(gate) * shared

    def _hc_step(self, w: dict, prefix: str, hyper: torch.Tensor, pending):
        """hyper += pending's output (per-stream weights), then this mixer's block input and the
        injection weights for its block (`ops.hyper_connection`: Triton on CUDA)."""
        out, inject = pending if pending is not None else (None, None)
        return hc_step(
            hyper, out, inject, w[prefix + "hc_norm.weight"], w[prefix + "input_mix_weight_down.weight"],
            w[prefix + "input_mix_weight_up.weight"], w[prefix + "block_inject_weight.weight"],
            self.cfg.hc_count, self.cfg.rms_norm_eps,
        )

    def _ple(self, i: int, hyper, input_ids, step: "_Step") -> torch.Tensor:
        st, ple_w = self.state[i], self.layer_parts[i]["ple"]
        params = self.ple_params[i]
        if step.decode and use_triton(hyper):
            return self._ple_decode_fused(i, hyper, input_ids, step)
        if step.decode:  # every sequence at once: [B, 1] chunks continuing from their slots
            slots, fresh = step.slot_idx, step.fresh[:, None]
            ctx = torch.where(fresh, params.eos_token_id, st.ngram_context[slots])
            conv = torch.where(fresh[:, :, None], 0, st.ple_conv[slots])
            delta, ctx, conv = ple_layer_forward(hyper[:, None], input_ids[:, None], ple_w, params, self.ple_tables[i],
                                                 self.cfg.hc_count, self.cfg.rms_norm_eps, ctx, conv)
            st.ngram_context[slots] = ctx
            st.ple_conv[slots] = conv
            return delta[:, 0]
        out = torch.empty_like(hyper)
        for (a, b), slot in zip(step.spans, step.slots):
            delta, ctx, conv = ple_layer_forward(
                hyper[None, a:b], input_ids[None, a:b], ple_w, params, self.ple_tables[i], self.cfg.hc_count,
                self.cfg.rms_norm_eps, st.ngram_context[slot : slot + 1], st.ple_conv[slot : slot + 1],
            )
            out[a:b] = delta[0]
            st.ngram_context[slot] = ctx[0]
            st.ple_conv[slot] = conv[0]
        return out

    def _ple_decode_fused(self, i: int, hyper, input_ids, step: "_Step") -> torch.Tensor:
        """The decode branch of `_ple` (ple_layer_forward on [B, 1] chunks, its reference) with
        the hashing, stream gate and dilated conv as Triton kernels, state slots updated in place."""
        c, st, w, params = self.cfg, self.state[i], self.layer_parts[i]["ple"], self.ple_params[i]
        h, eps = c.hidden_size, c.rms_norm_eps
        rows = ngram_rows_decode_(input_ids, st.ngram_context, step.slot_idx, step.fresh, params)
        emb = ple_embed(rows, self.ple_tables[i]).to(hyper.dtype)
        fused, split = self.fused_inputs[("ple", i)]
        key, value = torch.split(F.linear(emb, fused), split, dim=-1)
        key = rms_norm(key, w["norm_key.weight"], eps, h)
        query = rms_norm(hyper, w["norm_query.weight"], eps, h)
        gated = stream_gate(key, query, value, c.hc_count)
        normed = rms_norm(gated, w["norm_conv.weight"], eps, h)
        return dilated_conv_decode_(normed, gated, w["conv1d.weight"], st.ple_conv, step.slot_idx, step.fresh,
                                    params.ngram_size)

    def _gdn(self, i: int, x: torch.Tensor, step: "_Step") -> torch.Tensor:
        """All sequences of the step in one packed call; each continues from its state slot."""
        c, st = self.cfg, self.state[i]
        w = self.layer_parts[i]["linear_attn"]
        Hk, Hv, Dk, Dv = self.gdn_key_heads, self.gdn_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        t = x.shape[0]
        slot_idx = step.slot_idx
        fused, rows = self.fused_inputs[i]  # in_proj_qkv | z | b | a: one GEMM
        mixed, z, b, a = torch.split(F.linear(x, fused), rows, dim=-1)
        z = z.reshape(t, Hv, Dv)
        # beta = sigmoid(b); decay g in fp32 (exp(A_log) may overflow half precision).
        beta, g = gdn_gates(b, a, w["A_log"], w["dt_bias"])
        if step.decode:
            # One token per sequence from its conv and delta-rule state slots (both advanced in place;
            # zeros when fresh).
            conv = conv1d_decode_(mixed, w["conv1d.weight"], st.conv, slot_idx, step.fresh, c.hidden_act)
            q, k, v = torch.split(conv, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
            o = delta_rule_decode_(q.view(t, Hk, Dk), k.view(t, Hk, Dk), v.view(t, Hv, Dv), g, beta, st.recurrent,
                                   slot_idx, step.fresh)
        else:
            conv, new_conv = causal_conv1d_reference(mixed.t()[None], w["conv1d.weight"], None, st.conv[slot_idx],
                                                     activation=c.hidden_act, cu_seqlens=step.cu_seqlens)
            st.conv[slot_idx] = new_conv
            q, k, v = torch.split(conv[0].t(), [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
            o, final = gated_delta_rule(
                q.reshape(1, t, Hk, Dk), k.reshape(1, t, Hk, Dk), v.reshape(1, t, Hv, Dv), g[None], beta[None],
                st.recurrent[slot_idx], step.cu_seqlens, single_token=t == len(step.spans),
            )
            o = o[0]
            st.recurrent[slot_idx] = final.float()
        o = gated_norm(o, z, w["norm.weight"], c.rms_norm_eps, c.output_gate_type or c.hidden_act)
        return self.ctx.all_reduce(F.linear(o.reshape(t, Hv * Dv), w["out_proj.weight"]))

    def _qsa_inputs(self, i: int, x: torch.Tensor, positions: torch.Tensor, step: "_Step"):
        c = self.cfg
        w = self.layer_parts[i]["self_attn"]
        if step.rope is None:  # the same tables for every QSA layer of the step
            step.rope = rope_cos_sin(positions, self.inv_freq, x.dtype)
        cos, sin = step.rope
        if not use_triton(x):  # qsa_attention_qkv, with this rank's q_proj layout (_query_gate_rows)
            t, d = x.shape[0], c.head_dim
            q, gate = self._split_query_gate(F.linear(x, w["q_proj.weight"]))
            k = F.linear(x, w["k_proj.weight"]).view(t, -1, d)
            v = F.linear(x, w["v_proj.weight"]).view(t, -1, d)
            q, k = qsa_norm_rope_qk(q, k, w["q_norm.weight"], w["k_norm.weight"], cos, sin, c.rms_norm_eps)
            iq, raw = indexer_project(x, w["indexer.index_qk_proj.weight"], w["indexer.q_layernorm.weight"],
                                      c.indexer_n_heads, c.indexer_head_dim, cos, sin, c.rms_norm_eps)
            return w, q, gate, k, v, iq, raw
        # CUDA: the same projections, each head's 1-centred RMSNorm + partial RoPE in one kernel
        # (ops.fused.norm_rope_heads; qsa_attention_qkv and indexer_project are its reference).
        t, d, hi, di = x.shape[0], c.head_dim, c.indexer_n_heads, c.indexer_head_dim
        fused, rows = self.fused_inputs[i]  # q_proj | k_proj | v_proj | index_qk_proj: one GEMM
        qg, k, v, qk = torch.split(F.linear(x, fused), rows, dim=-1)
        q, gate = self._split_query_gate(qg)
        q = norm_rope_heads(q, w["q_norm.weight"], cos, sin, c.rms_norm_eps)
        k = norm_rope_heads(k.view(t, -1, d), w["k_norm.weight"], cos, sin, c.rms_norm_eps)
        v = v.view(t, -1, d)
        iq = norm_rope_heads(qk[:, :hi * di].view(t, hi, di), w["indexer.q_layernorm.weight"], cos, sin,
                             c.rms_norm_eps)
        return w, q, gate, k, v, iq, qk[:, hi * di:]

    def _qsa(self, i: int, x: torch.Tensor, positions: torch.Tensor, step: "_Step",
             meta: AttentionMetadata) -> torch.Tensor:
        """Prefill and mixed steps. Per sequence: pool the groups its chunk completes (from the
        open-group raw keys in its state slot plus the chunk's), then select its queries' tokens
        in row blocks that bound the temporaries. On CUDA: Triton scoring, batched top-k on device
        ("lowest_index" ties, as decode) and one Triton sparse-attention call for every row of the
        step, reading the selected positions through the block tables. On CPU: transformers' tie
        order ("torch") and the paged torch reference (ops.qsa_indexer / ops.qsa_attention choose).

        Under DCP the indexer state and the top-k are replicated (identical on every rank); the
        selection is then localized to this rank's K/V shard, the DCP group's query heads attend
        over it, partials are merged, and the output gate is applied after the merge."""
        c, ctx = self.cfg, self.ctx
        dcp = ctx.dcp
        cache, tails = self.qsa_layers[i].cache, self.state[i].index_tail
        w, q, gate, k, v, iq, raw = self._qsa_inputs(i, x, positions, step)
        if cache.observer is not None:
            cache.observer(k, v, q)
        if dcp.enabled:
            plan = meta.dcp
            _write_kv(cache, k[plan.write_rows], v[plan.write_rows], plan.write_slots)
        else:
            _write_kv(cache, k, v, meta.slot_mapping)
        r, budget = c.indexer_compress_ratio, c.indexer_budget
        iq = iq.to(cache.block_keys.dtype)
        selected = torch.empty((q.shape[0], budget + r - 1), dtype=torch.long, device=q.device)
        for s, (a, b) in enumerate(step.spans):
            length, table = meta.seq_lens_list[s], meta.block_tables[s]
            pool_chunk_groups(tails[step.slots[s]], raw[a:b], length - (b - a), cache.block_keys, table,
                              w["indexer.k_layernorm.weight"], self.inv_freq, r, c.rms_norm_eps)
            selected[a:b] = select_prefill(iq[a:b], cache.block_keys, table, positions[a:b], r, budget, length // r)
        if dcp.enabled:
            selected = dcp.localize(selected)
        rows = torch.arange(q.shape[0], dtype=meta.cu_query_lens.dtype, device=q.device)
        seq_ids = torch.searchsorted(meta.cu_query_lens[1:].contiguous(), rows, right=True)
        attn, lse = sparse_attention_paged(q, cache.kv, meta.block_tables, selected, c.head_dim**-0.5, seq_ids,
                                           cache.k_scale, cache.v_scale, run=self._run(cache), pack=ctx.dcp_pack_size)
        attn = ctx.dcp_merge(attn, lse)
        return ctx.all_reduce(qsa_attention_output(attn, gate, w["o_proj.weight"]))

    def _qsa_decode(self, i: int, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    step: "_Step") -> torch.Tensor:
        """One token per sequence, all sequences at once: pool the block a token completes, score
        every visible block through the block tables, top-k on device, and attend over only the
        selected tokens (Triton on CUDA, the paged torch reference elsewhere). Cost follows the
        budget, not the context. Under DCP the selection is localized as in `_qsa`."""
        c, ctx = self.cfg, self.ctx
        cache = self.qsa_layers[i].cache
        w, q, gate, k, v, iq, raw = self._qsa_inputs(i, x, positions, step)
        if cache.observer is not None:
            cache.observer(k, v, q)
        _write_kv(cache, k, v, step.kv_slots)
        # The raw key joins its sequence's open group in the state slot (padding rows: the scratch slot).
        r, tables, pos = c.indexer_compress_ratio, meta.block_tables, step.query_pos
        pool_completed_groups(self.state[i].index_tail, step.slot_idx, raw, cache.block_keys, tables, pos, step.valid,
                              w["indexer.k_layernorm.weight"], self.inv_freq, r, c.rms_norm_eps)
        iq = iq.to(cache.block_keys.dtype)
        selected = select_decode(iq, cache.block_keys, tables, pos, r, c.indexer_budget, dcp=ctx.dcp)
        attn, lse = sparse_attention_paged(q, cache.kv, tables, selected, c.head_dim**-0.5, None, cache.k_scale,
                                           cache.v_scale, run=self._run(cache), pack=ctx.dcp_pack_size)
        attn = ctx.dcp_merge(attn, lse)
        return ctx.all_reduce(qsa_attention_output(attn, gate, w["o_proj.weight"]))

    def _run(self, cache: LayerCache) -> int:
        """Run length the sparse kernel may assume: the selection lists whole groups of r
        positions (and the tail's prefix of one) at aligned columns, so r, unless DCP's
        localization splits groups across ranks (interleave not a multiple of r) or pages do."""
        r, dcp = self.cfg.indexer_compress_ratio, self.ctx.dcp
        if r & (r - 1) or cache.kv.shape[2] % r or (dcp.enabled and dcp.interleave % r):
            return 1
        return r

    def _tp_shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor (our name, e.g. layers.3.self_attn.q_proj.weight).
        Attention / GDN / expert and shared-expert intermediate dims are split; the indexer,
        hyper-connection mixers, norms, router and PLE are replicated."""
        ctx, c = self.ctx, self.cfg
        if ctx.tp_size == 1:
            return t
        n, r = ctx.tp_size, ctx.tp_rank
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return shard_vocab(t, c.vocab_size, n, r)
        sub = name.split(".", 2)[2] if name.startswith("layers.") else ""
        d = c.head_dim
        qa, qb = even_range(c.num_attention_heads, n, r)
        if sub in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            return take(t, 0, self._query_gate_rows())
        if sub.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            ka, kb = kv_head_range(c.num_key_value_heads, n, r)
            return take(t, 0, [(ka * d, kb * d)])
        if sub == "self_attn.o_proj.weight":
            return take(t, 1, [(qa * d, qb * d)])
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        ka, kb = kv_head_range(c.linear_num_key_heads, n, r)
        va, vb = even_range(c.linear_num_value_heads, n, r)
        if sub in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
            key = c.linear_num_key_heads * dk  # channels: q | k | v
            return take(t, 0, [(ka * dk, kb * dk), (key + ka * dk, key + kb * dk), (2 * key + va * dv, 2 * key + vb * dv)])
        if sub == "linear_attn.in_proj_z.weight":
            return take(t, 0, [(va * dv, vb * dv)])
        if sub in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias", "linear_attn.A_log"):
            return take(t, 0, [(va, vb)])
        if sub == "linear_attn.out_proj.weight":
            return take(t, 1, [(va * dv, vb * dv)])
        inter = c.moe_intermediate_size
        ia, ib = even_range(inter, n, r)
        if sub == "mlp.experts.gate_up_proj":
            return take(t, 1, [(ia, ib), (inter + ia, inter + ib)])
        if sub == "mlp.experts.down_proj":
            return take(t, 2, [(ia, ib)])
        sa, sb = even_range(c.shared_expert_intermediate_size, n, r)
        if sub in ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"):
            return take(t, 0, [(sa, sb)])
        if sub == "mlp.shared_expert.down_proj.weight":
            return take(t, 1, [(sa, sb)])
        return t

    def _query_head_range(self) -> tuple[int, int]:
        """Query heads this rank projects. Under DCP every rank of a DCP group attends with all of
        the group's query heads over its own token shard of their KV head, so each rank computes
        the whole group's queries itself (the group's query rows of q_proj, _query_gate_rows: a
        wider GEMM) instead of all-gathering them every layer and step; the group is D consecutive
        TP ranks. Outside DCP: this rank's heads."""
        ctx, h = self.ctx, self.cfg.num_attention_heads
        first = ctx.tp_rank - ctx.dcp.rank
        return even_range(h, ctx.tp_size, first)[0], even_range(h, ctx.tp_size, first + ctx.dcp.size - 1)[1]

    def _query_gate_rows(self) -> list[tuple[int, int]]:
        """The rows of q_proj this rank holds. The checkpoint interleaves, per head, D query rows and
        D gate rows. Outside DCP: this rank's heads, interleaved as they are. Under DCP: the query
        rows of every head of the DCP group (each rank attends with all of them, _query_head_range),
        then the gate rows of this rank's own heads only: the gate is applied after the merge, to
        the heads the merge returns, so the group's other gates would be projected for nothing."""
        d, ctx = self.cfg.head_dim, self.ctx
        ga, gb = self._query_head_range()
        if not ctx.dcp.enabled:
            return [(ga * 2 * d, gb * 2 * d)]
        oa, ob = even_range(self.cfg.num_attention_heads, ctx.tp_size, ctx.tp_rank)
        return [(h * 2 * d, h * 2 * d + d) for h in range(ga, gb)] + [(h * 2 * d + d, (h + 1) * 2 * d) for h in range(oa, ob)]

    def _split_query_gate(self, qg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's q_proj output [T, rows] (_query_gate_rows) -> q [T, heads, D] (views) and the
        output gate [T, own heads * D]."""
        t, d = qg.shape[0], self.cfg.head_dim
        if not self.ctx.dcp.enabled:
            qg = qg.view(t, -1, 2 * d)
            return qg[..., :d], qg[..., d:].reshape(t, -1)
        ga, gb = self._query_head_range()
        return qg[:, :(gb - ga) * d].view(t, gb - ga, d), qg[:, (gb - ga) * d:]

    def _tp_shard_expert(self, proj: str, t: torch.Tensor) -> torch.Tensor:
        """One expert's gate_proj / up_proj [I, H] or down_proj [H, I] -> this rank's I slice."""
        if self.ctx.tp_size == 1:
            return t
        rows = even_range(self.cfg.moe_intermediate_size, self.ctx.tp_size, self.ctx.tp_rank)
        return take(t, 1 if proj == "down_proj" else 0, [rows])

    # ---- weights ----
    def init_dummy_weights(self, seed: int) -> None:
        """Random weights for load_format="dummy" (speed/memory runs; outputs mean nothing).
        Each tensor is drawn whole from a generator seeded by (seed, name), then cut to this rank's
        shard as a checkpoint would be: the logical model is the same at every TP / DCP layout, so
        runs at different layouts can be compared token for token."""
        device = self.weights["embed_tokens.weight"].device
        gen = torch.Generator(device=device)
        tied = self.weights["lm_head.weight"] is self.weights["embed_tokens.weight"]
        for name, shape in weight_shapes(self.cfg).items():
            if name == "lm_head.weight" and tied:
                continue
            w = self.weights[name]
            if name.endswith("linear_attn.norm.weight"):
                w.fill_(1.0)
                continue
            if "norm" in name or name.endswith("dt_bias"):
                w.zero_()  # 1-centred norms: zero is the identity scale
                continue
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                # [E, ...]: one expert at a time, so the peak is one expert's full tensor, not the layer's.
                for e in range(shape[0]):
                    gen.manual_seed(zlib.crc32(f"{seed}:{name}:{e}".encode()))
                    full = torch.empty((1, *shape[1:]), dtype=w.dtype, device=device).normal_(0.0, 0.02, generator=gen)
                    w[e].copy_(self._tp_shard(name, full)[0])
                continue
            gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            full = torch.empty(shape, dtype=w.dtype, device=device)
            if name.endswith("A_log"):
                full.uniform_(0.0, 1.0, generator=gen)
            else:
                full.normal_(0.0, 0.02, generator=gen)
            w.copy_(self._tp_shard(name, full))
            del full

    def load_weights(self, weights) -> None:
        """Accepts HF names with `model.`, `model.language_model.` or no prefix. Per-expert
        tensors are fused; PLE table shards and mtp.* are left to their own loaders."""
        loaded: set[str] = set()
        num_experts = self.cfg.num_experts
        inter = self.cfg.moe_intermediate_size // self.ctx.tp_size
        skipped_vision = 0
        self.mtp_weights: dict[str, torch.Tensor] = {}  # the MTP draft head, for speculative decoding
        device = self.weights["embed_tokens.weight"].device
        for name, tensor in weights:
            if name.startswith(("mtp.", "model.mtp.")):
                self.mtp_weights[name.split("mtp.", 1)[1]] = tensor.to(device)
                continue
            name = _strip_prefix(name)
            if name is None:
                skipped_vision += 1
                continue
            if ".ple_embedding." in name:
                continue
            if ".mlp.experts." in name and name.split(".mlp.experts.")[1].split(".")[0].isdigit():
                layer_prefix, rest = name.split(".mlp.experts.")
                e, proj = int(rest.split(".")[0]), rest.split(".")[1]
                tensor = self._tp_shard_expert(proj, tensor)
                if proj == "down_proj":
                    self.weights[f"{layer_prefix}.mlp.experts.down_proj"][e].copy_(tensor)
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    self.weights[f"{layer_prefix}.mlp.experts.gate_up_proj"][e, rows].copy_(tensor)
                loaded.add(f"{layer_prefix}.mlp.experts.{e}.{proj}")
                continue
            if name not in self.weights:
                raise ValueError(f"model: checkpoint tensor {name!r} has no place in Qwen4Exp")
            target = self.weights[name]
            tensor = self._tp_shard(name, tensor)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"model: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
        missing = []
        for name in self.weights:
            if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
                prefix = name.rsplit(".mlp.experts.", 1)[0]
                fused = name in loaded
                per_expert = all(f"{prefix}.mlp.experts.{e}.{p}" in loaded for e in range(num_experts)
                                 for p in (("gate_proj", "up_proj") if "gate_up" in name else ("down_proj",)))
                if not (fused or per_expert):
                    missing.append(name)
            elif name not in loaded and not (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                missing.append(name)
        if missing:
            raise ValueError(f"model: checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        if skipped_vision:
            logger.info("Qwen4Exp: skipped %d vision-tower tensors (text model only)", skipped_vision)
        if self.mtp_weights:
            logger.info("Qwen4Exp: kept %d MTP draft-head tensors", len(self.mtp_weights))


def _strip_prefix(name: str) -> str | None:
    """HF checkpoint name -> our name; None for tensors the text model does not use (vision)."""
    if name.startswith(("model.visual.", "visual.")):
        return None
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _strip(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix`, keyed by the rest of their name."""
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def _spans(query_lens: list[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for n in query_lens:
        spans.append((start, start + n))
        start += n
    return spans


@dataclass
class _Step:
    """What every layer of one forward needs about the step's sequences (built once per step)."""

    decode: bool
    slot_idx: torch.Tensor  # [B] state slot of each sequence
    spans: list[tuple[int, int]] | None = None  # prefill: each sequence's rows
    slots: list[int] | None = None  # prefill: host copy of slot_idx
    cu_seqlens: torch.Tensor | None = None  # prefill: packed sequence boundaries
    valid: torch.Tensor | None = None  # decode: real rows (CUDA-graph padding rows are False)
    fresh: torch.Tensor | None = None  # decode: rows whose state starts at this token
    query_pos: torch.Tensor | None = None  # decode: each row's position, -1 for padding
    kv_slots: torch.Tensor | None = None  # decode: this rank's K/V slot of each new token, -1 = none
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE cos/sin at the step's positions (QSA layers)


# Per-layer projections of the same input, fused into one weight tensor (see _share_rows).
_GDN_INPUTS = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
               "linear_attn.in_proj_a.weight")
_MLP_INPUTS = ("mlp.gate.weight", "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
               "mlp.shared_expert_gate.weight")
_QSA_INPUTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.indexer.index_qk_proj.weight")


def _is_decode(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Every sequence of the step brings one token (host lists only; CUDA-graph padding rows
    count as one-token sequences)."""
    return input_ids.shape[0] == meta.num_seqs and all(n == 1 for n in meta.query_lens)


def _write_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store K/V rows at `slots` (-1: not stored here), quantizing for FP8 pages and subtracting a
    K offset when the layer has one."""
    write_kv(k, v, cache.kv, slots, cache.k_scale, cache.v_scale, k_offset=getattr(cache, "k_offset", None))
