"""The 1-4 row GEMV kernel against its reference: 1 to 4 rows, N and K not multiples of the
blocks, several output blocks, split K (the partials summed by the second launch), float32
tightly and bf16 within bf16 rounding (the kernel sums in fp32 and rounds once, as the reference
does); under the Triton interpreter and on a GPU. The default tile rule and the dispatch."""
import pytest
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.gemv.reference import gemv_reference


def _check(device, dtype, m, n, k, **tile):
    from qsaserve.ops.gemv.triton_gemv import gemv

    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    got = gemv(x.to(device), w.to(device), **tile).cpu()
    want = gemv_reference(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def _triton_checks(device):
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 2, 3, 4):
            _check(device, dtype, m, 37, 300, block_n=8)  # a ragged last block of N and of K
        _check(device, dtype, 1, 200, 64)  # K shorter than a K block; the default tile
        _check(device, dtype, 3, 5, 1000, split_k=4, block_k=128)  # split K, a ragged last range
        _check(device, dtype, 2, 4, 640, split_k=8)  # more splits than whole 128-column groups
    _check_gated(device)
    _check_unsummed_partials(device)
    if device == "cuda":  # qwen4exp-small's hyper-connection down / inject / up and GDN in_proj, llama-8b's o
        for m in (1, 2, 4):
            _check(device, torch.bfloat16, m, 320, 8192)
            _check(device, torch.bfloat16, m, 4, 8192)
            _check(device, torch.bfloat16, m, 8192, 320)
        _check(device, torch.bfloat16, 1, 12352, 2048)
        _check(device, torch.bfloat16, 2, 4096, 4096)


def _check_gated(device):
    """gated=True on gate | up equals ops.fused's SiLU * up kernel then the GEMV, bit for bit (the
    same input values, the same sums), also for gate | up as columns of a wider packed output and
    with split K."""
    from qsaserve.ops.fused import triton_fused
    from qsaserve.ops.gemv.triton_gemv import gemv

    g = torch.Generator().manual_seed(11)
    for dtype, m, n, k, split in ((torch.float32, 1, 24, 200, 1), (torch.bfloat16, 2, 37, 384, 2)):
        packed = torch.randn(m, 3 + 2 * k + 1, generator=g).to(dtype).to(device)  # router | gate | up | gate scalar
        gate_up = packed[:, 3: 3 + 2 * k]
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(device)
        got = gemv(gate_up, w, gated=True, split_k=split)
        want = gemv(triton_fused.silu_mul(gate_up.contiguous()), w, split_k=split)
        assert torch.equal(got, want), (dtype, (got.float() - want.float()).abs().max())


def _check_unsummed_partials(device):
    """sum_split=False returns the float32 split-K planes whose sum in plane order is the summed
    GEMV's output (float32 here: the interpreter truncates float32 -> bf16 casts, which torch's
    rounding would not match); without a split, the output itself."""
    from qsaserve.ops.gemv.triton_gemv import gemv

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 1000, generator=g).to(device)
    w = (torch.randn(9, 1000, generator=g) * 0.03).to(device)
    planes = gemv(x, w, split_k=4, block_k=128, sum_split=False)
    assert planes.shape == (4, 2, 9) and planes.dtype == torch.float32
    total = planes[0]
    for p in planes[1:]:
        total = total + p
    assert torch.equal(total, gemv(x, w, split_k=4, block_k=128))
    assert torch.equal(gemv(x, w, split_k=1, sum_split=False), gemv(x, w, split_k=1))


def test_rejects_too_many_rows_strided_weights_and_bad_tiles():
    from qsaserve.ops.gemv.triton_gemv import gemv

    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.zeros(5, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.zeros(1, 8), torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="block_k"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 8), block_k=96)
    with pytest.raises(ValueError, match="2K"):  # gated takes gate | up
        gemv(torch.zeros(1, 8), torch.zeros(4, 8), gated=True)


