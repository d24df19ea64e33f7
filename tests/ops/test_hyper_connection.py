"""The hyper-connection step's Triton kernels against the torch reference (ops.hyper_connection.reference
hc_inject + hc_gated_residual): float32 to 1e-5, bf16 within a few bf16 steps; first block (no
output to inject), inner blocks, and the final mixer (no injection weights); H not a power of two.
Under the Triton interpreter on CPU and on a CUDA GPU."""
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.hyper_connection.reference import hc_step_reference


def _case(t, hc, h, lr, dtype, gen):
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(dtype)  # noqa: E731
    return dict(hyper=r(t, hc * h), block_out=r(t, h), inject=(torch.rand(t, hc, generator=gen) * 2).to(dtype),
                norm_weight=r(hc * h, scale=0.3), down_weight=r(lr, hc * h, scale=0.05),
                up_weight=r(hc * h, lr, scale=0.2), inject_weight=r(hc, hc * h, scale=0.05))


def check_hc_step(device, dtype, step_fn, t=3, hc=4, h=48, lr=20, packed=False):
    """packed: down and inject are the row ranges of one tensor, as a mixer's packed parameter."""
    gen = torch.Generator().manual_seed(hc * h + lr)
    case = _case(t, hc, h, lr, dtype, gen)
    if packed:
        both = torch.cat([case["down_weight"], case["inject_weight"]])
        case["down_weight"], case["inject_weight"] = both[:lr], both[lr:]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for first, final in ((False, False), (True, False), (False, True)):
        kw = dict(case)
        if first:
            kw["block_out"] = kw["inject"] = None
        if final:
            kw["inject_weight"] = None
        want = hc_step_reference(**kw, hc_count=hc, eps=1e-6)
        on = {k: (v.to(device) if v is not None else None) for k, v in kw.items()}
        if packed and not final:  # moved as one tensor, so the parts stay neighbours
            both = torch.cat([kw["down_weight"], kw["inject_weight"]]).to(device)
            on["down_weight"], on["inject_weight"] = both[:lr], both[lr:]
        got = step_fn(**on, hc_count=hc, eps=1e-6)
        for name, w, g in zip(("hyper", "mixed", "inject"), want, got):
            if w is None:
                assert g is None, name
                continue
            torch.testing.assert_close(g.cpu().float(), w.float(), **tol, msg=lambda m: f"{name} {first=} {final=}: {m}")


def test_reference_is_the_model_composition():
    from qsaserve.ops.hyper_connection.reference import hc_gated_residual, hc_inject

    gen = torch.Generator().manual_seed(0)
    c = _case(2, 2, 16, 8, torch.float32, gen)
    hyper, mixed, inj = hc_step_reference(**c, hc_count=2, eps=1e-6)
    assert torch.equal(hyper, hc_inject(c["hyper"], c["block_out"], c["inject"]))
    m2, i2 = hc_gated_residual(hyper, c["norm_weight"], c["down_weight"], c["up_weight"], c["inject_weight"], 2, 1e-6)
    assert torch.equal(mixed, m2) and torch.equal(inj, i2)


def _triton_checks(device):
    from qsaserve.ops.hyper_connection.triton_hc import hc_step_triton

    for dtype in (torch.float32, torch.bfloat16):
        check_hc_step(device, dtype, hc_step_triton)
        check_hc_step(device, dtype, hc_step_triton, t=1, hc=2, h=64, lr=16)
        check_hc_step(device, dtype, hc_step_triton, t=2, hc=2, h=64, lr=16, packed=True)  # one GEMM
    _check_one_gemm_for_packed(device)
    if device != "cpu":  # qwen4exp-small's mixers at batch 1 (the GEMV), 2 and 16 (cuBLAS), packed as the model's
        for t in (1, 2, 16):
            check_hc_step(device, torch.bfloat16, hc_step_triton, t=t, hc=4, h=2048, lr=320, packed=True)


