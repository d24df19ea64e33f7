"""One rank's view of the parallel layout, and the collectives the models call.

A ParallelContext is handed to the model at construction. With tensor_parallel_size 1 every
collective is the identity, so models have one code path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from qsaserve.ops import dcp_merge
from qsaserve.parallel.dcp import DcpGeometry


@dataclass
class ParallelContext:
    tp_size: int = 1
    tp_rank: int = 0
    dcp: DcpGeometry = field(default_factory=DcpGeometry)
    dcp_backend: str = "ag_rs"
    tp_group: object = None  # torch.distributed ProcessGroup (None: single rank)
    dcp_group: object = None

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    # ---- tensor parallel ----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the TP ranks (row-parallel outputs)."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., tp_size * n], rank order (column-parallel outputs)."""
        if self.tp_size == 1:
            return x
        out = _all_gather(x, self.tp_size, self.tp_group)
        return out.movedim(0, -2).flatten(-2)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """x as TP rank 0 holds it, on every rank, in place (async scheduling's input ids, which
        rank 0 takes from its own device-resident samples)."""
        if self.tp_size > 1:
            dist.broadcast(x, src=0, group=self.tp_group)
        return x

    # ---- decode context parallel ----
    def dcp_gather_heads(self, q: torch.Tensor) -> torch.Tensor:
        """[T, Hl, Dh] query heads of this rank -> [T, D*Hl, Dh]: the heads of the whole DCP group,
        which all read this rank's KV head (DCP ranks hold shards of the same head)."""
        d = self.dcp.size
        if d == 1:
            return q
        return _all_gather(q, d, self.dcp_group).transpose(0, 1).flatten(1, 2)

    @property
    def dcp_pack_size(self) -> int:
        """D when dcp_merge takes its partials already packed for the all-to-all (lse None, out
        [D, T, Hl, Dh + 1] as dcp_merge.pack_partials lays it out), else 0: an attention kernel
        that can write that layout saves the packing launch."""
        return self.dcp.size if self.dcp.enabled and self.dcp_backend == "a2a" else 0

    def dcp_merge(self, out: torch.Tensor, lse: torch.Tensor | None) -> torch.Tensor:
        """Partial attention of the group's heads over this rank's tokens (out [T, D*Hl, Dh] fp32,
        base-2 lse [T, D*Hl], -inf where the rank holds no attended token; or, with lse None, out
        already packed, see dcp_pack_size) -> the exact attention of this rank's own Hl heads over
        all tokens, [T, Hl, Dh] fp32."""
        d = self.dcp.size
        if d == 1:
            return out
        if lse is None:
            if self.dcp_backend != "a2a" or out.dim() != 4 or out.shape[0] != d:
                raise ValueError(f"out: packed partials [{d}, T, Hl, Dh + 1] go with the a2a merge only "
                                 f"(backend {self.dcp_backend!r}, got shape {tuple(out.shape)})")
        elif self.dcp_backend == "a2a":
            out = dcp_merge.pack_partials(out, lse, d)
        if self.dcp_backend == "a2a":
            # One all-to-all: rank i receives every rank's partial (out | lse) for its heads, merges locally.
            recv = torch.empty_like(out)
            dist.all_to_all_single(recv, out, group=self.dcp_group)
            return dcp_merge.merge_packed(recv)
        t, hg, dh = out.shape
        hl = hg // d
        # AG+RS: every rank learns all LSEs, rescales its own partial to its final weight, and a
        # reduce-scatter over heads sums the rescaled partials into each rank's heads.
        lses = _all_gather(lse, d, self.dcp_group)
        send = dcp_merge.scale_partials(out, lse, lses, d)
        recv = out.new_empty((t, hl, dh))
        _reduce_scatter(recv, send.flatten(0, 1), group=self.dcp_group)
        return recv


def _all_gather(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """[*s] on every rank -> [world, *s] in rank order."""
    out = x.new_empty((world * x.shape[0],) + x.shape[1:])
    _all_gather_single(out, x.contiguous(), group=group)
    return out.view((world,) + x.shape)


# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
