"""Plain-PyTorch references of Qwen4Exp's blocks, composed from the ops' references: the CPU
path's block math, what the tests compare against transformers, and (reference_model tests) the
recipe of a chunked, stateful forward.

Pure functions over explicit weights and state. The ``*_forward`` / ``*_block`` functions take a
mapping keyed by the HF names relative to the sub-module (e.g. ``{"q_proj.weight": ...,
"q_norm.weight": ...}`` for ``self_attn``).

Norm conventions (see docs/qwen4exp.md):
* ``Qwen4ExpTextRMSNorm`` weights are 1-centred: ``y = norm(x) * (1 + w)`` (hc_norm, PLE norms,
  q_norm/k_norm, indexer q_layernorm/k_layernorm; ``ops.fused.one_centred_rms_norm``). Grouped
  variants normalise each ``hidden_size`` slice of the ``hc_count * hidden_size`` streams.
* ``linear_attn.norm`` (gated RMSNorm of the GDN output) is *not* 1-centred: ``y = w * norm(x) * act(z)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from qsaserve.ops.fused import one_centred_rms_norm
from qsaserve.ops.gdn import causal_conv1d_reference, gated_rms_norm, gdn_chunk_reference, gdn_recurrent_reference
from qsaserve.ops.moe import moe_experts, moe_experts_sync_free, moe_router
from qsaserve.ops.moe.reference import activation_fn
from qsaserve.ops.qsa_attention.reference import sparse_attention_reference
from qsaserve.ops.qsa_indexer.reference import apply_partial_rope, indexer_project, qsa_select_reference, rope_cos_sin

__all__ = [
    "dense_mlp",
    "sparse_moe_block",
    "qsa_attention_qkv",
    "qsa_norm_rope_qk",
    "qsa_attention_output",
    "qsa_attention_forward",
    "gdn_layer_forward",
]


# --------------------------------------------------------------------------- MoE


def dense_mlp(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
              activation: str = "silu") -> torch.Tensor:
    """SwiGLU MLP (the shared expert): ``down(act(gate x) * up x)``."""
    return F.linear(activation_fn(activation)(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj)


def sparse_moe_block(
    x: torch.Tensor, p: Mapping[str, torch.Tensor], top_k: int, norm_topk_prob: bool, activation: str = "silu",
    sync_free: bool = False,
) -> torch.Tensor:
    """``Qwen4ExpTextSparseMoeBlock``; ``p`` keys relative to ``layers.{i}.mlp.``.

    routed experts + ``sigmoid(shared_expert_gate x) * shared_expert(x)``; ``x`` ``[..., H]``.
    ``sync_free`` routes with :func:`moe_experts_sync_free` (same math, no host reads).
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    _, w, idx = moe_router(flat, p["gate.weight"], top_k, norm_topk_prob)
    experts = moe_experts_sync_free if sync_free else moe_experts
    routed = experts(flat, idx, w, p["experts.gate_up_proj"], p["experts.down_proj"], activation)
    shared = dense_mlp(
        flat,
        p["shared_expert.gate_proj.weight"],
        p["shared_expert.up_proj.weight"],
        p["shared_expert.down_proj.weight"],
        activation,
    )
    shared = torch.sigmoid(F.linear(flat, p["shared_expert_gate.weight"])) * shared
    return (routed + shared).reshape(shape)


# --------------------------------------------------------------------------- QSA attention


