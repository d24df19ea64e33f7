"""KV capacity per K/V dtype under one memory budget: what FP8 buys, in tokens.

The same KVCacheSpec geometry is sized twice, with K/V pages in the model dtype and in FP8 E4M3
(QSA index pages, if any, stay in the model dtype in both). Tokens count usable pages only:
block 0 is the null block.
"""
from __future__ import annotations

import dataclasses

from qsaserve.quant.fp8 import FP8_E4M3


def kv_capacity_report(spec, budget_bytes: int) -> dict:
    """spec: a KVCacheSpec (its `dtype` is the model dtype; its kv_dtype is ignored).
    Returns {"budget_bytes", "block_size", "model_dtype", "dtypes": {name: {"bytes_per_token",
    "tokens"}}, "fp8_capacity_ratio"} for the model dtype and fp8_e4m3."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes: must be >= 0, got {budget_bytes}")
    model_name = str(spec.dtype).removeprefix("torch.")
    rows = {}
    for name, kv_dtype in ((model_name, None), ("fp8_e4m3", FP8_E4M3)):
        s = dataclasses.replace(spec, kv_dtype=kv_dtype)
        rows[name] = {"bytes_per_token": s.bytes_per_token, "tokens": s.usable_tokens(budget_bytes)}
    base = rows[model_name]["tokens"]
    return {"budget_bytes": int(budget_bytes), "block_size": spec.block_size, "model_dtype": model_name, "dtypes": rows,
            "fp8_capacity_ratio": rows["fp8_e4m3"]["tokens"] / base if base else None}
