"""Weight loaders shared by the quantized formats (FP8 in quantized.py, NVFP4 in quantized_nvfp4.py):
the module they load into does the format's work."""
from __future__ import annotations

import torch

from qsaserve.layers.quantization.shard import TensorShard


class PackedPartLoader:
    """weight_loader(param, loaded, shard_id) of one `kind` of tensor (weight, its scales) of a
    quantized packed projection: `module` has ids, rules, offsets and parts per packed part and
    load(kind, tensor, part, shard); a format says how a part's rows look in its tensor (view)
    and how many checkpoint rows / columns the loaded tensor spans (full_extent)."""

    def __init__(self, module, kind: str):
        self.module, self.kind = module, kind

    def shard(self, shard_id=None):
        return self.module.rules[self.module.ids.index(shard_id)]

    def full_extent(self, loaded: torch.Tensor, rule) -> int | None:
        """The sharded dimension's full checkpoint size (None: the tensor is not sharded)."""
        raise NotImplementedError

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        m = self.module
        rule = self.shard(shard_id)
        full = self.full_extent(loaded, rule) if rule.ranges is not None else None
        shard = TensorShard(rule.dim, tuple(rule.ranges), full) if full is not None else None
        m.load(self.kind, loaded, m.ids.index(shard_id), shard)


class QuantizedExpertLoader:
    """weight_loader of a quantized routed-experts parameter (quantized.Fp8RoutedExperts,
    quantized_nvfp4.Nvfp4RoutedExperts) of one `kind` (weight, its scale, ...), stored in the
    module's stacked parameter `fused`; shard_id as weights.ExpertLoader's: None, the fused
    checkpoint tensor [E, ...]; an int e, expert e as a [1, ...] slice of it; (e, proj), the
    checkpoint's per-expert gate_proj / up_proj / down_proj tensor of this kind. The module
    quantizes a float tensor where its format asks (module.load_stacked / module.load)."""

    def __init__(self, module, kind: str, fused: str, rule):
        self.module, self.kind, self.fused, self.rule = module, kind, fused, rule

    def shard(self, shard_id=None):
        return self.rule

    def view(self, param: torch.Tensor, shard_id=None) -> torch.Tensor:
        return param

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None or isinstance(shard_id, int):
            self.module.load_stacked(self.kind, loaded, self.fused, shard_id or 0)
        else:
            expert, proj = shard_id
            self.module.load(self.kind, loaded, expert, proj)
