"""FP8 E4M3 KV in the reference kernels: quantize on write (clamped), dequantize on read, and
the null block, free pages and rows past a sequence's length never reach P@V, even when their
bytes are E4M3 NaN (0x7F / 0xFF): outputs are finite and bit-identical to a zero-filled cache."""
import random

import pytest
import torch

from qsaserve.ops.attention.reference import gather_context, paged_attention_reference, write_kv_reference
from qsaserve.ops.qsa_attention.reference import sparse_attention_reference
from qsaserve.ops.fp8 import FP8_E4M3, FP8_E4M3_MAX, dequantize_fp8, quantize_fp8

NAN_BYTES = (0x7F, 0xFF)


def test_quantize_clamps_and_roundtrips():
    scale = torch.tensor(0.05)
    x = torch.tensor([0.0, 1.0, -3.3, 22.4, 30.0, -1e6, 1e6])  # 22.4 = 448 * 0.05; beyond it saturates
    q = quantize_fp8(x, scale)
    assert q.dtype == FP8_E4M3 and not torch.isnan(q.float()).any()
    back = dequantize_fp8(q, scale)
    assert back[-2].item() == pytest.approx(-FP8_E4M3_MAX * 0.05) and back[-1].item() == pytest.approx(FP8_E4M3_MAX * 0.05)
    assert back[4].item() == pytest.approx(22.4)
    # In the normal range E4M3 keeps 3 mantissa bits: relative rounding error <= 2^-4.
    y = torch.randn(10000) * 5
    rel = ((dequantize_fp8(quantize_fp8(y, scale), scale) - y).abs() / y.abs().clamp_min(2**-6 * 0.05 * 8))
    assert rel.max().item() <= 2**-4 + 1e-6


def _paged_case(specs, hq, hkv, d, page, seed=0, extra_blocks=3):
    """specs: [(query_len, seq_len)]. Random block assignment, tables padded with the null block."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    nblk = [-(-s // page) for _, s in specs]
    num_blocks = 1 + sum(nblk) + extra_blocks
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(len(specs), max(nblk) + 2, dtype=torch.int32)
    slots = []
    for i, (_, sl) in enumerate(specs):
        blocks = [ids.pop() for _ in range(nblk[i])]
        tables[i, : nblk[i]] = torch.tensor(blocks, dtype=torch.int32)
        slots.append([blocks[p // page] * page + p % page for p in range(sl)])
    total = sum(sl for _, sl in specs)
    k = torch.randn(total, hkv, d, generator=gen) * 4
    v = torch.randn(total, hkv, d, generator=gen)
    q = torch.randn(sum(ql for ql, _ in specs), hq, d, generator=gen)
    all_slots = torch.tensor([s for per in slots for s in per], dtype=torch.int64)
    return num_blocks, tables, all_slots, k, v, q


def _fp8_cache(num_blocks, page, hkv, d, fill_byte):
    return torch.full((2, num_blocks, page, hkv, d), fill_byte, dtype=torch.uint8).view(FP8_E4M3)


@pytest.mark.parametrize("poison", NAN_BYTES)
def test_paged_attention_ignores_nan_bytes_outside_the_context(poison):
    # Decode, chunked prefill over a prefix, and a fresh prefill; lengths end mid-page.
    specs, hq, hkv, d, page = [(1, 37), (5, 21), (9, 9)], 4, 2, 16, 8
    num_blocks, tables, slots, k, v, q = _paged_case(specs, hq, hkv, d, page)
    k_scale, v_scale = torch.tensor(4 * 4.5 / 448), torch.tensor(4.5 / 448)
    outs = []
    for fill in (0x00, poison):
        cache = _fp8_cache(num_blocks, page, hkv, d, fill)
        write_kv_reference(k, v, cache, slots, k_scale, v_scale)
        outs.append(paged_attention_reference(q, cache, tables, [ql for ql, _ in specs], [sl for _, sl in specs],
                                              d**-0.5, k_scale=k_scale, v_scale=v_scale))
    clean, poisoned = outs
    assert torch.isfinite(poisoned).all()
    assert torch.equal(clean, poisoned)
    # And it is attention over the dequantized K/V: compare with a float32 cache holding them.
    ref_cache = torch.zeros(2, num_blocks, page, hkv, d)
    write_kv_reference(dequantize_fp8(quantize_fp8(k, k_scale), k_scale),
                       dequantize_fp8(quantize_fp8(v, v_scale), v_scale), ref_cache, slots)
    ref = paged_attention_reference(q, ref_cache, tables, [ql for ql, _ in specs], [sl for _, sl in specs], d**-0.5)
    torch.testing.assert_close(clean, ref, atol=1e-5, rtol=1e-5)


def test_fp8_cache_without_scales_is_refused():
    cache = _fp8_cache(2, 4, 1, 8, 0)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_reference(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, torch.tensor([5]))


@pytest.mark.parametrize("poison", NAN_BYTES)
def test_sparse_qsa_path_ignores_nan_bytes(poison):
    """Qwen4Exp's QSA path: gather_context over the block table, then attention over selected
    rows (-1 = unused slot, which must not read anything either)."""
    hq, hkv, d, page, length = 4, 2, 16, 8, 29
    num_blocks, tables, slots, k, v, q = _paged_case([(3, length)], hq, hkv, d, page)
    k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.01)
    selected = torch.tensor([[0, 3, 7, 8, -1, -1], [1, 2, 9, 27, 28, -1], [-1, -1, -1, -1, -1, -1]])
    outs = []
    for fill in (0x00, poison):
        cache = _fp8_cache(num_blocks, page, hkv, d, fill)
        write_kv_reference(k, v, cache, slots, k_scale, v_scale)
        k_ctx, v_ctx = gather_context(cache, tables[0], length, k_scale, v_scale)
        assert k_ctx.dtype == torch.float32
        outs.append(sparse_attention_reference(q, k_ctx, v_ctx, selected, scale=d**-0.5))
    (clean, lse_clean), (poisoned, lse_poisoned) = outs
    assert torch.isfinite(poisoned).all()
    assert torch.equal(clean, poisoned) and torch.equal(lse_clean, lse_poisoned)
    assert (poisoned[2] == 0).all()  # nothing selected: out = 0, never NaN
