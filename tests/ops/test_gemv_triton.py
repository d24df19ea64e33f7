"""The batch-1..4 GEMV kernel against its reference: 1 to 4 rows, N and K not multiples of the
blocks, several output blocks, float32 tightly and bf16 within bf16 rounding (the kernel sums in
fp32 and rounds once, as the reference does); under the Triton interpreter and on a GPU."""
import pytest
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.gemv.reference import gemv_reference


def _check(device, dtype, m, n, k, block_n=None):
    from qsaserve.ops.gemv.triton_gemv import gemv

    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    got = gemv(x.to(device), w.to(device), block_n=block_n).cpu()
    want = gemv_reference(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def _triton_checks(device):
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 3, 4):
            _check(device, dtype, m, 37, 300, block_n=8)  # a ragged last block of N and of K
        _check(device, dtype, 1, 200, 64)  # K shorter than a K block; block_n from the SM count
    if device == "cuda":  # llama-1b's fused q/k/v and o_proj at batch 1
        _check(device, torch.bfloat16, 1, 3072, 2048)
        _check(device, torch.bfloat16, 2, 2048, 2048)


def test_rejects_too_many_rows_and_strided_weights():
    from qsaserve.ops.gemv.triton_gemv import gemv

    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.zeros(5, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.zeros(1, 8), torch.zeros(8, 4).t())


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_linear_takes_cublas_unless_opted_in_on_cuda(monkeypatch):
    """layers.linear: CPU tensors take F.linear even when opted in (the GEMV wiring runs on a GPU:
    tests/models/test_llama_fused.py)."""
    from qsaserve.layers import linear as linear_mod

    monkeypatch.setattr(linear_mod, "GEMV_ENABLED", True)
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert not linear_mod.use_gemv(x, w)  # CPU tensors
    torch.testing.assert_close(linear_mod.linear_weight(x, w, torch.ones(4)), torch.nn.functional.linear(x, w, torch.ones(4)))
