"""NVFP4 routed experts (W4A16): the reference (ops/moe/nvfp4.py) against plain dequantize-then-
matmul arithmetic, and the grouped GEMMs' NVFP4 form (triton_grouped.py) against it, directly and
through the dispatch's scale keywords: every tile tier, zero-token experts, gate and up with their
own global scales, bf16 and float32 activations, and the warm-up's variants. Under the Triton
interpreter on CPU (each launch also compiled for sm_90) and on a CUDA GPU."""
import pytest
import torch
from triton_interpreter import interpreter_bf16_dot_shim, triton_check_tests

from qsaserve.ops.moe.grouped_config import configs_for, step_configs
from qsaserve.ops.moe.nvfp4 import dequantize_experts, moe_experts_nvfp4, quantize_experts
from qsaserve.ops.moe.reference import moe_experts_sync_free


def _case(n, k, e, h, inter, dtype, seed=0):
    """Routing and NVFP4 experts; up is drawn 4x larger than gate, so their global scales differ."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]) if n else torch.zeros((0, k),
                                                                                                   dtype=torch.long)
    w = torch.softmax(torch.randn(n, k, generator=g), -1).to(dtype)
    gu = torch.randn(e, 2 * inter, h, generator=g) * 0.1
    gu[:, inter:] *= 4
    gu, s13, r13 = quantize_experts(gu, parts=2)
    down, s2, r2 = quantize_experts(torch.randn(e, h, inter, generator=g) * 0.1)
    return x, idx, w, gu, down, dict(w13_scale=s13, w2_scale=s2, w13_row_scale=r13, w2_row_scale=r2)


def test_quantize_experts_keeps_each_part_on_its_own_global_scale():
    x, idx, w, gu, down, s = _case(1, 1, 3, 32, 16, torch.float32)
    assert gu.shape == (3, 32, 16) and gu.dtype == torch.uint8 and s["w13_scale"].shape == (3, 32, 2)
    r = s["w13_row_scale"]
    assert r.shape == (3, 32) and (r[:, :16] == r[:, :1]).all() and (r[:, 16:] == r[:, 16:17]).all()
    assert (r[:, 16:] > 2 * r[:, :16]).all()  # up's global is its own
    back = dequantize_experts(gu, s["w13_scale"], r)
    assert back.shape == (3, 32, 32) and torch.equal(back[1], dequantize_experts(gu[1], s["w13_scale"][1], r[1]))


def test_reference_is_dequantize_then_the_reference_moe():
    """float32: moe_experts_nvfp4 (loop and sync-free forms) = reference.moe_experts_sync_free on
    the dequantized weights."""
    x, idx, w, gu, down, s = _case(7, 2, 5, 48, 32, torch.float32)
    want = moe_experts_sync_free(x, idx, w, dequantize_experts(gu, s["w13_scale"], s["w13_row_scale"]),
                                 dequantize_experts(down, s["w2_scale"], s["w2_row_scale"]))
    for sync_free in (False, True):
        got = moe_experts_nvfp4(x, idx, w, gu, down, **s, sync_free=sync_free)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def check_nvfp4(device, dtype, n=13, k=3, e=6, h=48, inter=32, configs=None, seed=0):
    """The NVFP4 grouped GEMMs (directly and through both dispatched entry points) against the
    reference: float32 within 1e-5; 16-bit no further from the float32 result than the reference
    is, plus a few bf16 steps of slack (the interpreter truncates float32 -> bf16 casts)."""
    import qsaserve.ops.moe as moe_ops
    from qsaserve.ops.moe.triton_grouped import moe_experts_grouped_triton

    x, idx, w, gu, down, s = _case(n, k, e, h, inter, dtype, seed)
    want = moe_experts_nvfp4(x, idx, w, gu, down, **s)
    dev = [t.to(device) for t in (x, idx, w, gu, down)]
    scales = {name: t.to(device) for name, t in s.items()}
    got = [moe_experts_grouped_triton(*dev, configs=configs, **scales)]
    if configs is None:
        use_triton, moe_ops.use_triton = moe_ops.use_triton, lambda t: True
        try:
            got += [moe_ops.moe_experts(*dev, **scales), moe_ops.moe_experts_sync_free(*dev, **scales)]
        finally:
            moe_ops.use_triton = use_triton
    exact = moe_experts_nvfp4(x.float(), idx, w.float(), gu, down, **s)
    for out in got:
        assert out.dtype == dtype and out.shape == want.shape
        out = out.cpu()
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            continue
        steps = 5 if device == "cpu" else 1
        step = exact.abs().max() * 2.0 ** -8
        assert (out.float() - exact).abs().max() <= (want.float() - exact).abs().max() + steps * step, \
            (dtype, float((out.float() - exact).abs().max()), float((want.float() - exact).abs().max()))


def check_warm_up(device):
    """With NVFP4 scales the warm-up launches only grouped GEMMs (no decode kernel, which reads
    model-dtype weights), and every variant later steps launch."""
    import qsaserve.ops.moe as moe_ops
    from triton.runtime.interpreter import InterpretedFunction

    launched = set()
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        options = tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor)))
        launched.add((self.fn.__name__, options))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    use_triton, moe_ops.use_triton = moe_ops.use_triton, lambda t: True
    try:
        _, _, _, gu, down, s = _case(1, 2, 8, 32, 16, torch.float32)
        assert moe_ops.warm_up(gu, down, 2, torch.float32, max_tokens=40, **s) >= 3
        warmed, launched = launched, set()
        for n in (1, 3, 40):
            x, idx, w, _, _, _ = _case(n, 2, 8, 32, 16, torch.float32, seed=n)
            torch.testing.assert_close(moe_ops.moe_experts_sync_free(x, idx, w, gu, down, **s),
                                       moe_experts_nvfp4(x, idx, w, gu, down, **s), atol=1e-5, rtol=1e-5)
        names = {name for name, _ in warmed | launched}
        assert "_gate_up_kernel" not in names and "_grouped_gate_up_kernel" in names
        assert launched <= warmed, launched - warmed
    finally:
        InterpretedFunction.run, moe_ops.use_triton = run, use_triton


def _triton_checks(device):
    if device == "cpu":
        interpreter_bf16_dot_shim()
    for dtype in (torch.float32, torch.bfloat16):
        check_nvfp4(device, dtype)
        check_nvfp4(device, dtype, n=1, k=2, e=16, h=32, inter=16)  # 14 experts without tokens; BLOCK_K 16
        for choices in (1, 40, 100, 1000):  # every token-block size, K tails (H 80, I 48)
            check_nvfp4(device, dtype, n=9, k=2, e=4, h=80, inter=48,
                        configs=step_configs(choices, 1, 80, 48, torch.empty((), dtype=dtype).element_size()))
    check_nvfp4(device, torch.float16)  # fp16 (5 exponent bits) decodes without the 2^63 factor
    # the released checkpoint's bf16 tiles up to 8,192 tokens (compiled for sm_90 after the interpreter run)
    for configs in configs_for(range(1, 8193), 10, 512, 2048, 512, 2):
        check_nvfp4(device, torch.bfloat16, n=5, k=2, e=4, h=48, inter=32, configs=configs)
    if device == "cpu":
        check_warm_up(device)
    else:
        check_nvfp4(device, torch.bfloat16, n=300, k=10, e=512, h=2048, inter=512)
        check_nvfp4(device, torch.bfloat16, n=3, k=10, e=512, h=2048, inter=512)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_scale_checks():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.moe.triton_grouped import moe_experts_grouped_triton

    x, idx, w, gu, down, s = _case(2, 2, 4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="w13_row_scale, w2_row_scale"):
        moe_experts_grouped_triton(x, idx, w, gu, down, **{**s, "w2_row_scale": None})
    with pytest.raises(ValueError, match="w2_scale: expected"):
        moe_experts_grouped_triton(x, idx, w, gu, down, **{**s, "w2_scale": s["w2_scale"][:, :1]})
    with pytest.raises(ValueError, match="uint8"):
        moe_experts_grouped_triton(x, idx, w, gu.float(), down, **s)