def test_default_tile_follows_the_sweep_and_splits_narrow_outputs():
    """The H200 sweep's tiles by shape (pick_gemv_tile's docstring), block_k keeping its bytes for
    float32 weights, K split in powers of two (ranges of at least MIN_SPLIT_COLS) below one
    program a SM."""
    import triton

    from qsaserve.ops.gemv.triton_gemv import MIN_SPLIT_COLS, pick_gemv_tile

    assert pick_gemv_tile(12352, 2048, 132) == (8, 256, 1, 2)  # wide over a short K
    assert pick_gemv_tile(12352, 2048, 132, elem_bytes=4) == (8, 128, 1, 2)  # float32 weights
    assert pick_gemv_tile(2048, 4096, 132) == (4, 1024, 1, 2)  # narrow over a long K
    assert pick_gemv_tile(4096, 4096, 132) == (4, 512, 1, 1)  # llama-8b's o
    assert pick_gemv_tile(8192, 320, 132) == (4, 512, 1, 1)  # K shorter than the wide rule's
    assert pick_gemv_tile(320, 8192, 132) == (4, 1024, 2, 2)  # 80 programs: split in 2
    assert pick_gemv_tile(4, 8192, 132) == (4, 1024, 8, 2)  # one program: split to 1,024 columns
    for n, k in ((320, 8192), (4, 8192), (1089, 2048), (2048, 512), (8192, 320), (7, 1000)):
        bn, bk, split, _ = pick_gemv_tile(n, k, 132)
        assert split & (split - 1) == 0 and (split == 1 or k // split >= MIN_SPLIT_COLS)
        assert triton.cdiv(n, bn) * split >= 132 or k // (2 * split) < MIN_SPLIT_COLS  # stopped for a reason


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_dispatch_takes_the_gemv_only_for_decode_rows_on_cuda(monkeypatch):
    """ops.gemv.linear: CPU tensors take F.linear even when the GEMV is on; on CUDA 1-2 rows of the
    weight's dtype without a bias take it (3-4 rows for narrow weights), other shapes cuBLAS (the wiring in the models runs on
    a GPU: tests/models/test_llama_fused.py)."""
    from qsaserve.ops import gemv as gemv_mod

    monkeypatch.setattr(gemv_mod, "ENABLED", True)
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert not gemv_mod.takes_gemv(x, w)  # CPU tensors
    torch.testing.assert_close(gemv_mod.linear(x, w, torch.ones(4)), torch.nn.functional.linear(x, w, torch.ones(4)))
    monkeypatch.setattr(gemv_mod, "use_triton", lambda t: True)  # as on CUDA
    assert gemv_mod.takes_gemv(x, w) and gemv_mod.takes_gemv(x[:1], w)
    # 3-4 rows: narrow weights only (cuBLAS reads wide ones faster); more rows never
    assert gemv_mod.takes_gemv(torch.randn(gemv_mod.NARROW_ROWS, 8), w)
    assert not gemv_mod.takes_gemv(torch.randn(gemv_mod.GEMV_ROWS + 1, 8), torch.randn(gemv_mod.NARROW_N + 1, 8))
    assert not gemv_mod.takes_gemv(torch.randn(gemv_mod.GEMV_ROWS + 1, gemv_mod.NARROW_K + 8),
                                   torch.randn(4, gemv_mod.NARROW_K + 8))
    assert gemv_mod.takes_gemv(torch.randn(gemv_mod.GEMV_ROWS, 8), torch.randn(gemv_mod.NARROW_N + 1, 8))
    assert not gemv_mod.takes_gemv(torch.randn(gemv_mod.NARROW_ROWS + 1, 8), w)  # prefill rows
    assert not gemv_mod.takes_gemv(x.double(), w)  # dtypes differ
    assert not gemv_mod.takes_gemv(x, torch.randn(8, 4).t())  # a strided weight
    assert not gemv_mod.takes_gemv(x[None], w)  # not 2-D
    calls = []
    monkeypatch.setattr(gemv_mod, "gemv", lambda a, b, **kw: calls.append((a.shape, kw)) or torch.zeros(a.shape[0], 4))
    gemv_mod.silu_mul_linear(torch.randn(2, 16), w)  # one launch: the GEMV computes SiLU * up itself
    assert calls == [((2, 16), {"gated": True})]
    monkeypatch.setattr(gemv_mod, "ENABLED", False)
    assert not gemv_mod.takes_gemv(x, w)
    gate_up = torch.randn(2, 16)  # off (and on CPU): ops.fused.silu_mul, then F.linear
    torch.testing.assert_close(gemv_mod.silu_mul_linear(gate_up, w),
                               torch.nn.functional.linear(torch.nn.functional.silu(gate_up[:, :8]) * gate_up[:, 8:], w))
