"""Merging decode-context-parallel partial attentions, in plain torch (the reference, and the CPU path).

Each rank of a DCP group attends the group's D * Hl query heads over its own token shard and holds
an fp32 partial `out [T, D*Hl, Dh]` with its base-2 `lse [T, D*Hl]` (-inf where it held no attended
token). Rank j must end with the exact attention of heads j*Hl .. (j+1)*Hl - 1 over all tokens.

  a2a:   pack_partials -> one all-to-all -> merge_packed
  ag_rs: all-gather the lses -> scale_partials -> one reduce-scatter (a sum)

Empty partials get weight 0 and their rows are zeroed before any product (0 * NaN would survive).
"""
from __future__ import annotations

import torch

from qsaserve.ops.qsa_attention.reference import merge_attention_partials


def pack_partials(out: torch.Tensor, lse: torch.Tensor, d: int) -> torch.Tensor:
    """out [T, D*Hl, Dh], lse [T, D*Hl] -> [D, T, Hl, Dh + 1]: row j is what rank j receives
    (the partials of its heads), the lse in the last column."""
    t, hg, dh = out.shape
    return torch.cat([out, lse[..., None]], dim=-1).view(t, d, hg // d, dh + 1).transpose(0, 1).contiguous()


def merge_packed(recv: torch.Tensor) -> torch.Tensor:
    """[D, T, Hl, Dh + 1] (every rank's partial of this rank's heads) -> out [T, Hl, Dh] fp32."""
    dh = recv.shape[-1] - 1
    return merge_attention_partials(recv[..., :dh], recv[..., dh])[0]


def scale_partials(out: torch.Tensor, lse: torch.Tensor, lses: torch.Tensor, d: int) -> torch.Tensor:
    """This rank's partial rescaled to its final weight, in reduce-scatter order: out [T, D*Hl, Dh],
    lse [T, D*Hl], every rank's lses [D, T, D*Hl] -> [D, T, Hl, Dh] (row j goes to rank j)."""
    t, hg, dh = out.shape
    m = lses.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.exp2(lses - m).sum(dim=0)
    w = torch.exp2(lse - m) / total.clamp_min(torch.finfo(torch.float32).tiny)
    scaled = torch.where((w > 0)[..., None], out, torch.zeros_like(out)) * w[..., None]
    return scaled.view(t, d, hg // d, dh).transpose(0, 1).contiguous()