def qsa_attention_qkv(
    hidden: torch.Tensor,
    q_proj_weight: torch.Tensor,
    k_proj_weight: torch.Tensor,
    v_proj_weight: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated-attention projections for ``hidden`` ``[T, H]`` at RoPE tables ``cos``/``sin`` ``[T, rot]``.

    ``q_proj`` emits, per query head, ``head_dim`` query features followed by ``head_dim`` gate
    features (interleaved per head, not two halves). q/k get a 1-centred per-head RMSNorm, then
    partial RoPE on their first ``rot`` dims. Returns ``q [T, Hq, D]``, ``gate [T, Hq*D]``,
    ``k [T, Hkv, D]``, ``v [T, Hkv, D]`` (k, v are what the KV cache stores).
    """
    T = hidden.shape[0]
    qg = F.linear(hidden, q_proj_weight).view(T, -1, 2 * head_dim)
    q, gate = qg[..., :head_dim], qg[..., head_dim:].reshape(T, -1)
    k = F.linear(hidden, k_proj_weight).view(T, -1, head_dim)
    v = F.linear(hidden, v_proj_weight).view(T, -1, head_dim)
    q, k = qsa_norm_rope_qk(q, k, q_norm_weight, k_norm_weight, cos, sin, eps)
    return q, gate, k, v


def qsa_norm_rope_qk(q: torch.Tensor, k: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head 1-centred RMSNorm and partial RoPE of qsa_attention_qkv, on q [T, Hq, D] and
    k [T, Hkv, D] already projected."""
    q = one_centred_rms_norm(q, q_norm_weight, eps)
    k = one_centred_rms_norm(k, k_norm_weight, eps)
    c, s = cos[:, None, :], sin[:, None, :]
    return apply_partial_rope(q, c, s), apply_partial_rope(k, c, s)


def qsa_attention_output(attn: torch.Tensor, gate: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """``o_proj(attn * sigmoid(gate))``; ``attn`` ``[T, Hq, D]``, ``gate`` ``[T, Hq*D]``."""
    return F.linear(attn.reshape(attn.shape[0], -1).to(gate.dtype) * torch.sigmoid(gate), o_proj_weight)


def qsa_attention_forward(
    hidden: torch.Tensor,
    p: Mapping[str, torch.Tensor],
    cfg,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    raw_key_cache: torch.Tensor,
    inv_freq: torch.Tensor,
    tie_break: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One QSA layer (``self_attn``) for a chunk of one request, continuing from its caches.

    ``hidden`` ``[T, H]`` (mixed hyper-connection input), ``positions`` ``[T]`` consecutive and
    equal to the number of cached tokens onwards; caches ``[N, Hkv, D]``, ``[N, Hkv, D]``,
    ``[N, indexer_head_dim]`` for positions ``0..N-1``. ``p`` keys relative to ``self_attn.``;
    ``cfg`` is a Qwen4Exp text config. Returns ``(out [T, H], k_cache, v_cache, raw_key_cache)``
    extended by this chunk.
    """
    eps = cfg.rms_norm_eps
    cos, sin = rope_cos_sin(positions, inv_freq, hidden.dtype)
    q, gate, k, v = qsa_attention_qkv(
        hidden, p["q_proj.weight"], p["k_proj.weight"], p["v_proj.weight"], p["q_norm.weight"],
        p["k_norm.weight"], cfg.head_dim, cos, sin, eps,
    )
    iq, raw = indexer_project(
        hidden, p["indexer.index_qk_proj.weight"], p["indexer.q_layernorm.weight"], cfg.indexer_n_heads,
        cfg.indexer_head_dim, cos, sin, eps,
    )
    k_cache = torch.cat([k_cache, k.to(k_cache.dtype)])
    v_cache = torch.cat([v_cache, v.to(v_cache.dtype)])
    raw_key_cache = torch.cat([raw_key_cache, raw.to(raw_key_cache.dtype)])
    idx, _ = qsa_select_reference(
        iq, raw_key_cache, positions, p["indexer.k_layernorm.weight"], inv_freq, cfg.indexer_compress_ratio,
        cfg.indexer_budget, eps, tie_break,
    )
    attn, _ = sparse_attention_reference(q, k_cache, v_cache, idx, scale=cfg.head_dim**-0.5)
    return qsa_attention_output(attn, gate, p["o_proj.weight"]), k_cache, v_cache, raw_key_cache


# --------------------------------------------------------------------------- Gated DeltaNet layer


def gdn_layer_forward(
    hidden: torch.Tensor,
    p: Mapping[str, torch.Tensor],
    cfg,
    conv_state: torch.Tensor | None = None,
    recurrent_state: torch.Tensor | None = None,
    mode: str = "chunk",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Qwen4ExpTextGatedDeltaNet`` for a chunk continuing from explicit state.

    ``hidden`` ``[B, T, H]``; ``p`` keys relative to ``linear_attn.``; ``conv_state``
    ``[B, conv_dim, K-1]`` with ``conv_dim = 2*Hk*Dk + Hv*Dv`` (channel order q | k | v, as
    ``in_proj_qkv``); ``recurrent_state`` ``[B, Hv, Dk, Dv]`` fp32. ``None`` = fresh request.
    ``mode`` picks the chunked or token-recurrent kernel (same math).
    Returns ``(out [B, T, H], new_conv_state, new_recurrent_state)``.
    """
    B, T, _ = hidden.shape
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mixed = F.linear(hidden, p["in_proj_qkv.weight"])  # [B, T, conv_dim]
    z = F.linear(hidden, p["in_proj_z.weight"]).view(B, T, Hv, Dv)
    b = F.linear(hidden, p["in_proj_b.weight"])
    a = F.linear(hidden, p["in_proj_a.weight"])
    conv_out, new_conv = causal_conv1d_reference(
        mixed.transpose(1, 2), p["conv1d.weight"], p.get("conv1d.bias"), conv_state, activation=cfg.hidden_act
    )
    conv_out = conv_out.transpose(1, 2)
    q, k, v = torch.split(conv_out, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), v.reshape(B, T, Hv, Dv)
    beta = torch.sigmoid(b)
    # Decay in fp32 (exp(A_log) may overflow half precision).
    g = -p["A_log"].float().exp() * F.softplus(a.float() + p["dt_bias"])
    kernel = gdn_chunk_reference if mode == "chunk" else gdn_recurrent_reference
    o, new_rec = kernel(
        q, k, v, g, beta, initial_state=recurrent_state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    act = cfg.output_gate_type or cfg.hidden_act
    o = gated_rms_norm(o, z, p["norm.weight"], cfg.rms_norm_eps, act).reshape(B, T, Hv * Dv)
    return F.linear(o, p["out_proj.weight"]), new_conv, new_rec
