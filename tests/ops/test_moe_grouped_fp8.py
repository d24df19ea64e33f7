"""Block-FP8 routed experts: the references (ops/moe/block_fp8.py) against plain dequantize-then-
matmul arithmetic, and the grouped GEMMs' FP8 form (triton_grouped.py) against them, through the
dispatch's w13_scale / w2_scale keywords: every tile tier, zero-token experts, sizes that are not
multiples of the 128 blocks, bf16 and float32 activations. Under the Triton interpreter on CPU (each
launch also compiled for sm_90) and on a CUDA GPU (with the released checkpoint's 512 x top-10)."""
import pytest
import torch
from triton_interpreter import interpreter_bf16_dot_shim, interpreter_fp8_cast_shim, triton_check_tests

from qsaserve.ops.moe.block_fp8 import (dequantize_blocks, fake_quantize_groups, moe_experts_block_fp8,
                                        quantize_blocks, quantize_groups)
from qsaserve.ops.moe.grouped_config import configs_for, step_configs


def _case(n, k, e, h, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.softmax(torch.randn(n, k, generator=g), -1).to(dtype)
    gu, s13 = quantize_blocks(torch.randn(e, 2 * inter, h, generator=g) * 0.1)
    down, s2 = quantize_blocks(torch.randn(e, h, inter, generator=g) * 0.1)
    return x, idx, w, gu, down, s13, s2


def test_quantize_groups_round_trip():
    """Per token and group of 128 (the last shorter): E4M3 values within 448, the largest at 448,
    dequantized within E4M3's relative step of the input (half its subnormal step near 0); zero
    rows stay zero."""
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [1e-3], [0.0]])
    q, scale = quantize_groups(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 3)
    assert q.float().abs().max() <= 448 and (q.float()[:2, :128].abs().amax(-1) == 448).all()
    back = fake_quantize_groups(x)
    near_zero = scale.repeat_interleave(128, -1)[:, :300] * 2.0 ** -10  # half E4M3's subnormal step
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + near_zero).all() and (back[2] == 0).all()


def test_quantize_blocks_round_trip():
    """Weights [E, N, K] (N, K not multiples of 128): one scale per 128 x 128 block, each block's
    largest magnitude at 448, dequantized within E4M3's relative step (half its subnormal step
    near 0)."""
    w = torch.randn(2, 300, 130, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, 2)
    assert q.float()[0, :128, :128].abs().max() == 448 and q.float()[1, 256:, 128:].abs().max() == 448
    near_zero = scale.max() * 2.0 ** -10  # half E4M3's subnormal step
    assert ((dequantize_blocks(q, scale) - w).abs() <= w.abs() * 2.0 ** -4 + near_zero).all()


def test_reference_is_dequantize_then_matmul():
    """moe_experts_block_fp8 (loop and sync-free forms) = the routed experts written out in float32
    on dequantized weights and fake-quantized activations."""
    x, idx, w, gu, down, s13, s2 = _case(7, 2, 5, 200, 136, torch.float32)
    wgu, wd = dequantize_blocks(gu, s13), dequantize_blocks(down, s2)
    want = torch.zeros(7, 200)
    for t in range(7):
        for j in range(2):
            e = int(idx[t, j])
            g, u = (fake_quantize_groups(x[t]) @ wgu[e].T).chunk(2)
            want[t] += w[t, j] * (fake_quantize_groups(torch.nn.functional.silu(g) * u) @ wd[e].T)
    for sync_free in (False, True):
        got = moe_experts_block_fp8(x, idx, w, gu, down, s13, s2, sync_free=sync_free)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def check_fp8(device, dtype, n=13, k=3, e=6, h=200, inter=136, configs=None, seed=0):
    """The FP8 grouped GEMMs (directly and through both dispatched entry points) against the
    reference. Quantizing an activation amplifies any earlier rounding difference to a whole E4M3
    step (2^-4 relative) now and then, so the kernels are held to the reference's own distance
    from the unquantized result (dequantized weights, float32 activations): float32 within 2^-10
    of the reference on average; bf16 (which the interpreter rounds toward zero, flipping more
    quantized activations than a GPU) no further from the unquantized result than the reference,
    with a quarter of slack on average (the largest error, of one element, gets more there)."""
    import qsaserve.ops.moe as moe_ops
    from qsaserve.ops.moe.reference import moe_experts_sync_free
    from qsaserve.ops.moe.triton_grouped import moe_experts_grouped_triton

    x, idx, w, gu, down, s13, s2 = _case(n, k, e, h, inter, dtype, seed)
    want = moe_experts_block_fp8(x, idx, w, gu, down, s13, s2).float()
    exact = moe_experts_sync_free(x.float(), idx, w.float(), dequantize_blocks(gu, s13), dequantize_blocks(down, s2))
    ref_err = (want - exact).abs()
    dev = [t.to(device) for t in (x, idx, w, gu, down)]
    scales = dict(w13_scale=s13.to(device), w2_scale=s2.to(device))
    got = [moe_experts_grouped_triton(*dev, configs=configs, **scales)]
    if configs is None:
        use_triton, moe_ops.use_triton = moe_ops.use_triton, lambda t: True
        try:
            got += [moe_ops.moe_experts(*dev, **scales), moe_ops.moe_experts_sync_free(*dev, **scales)]
        finally:
            moe_ops.use_triton = use_triton
    for out in got:
        assert out.dtype == dtype and out.shape == want.shape
        out = out.cpu().float()
        if dtype == torch.float32:
            assert (out - want).abs().mean() <= want.abs().mean() * 2.0 ** -10
        err = (out - exact).abs()
        max_slack = 2.0 if device == "cpu" and dtype == torch.bfloat16 else 1.25  # one element: noisier
        assert err.mean() <= 1.25 * ref_err.mean() and err.max() <= max_slack * ref_err.max(), \
            (dtype, float(err.mean()), float(ref_err.mean()), float(err.max()), float(ref_err.max()))


def _triton_checks(device):
    if device == "cpu":
        interpreter_bf16_dot_shim()
        interpreter_fp8_cast_shim()
    for dtype in (torch.float32, torch.bfloat16):
        check_fp8(device, dtype)
        check_fp8(device, dtype, n=1, k=2, e=16, h=128, inter=64)  # 14 experts without tokens
        for choices in (1, 40, 100, 1000):  # every token-block size
            check_fp8(device, dtype, n=9, k=2, e=4, configs=step_configs(choices, 1, 200, 136, 2, fp8=True))
    # the released checkpoint's bf16 tiles up to 8,192 tokens (compiled for sm_90 after the interpreter run)
    for configs in configs_for(range(1, 8193), 10, 512, 2048, 512, 2, fp8=True):
        check_fp8(device, torch.bfloat16, n=5, k=2, e=4, h=150, inter=130, configs=configs)
    if device != "cpu":
        check_fp8(device, torch.bfloat16, n=300, k=10, e=512, h=2048, inter=512)
        check_fp8(device, torch.bfloat16, n=3, k=10, e=512, h=2048, inter=512)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_scale_checks():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.moe.triton_grouped import moe_experts_grouped_triton

    x, idx, w, gu, down, s13, s2 = _case(2, 2, 4, 200, 136, torch.float32)
    with pytest.raises(ValueError, match="w13_scale, w2_scale"):
        moe_experts_grouped_triton(x, idx, w, gu, down, w13_scale=s13)
    with pytest.raises(ValueError, match="w2_scale: expected"):
        moe_experts_grouped_triton(x, idx, w, gu, down, w13_scale=s13, w2_scale=s2[:, :1])