def test_stacked_takes_only_parts_of_one_storage():
    """_stacked joins down and inject where inject's rows follow down's in one storage (the
    model's packed parameter); separate tensors stay apart, also when they happen to lie side by
    side in memory."""
    from qsaserve.ops.hyper_connection import triton_hc

    both = torch.randn(7, 8)
    assert triton_hc._stacked(both[:5], both[5:]).data_ptr() == both.data_ptr()
    assert torch.equal(triton_hc._stacked(both[:5], both[5:]), both)
    assert triton_hc._stacked(torch.randn(5, 8), torch.randn(2, 8)) is None
    assert triton_hc._stacked(both[:5], None) is None
    assert triton_hc._stacked(both[:4], both[5:]) is None  # a gap between the parts
    buf = torch.randn(7 * 8).numpy()  # two tensors over neighbouring memory, two storages
    a, b = torch.from_numpy(buf[:40]).view(5, 8), torch.from_numpy(buf[40:]).view(2, 8)
    assert b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() and triton_hc._stacked(a, b) is None


def test_model_mixers_hold_down_and_inject_as_one_gemm():
    from qwen4exp_testing import make_config

    from qsaserve.models.qwen4exp.hyper_connection import HyperConnection
    from qsaserve.ops.hyper_connection import triton_hc

    cfg = make_config()
    hc = HyperConnection(cfg)
    down, inject = hc.mix_down_inject.part("down"), hc.mix_down_inject.part("inject")
    assert triton_hc._stacked(down, inject) is not None
    assert down.shape == (cfg.hc_lowrank, cfg.hc_count * cfg.hidden_size) and inject.shape[0] == cfg.hc_count
    assert HyperConnection(cfg, inject=False).input_mix_weight_down.weight.shape == down.shape


def _check_one_gemm_for_packed(device):
    """A packed down | inject runs as one GEMM, then the up projection and the stream mix, with
    the reference's results: at 3 rows through F.linear / cuBLAS and the mix kernel (as at prefill
    rows); at 1 to 4 rows through the GEMV (forced here, so the interpreter runs it too), whose
    split-K partials (K = 2,048: split in 2) the joined up + mix kernel adds and activates as it
    loads them (also for 3 streams, a count that is not a power of two, for 1 stream, K = 1,024
    unsplit, and for the final mixer, whose down projection has no inject rows beside it)."""
    from qsaserve.ops import gemv
    from qsaserve.ops.hyper_connection import triton_hc

    for t, force_gemv, hc, final in ((3, False, 2, False), (1, True, 2, False), (2, True, 2, False),
                                     (2, True, 3, False), (4, True, 2, False), (2, True, 1, False), (2, True, 2, True)):
        calls, linear, partials, kernel = [], gemv.linear, gemv.linear_partials, gemv.gemv
        takes, runs = gemv.takes_gemv, gemv.runs_gemv

        def counted_linear(x, w, bias=None):
            calls.append(("linear", w.shape[0]))
            return linear(x, w, bias)

        def counted_partials(x, w):
            calls.append(("partials", w.shape[0]))
            return partials(x, w)

        def counted_gemv(x, w, **kw):
            out = kernel(x, w, **kw)
            calls.append(("gemv", w.shape[0], out.dim()))
            return out

        h = 1024 if force_gemv else 16
        case = _case(t, hc, h, 8, torch.float32, torch.Generator().manual_seed(1))
        packed = torch.cat([case["down_weight"], case["inject_weight"]])
        want = hc_step_reference(**case, hc_count=hc, eps=1e-6)
        on = {k: v.to(device) for k, v in case.items()}
        both = packed.to(device)
        on["down_weight"], on["inject_weight"] = both[:8], both[8:]
        if final:
            case["inject_weight"] = on["inject_weight"] = None
            want = hc_step_reference(**case, hc_count=hc, eps=1e-6)
        gemv.linear, gemv.linear_partials, gemv.gemv = counted_linear, counted_partials, counted_gemv
        if force_gemv:
            gemv.takes_gemv = gemv.runs_gemv = lambda x, w: x.dim() == 2 and x.shape[0] <= gemv.MAX_ROWS
        try:
            got = triton_hc.hc_step_triton(**on, hc_count=hc, eps=1e-6)
        finally:
            gemv.linear, gemv.linear_partials, gemv.gemv = linear, partials, kernel
            gemv.takes_gemv, gemv.runs_gemv = takes, runs
        n = 8 if final else 8 + hc
        if force_gemv:  # down | inject's partials unsummed (3-D); up + mix joined: no up GEMM call
            assert calls == [("partials", n), ("gemv", n, 3 if h * hc >= 2048 else 2)], calls
        else:
            assert calls == [("partials", n), ("linear", hc * h)], calls
        for w, g in zip(want, got):
            if w is None:
                assert g is None
                continue
            torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-5)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)
