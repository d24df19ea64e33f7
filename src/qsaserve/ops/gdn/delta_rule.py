"""The gated delta rule: fla-core's Triton kernels where `ops.dispatch.use_triton` says so and
fla-core is installed, the plain-torch reference otherwise. Same arguments either way (fla-core's
conventions)."""
from __future__ import annotations

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.gdn.reference import gdn_chunk_reference, gdn_recurrent_reference

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
except ImportError:  # CPU installs: fla-core is an optional GPU dependency
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None

FLA_AVAILABLE = chunk_gated_delta_rule is not None


def uses_fla(q: torch.Tensor) -> bool:
    """gated_delta_rule runs fla-core's kernels for q."""
    return FLA_AVAILABLE and use_triton(q)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    single_token: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences (q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], g, beta [1, T, Hv]; boundaries in
    cu_seqlens [N + 1]), each continuing from its initial_state [N, Hv, Dk, Dv] fp32 -> (o [1, T,
    Hv, Dv], final states [N, Hv, Dk, Dv] fp32). q/k are L2-normalized inside. single_token: every
    sequence has one token (decode), where the recurrent form is cheapest."""
    # Keywords, not positions: fla's fused_recurrent takes (q, k, v, g, gk, gv, beta, ...), so a
    # positional beta would land in gk (per-key decay) and silently give wrong outputs.
    kwargs = dict(g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=cu_seqlens)
    if uses_fla(q):
        kernel = fused_recurrent_gated_delta_rule if single_token else chunk_gated_delta_rule
        return kernel(q, k, v, **kwargs)
    kernel = gdn_recurrent_reference if single_token else gdn_chunk_reference
    return kernel(q, k, v, **kwargs)
