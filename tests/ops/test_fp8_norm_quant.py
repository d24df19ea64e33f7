"""The RMSNorm whose kernel quantizes its output for the W8A8 GEMM
(ops/fp8_gemm/triton_quant.rms_norm_quant_triton) against ops.fused's Triton add_rms_norm /
rms_norm then per_token_group_quant_triton, bit for bit (E4M3 values, scales, the summed
residual), under the Triton interpreter (then compiled for sm_90) and on a GPU: with and without
a residual, padded rows and column-major scales (cuBLAS's layout), float32 and bf16; and the
dispatch (fp8_linear_rms_norm takes it at W8A8 rows, with cuBLAS's layout where cuBLAS runs)."""
import pytest
import torch
from triton_interpreter import triton_check_tests

EPS = 1e-5


def _check(device, m, k, dtype, residual=True, rows_multiple=1, scale_column_major=False):
    from qsaserve.ops.fp8_gemm.triton_quant import per_token_group_quant_triton, rms_norm_quant_triton
    from qsaserve.ops.fused import triton_fused

    gen = torch.Generator().manual_seed(m * 7 + k + residual)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype).to(device)
    res = torch.randn(m, k, generator=gen).to(dtype).to(device) if residual else None
    g = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(device)
    q, s, h = rms_norm_quant_triton(x, res, g, EPS, rows_multiple, scale_column_major)
    if residual:
        normed, want_h = triton_fused.add_rms_norm(x, res, g, EPS)
    else:
        normed, want_h = triton_fused.rms_norm(x, g, EPS), x
    want_q, want_s = per_token_group_quant_triton(normed, rows_multiple, scale_column_major)
    assert q.shape == want_q.shape and s.shape == want_s.shape and s.stride() == want_s.stride()
    assert torch.equal(q.view(torch.uint8).cpu(), want_q.view(torch.uint8).cpu())
    assert torch.equal(s.cpu(), want_s.cpu())
    assert torch.equal(h.cpu(), want_h.cpu()) and (residual or h is x)


def _triton_checks(device):
    for dtype in (torch.float32, torch.bfloat16):
        for residual in (True, False):
            _check(device, 3, 384, dtype, residual)
        _check(device, 5, 256, dtype, rows_multiple=4, scale_column_major=True)  # 3 padding rows
    _check(device, 2, 640, torch.bfloat16, rows_multiple=4)  # K not a power of two
    if device == "cuda":  # llama-8b's hidden size at decode, verify and prefill rows, both layouts
        for m in (3, 64, 133, 1024):
            _check(device, m, 4096, torch.bfloat16)
            _check(device, m, 4096, torch.bfloat16, rows_multiple=4, scale_column_major=True)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_rejects_bad_arguments():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.fp8_gemm.triton_quant import rms_norm_quant_triton

    with pytest.raises(ValueError, match="multiple of 128"):
        rms_norm_quant_triton(torch.zeros(2, 200), None, torch.ones(200), EPS)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quant_triton(torch.zeros(2, 256), None, torch.ones(128), EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quant_triton(torch.zeros(2, 256), torch.zeros(3, 256), torch.ones(256), EPS)


def test_dispatch_quantizes_in_the_norm_at_w8a8_rows(monkeypatch):
    """On CUDA (faked) fp8_linear_rms_norm at W8A8 rows runs the norm-and-quantize kernel, then the
    transposed GEMM (takes_swap) or cuBLAS's block-scaled GEMM with its layout (padded rows,
    column-major scales); at the GEMV's rows the norm-joined GEMV."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    import qsaserve.ops.fp8_gemm as fp8_gemm

    calls = []
    monkeypatch.setattr(fp8_gemm, "use_triton", lambda t: True)
    monkeypatch.setattr(fp8_gemm.scaled_mm, "takes", lambda *a: True)
    monkeypatch.setattr(fp8_gemm.triton_quant, "rms_norm_quant_triton",
                        lambda x, r, g, eps, rows_multiple, scale_column_major:
                        calls.append(("norm_quant", x.shape[0], rows_multiple, scale_column_major)) or (x, x, x))
    monkeypatch.setattr(fp8_gemm.scaled_mm, "fp8_w8a8_gemm_scaled_mm", lambda xq, *a: calls.append("cublas") or xq)
    monkeypatch.setattr(fp8_gemm, "fp8_w8a8_gemm", lambda xq, *a: calls.append("w8a8") or xq)
    monkeypatch.setattr(fp8_gemm.triton_gemv, "fp8_norm_gemv_triton", lambda x, *a: calls.append("gemv") or (x, x))
    g = torch.ones(256)
    for m, n in ((3, 4096), (130, 4096), (130, 6144), (1, 4096)):
        w = torch.zeros(n, 256, dtype=fp8_gemm.FP8)
        fp8_gemm.fp8_linear_rms_norm(torch.zeros(m, 256), torch.zeros(m, 256), g, EPS, w, torch.ones(n // 128, 2), 128)
    assert calls == [("norm_quant", 3, 1, False), "w8a8", ("norm_quant", 130, 4, True), "cublas",
                     ("norm_quant", 130, 4, True), "cublas", "gemv"]
