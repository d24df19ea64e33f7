"""KV capacity per dtype under one budget: FP8 E4M3 pages hold twice the bf16 tokens (four times
float32), minus the null block; QSA index pages stay in the model dtype."""
import pytest
import torch

from qsaserve.cache.kv_cache import KVCacheSpec
from qsaserve.quant.capacity import kv_capacity_report
from qsaserve.ops.fp8 import FP8_E4M3


def test_capacity_for_the_model_dtype_and_fp8():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, block_size=16, kv_dtype=FP8_E4M3)
    budget = 64 << 20
    r = kv_capacity_report(spec, budget)
    bf16, fp8 = r["dtypes"]["bfloat16"], r["dtypes"]["fp8_e4m3"]
    assert bf16["bytes_per_token"] == 30 * 2 * 3 * 64 * 2 and fp8["bytes_per_token"] == 30 * 2 * 3 * 64
    assert bf16["tokens"] == (budget // (bf16["bytes_per_token"] * 16) - 1) * 16
    assert fp8["tokens"] == (budget // (fp8["bytes_per_token"] * 16) - 1) * 16
    assert r["fp8_capacity_ratio"] == pytest.approx(fp8["tokens"] / bf16["tokens"]) and r["fp8_capacity_ratio"] > 1.99
    assert r["model_dtype"] == "bfloat16" and r["budget_bytes"] == budget


def test_index_pages_stay_in_the_model_dtype():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, block_size=8, index_head_dim=4,
                       index_ratio=4)
    r = kv_capacity_report(spec, 1 << 20)
    f32, fp8 = r["dtypes"]["float32"]["bytes_per_token"], r["dtypes"]["fp8_e4m3"]["bytes_per_token"]
    assert f32 == spec.bytes_per_token
    assert f32 - fp8 == 2 * 2 * 8 * (4 - 1)  # only K/V pages shrink: layers x K,V x heads*head_dim x bytes saved
    assert fp8 > 2 * 2 * 8  # the index pages are still there, in float32


def test_budget_must_be_non_negative():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, block_size=8)
    assert kv_capacity_report(spec, 0)["dtypes"]["float32"]["tokens"] == 0
    with pytest.raises(ValueError, match="^budget_bytes: "):
        kv_capacity_report(spec, -1)
