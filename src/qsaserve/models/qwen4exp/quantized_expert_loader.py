"""The weight loader of quantized routed experts (FP8 in quantized.py, NVFP4 in quantized_nvfp4.py):
one class for both formats, since the module it loads into does the format's work."""
from __future__ import annotations

import torch


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
