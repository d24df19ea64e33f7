"""The routed-expert decode kernels' block-FP8 form (ops/moe/triton_moe.py, FP8) against the
block-FP8 reference (ops/moe/block_fp8.moe_experts_block_fp8, sync-free): float32 activations
tightly (the inputs rounded per token and 128-group exactly as the reference rounds them),
several 128-row and 128-column scale blocks, a K tail of masked groups, repeated and distinct
experts, the narrowest and widest row blocks; under the Triton interpreter on CPU and on a GPU
(bf16 there too, held as the grouped GEMMs' bf16: no further from the unquantized result than the
reference). The dispatch: steps of the decode kernels' sizes take them with FP8 experts
whose H and I are multiples of 128, the others the grouped GEMMs; NVFP4 experts never."""
import pytest
import torch
from triton_interpreter import interpreter_fp8_cast_shim, triton_check_tests

from qsaserve.ops.moe.block_fp8 import dequantize_blocks, moe_experts_block_fp8, quantize_blocks
from qsaserve.ops.moe.reference import moe_experts_sync_free


def _case(n, k, e, h, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.softmax(torch.randn(n, k, generator=g), -1).to(dtype)
    # uneven block magnitudes, so a wrong scale block shows
    gu = torch.randn(e, 2 * inter, h, generator=g) * torch.rand(e, 2 * inter, 1, generator=g)
    down = torch.randn(e, h, inter, generator=g) * torch.rand(e, h, 1, generator=g) * 0.1
    (gu_q, s13), (down_q, s2) = quantize_blocks(gu), quantize_blocks(down)
    return x, idx, w, gu_q, down_q, s13, s2


def check_fp8(device, dtype, n, k, e, h, inter, block_n=None, seed=0, block_k=None):
    from qsaserve.ops.moe.triton_moe import moe_experts_decode_triton

    x, idx, w, gu, down, s13, s2 = _case(n, k, e, h, inter, dtype, seed)
    want = moe_experts_block_fp8(x, idx, w, gu, down, s13, s2, sync_free=True)
    got = moe_experts_decode_triton(*(t.to(device) for t in (x, idx, w, gu, down)), block_n=block_n,
                                    w13_scale=s13.to(device), w2_scale=s2.to(device), block_k=block_k).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        return
    # bf16: a one-ulp difference in a GEMM output (summation order) now and then flips the E4M3
    # rounding of the down GEMM's input, or its group's scale, a 2^-4 step; so, as the grouped
    # GEMMs' test, the kernels may be no further from the unquantized result than the reference is
    exact = moe_experts_sync_free(x.float(), idx, w.float(), dequantize_blocks(gu, s13), dequantize_blocks(down, s2))
    err, ref_err = (got.float() - exact).abs(), (want.float() - exact).abs()
    assert err.mean() <= 1.25 * ref_err.mean() and err.max() <= 1.25 * ref_err.max(), \
        (float(err.mean()), float(ref_err.mean()), float(err.max()), float(ref_err.max()))


def _triton_checks(device):
    if device == "cpu":
        interpreter_fp8_cast_shim()  # E4M3 rounding as a GPU's cvt does
    check_fp8(device, torch.float32, n=2, k=2, e=5, h=640, inter=256, seed=1)  # BLOCK_K 512: a tail of 1 group
    for block_n in ((4, 32), (32, 4)):  # the narrowest and widest row blocks the heuristic may pick
        check_fp8(device, torch.float32, n=1, k=3, e=6, h=256, inter=128, block_n=block_n, seed=2)
    # three K tiles per choice in the down loop (its scale blocks per tile), and one choice a token
    check_fp8(device, torch.float32, n=2, k=2, e=4, h=256, inter=384, block_k=(128, 128), seed=4)
    check_fp8(device, torch.float32, n=2, k=1, e=4, h=256, inter=256, seed=5)
    if device != "cpu":  # the interpreter truncates bf16 casts; qwen4exp-flash's shapes at batch 1
        check_fp8(device, torch.bfloat16, n=1, k=10, e=64, h=2048, inter=512)
        check_fp8(device, torch.bfloat16, n=4, k=10, e=64, h=2048, inter=512, seed=3)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_dispatch_takes_the_decode_kernels_for_fp8_experts_of_whole_groups(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    import qsaserve.ops.moe as moe

    calls = []
    monkeypatch.setattr(moe, "use_triton", lambda x: True)
    monkeypatch.setattr(moe.triton_moe, "moe_experts_decode_triton",
                        lambda x, *a, **kw: calls.append(("decode", x.shape[0], kw["w13_scale"] is not None)))
    monkeypatch.setattr(moe.triton_grouped, "moe_experts_grouped_triton",
                        lambda x, *a, **kw: calls.append(("grouped", x.shape[0], "w13_scale" in kw)))
    for h, inter in ((256, 128), (256, 96)):
        x, idx, w, gu, down, s13, s2 = _case(5, 2, 16, h, inter, torch.float32)
        for n in (1, 4, 5):  # DECODE_KERNEL_MAX_TOKENS = 4
            moe.moe_experts_sync_free(x[:n], idx[:n], w[:n], gu, down, w13_scale=s13, w2_scale=s2)
    assert calls == [("decode", 1, True), ("decode", 4, True), ("grouped", 5, True),
                     ("grouped", 1, True), ("grouped", 4, True), ("grouped", 5, True)]  # I = 96: not whole groups
    calls.clear()
    packed = torch.zeros(16, 256, 128, dtype=torch.uint8)
    moe.moe_experts_sync_free(x[:1], idx[:1], w[:1], packed, packed, w13_scale=s13, w2_scale=s2,
                              w13_row_scale=torch.ones(1), w2_row_scale=torch.ones(1))
    assert calls == [("grouped", 1, True)]  # NVFP4


def test_warm_up_plan_builds_the_fp8_decode_variants():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.moe import _warm_up_plan

    blocks, grouped = _warm_up_plan(16, 10, 512, 2048, 512, 2, 132, "fp8")
    assert blocks  # the decode kernels' row blocks for 1-4 tokens
    assert all(n > 4 for configs, n in grouped) or not grouped
    _, grouped_nvfp4 = _warm_up_plan(16, 10, 512, 2048, 512, 2, 132, "nvfp4")
    assert {n for _, n in grouped_nvfp4} >= {1}
