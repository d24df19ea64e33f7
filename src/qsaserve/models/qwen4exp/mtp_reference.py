"""The MTP draft head (mtp.py) in plain torch over one request's contiguous caches: the oracle
the paged head is tested against (no transformers model has the head).

``p`` maps the head's checkpoint names after ``mtp.`` (mtp.mtp_weight_shapes) to full tensors.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from qsaserve.models.qwen4exp.reference import qsa_attention_forward, sparse_moe_block
from qsaserve.ops.fused.reference import one_centred_rms_norm_reference
from qsaserve.ops.hyper_connection.reference import hc_gated_residual, hc_inject, hc_step_reference


def _sub(p: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {n[len(prefix):]: t for n, t in p.items() if n.startswith(prefix)}


def mtp_draft_reference(hyper: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                        p: Mapping[str, torch.Tensor], embed: torch.Tensor, lm_head: torch.Tensor, cfg,
                        inv_freq: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Draft rows of one request continuing from its head caches.

    ``hyper`` [T, hc * H] (the target's pre-final-mixer streams at ``positions``, or the head's own
    output of the previous draft step), ``next_ids`` [T] (the token after each row), ``positions``
    [T] consecutive from the number of cached positions; ``embed``, ``lm_head`` [V, H] the
    target's; ``caches`` (K [N, Hkv, D], V [N, Hkv, D], raw index keys [N, Di]) of the head's
    positions 0..N-1, None = empty. Returns (draft logits [T, V] fp32, head output [T, hc * H],
    caches extended by the rows).
    """
    H, hc, eps = cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps
    if caches is None:
        dt = hyper.dtype
        caches = (torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim, dtype=dt),
                  torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim, dtype=dt),
                  torch.zeros(0, cfg.indexer_head_dim, dtype=dt))
    e = one_centred_rms_norm_reference(F.embedding(next_ids, embed), p["pre_fc_norm_embedding.weight"], eps)
    h = one_centred_rms_norm_reference(hyper, p["pre_fc_norm_hidden.weight"], eps, H)
    x = (F.linear(h.view(-1, hc, H), p["fc_hidden.weight"]) + F.linear(e, p["fc_embedding.weight"])[:, None]).flatten(1)

    def mixer(name: str, streams: torch.Tensor, out=None, inject=None):
        m = _sub(p, f"layers.0.{name}.")
        return hc_step_reference(streams, out, inject, m["hc_norm.weight"], m["input_mix_weight_down.weight"],
                                 m["input_mix_weight_up.weight"], m["block_inject_weight.weight"], hc, eps)

    x, mixed, inject = mixer("attn_hyper_connection", x)
    attn, k, v, raw = qsa_attention_forward(mixed, _sub(p, "layers.0.self_attn."), cfg, positions, *caches, inv_freq)
    x, mixed, inject = mixer("mlp_hyper_connection", x, attn, inject)
    moe = sparse_moe_block(mixed, _sub(p, "layers.0.mlp."), cfg.num_experts_per_tok, cfg.norm_topk_prob)
    x = hc_inject(x, moe, inject)
    m = _sub(p, "hyper_connection_mixer.")
    final, _ = hc_gated_residual(x, m["hc_norm.weight"], m["input_mix_weight_down.weight"],
                                 m["input_mix_weight_up.weight"], None, hc, eps)
    return F.linear(final, lm_head).float(), x, (k, v, raw)
