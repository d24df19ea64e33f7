"""The NVFP4 decode GEMV (ops/nvfp4_gemm/triton_gemv.py) against the W4A16 reference, under the
Triton interpreter (then compiled for sm_90) and on a GPU: 1-4 rows, per-row row scales (a fused
projection's), N and K not multiples of the tile, split over K (ranges of unequal and zero
length), a packed weight that is a column slice of a wider one, float32 and bf16 x; the bit
decode of every E2M1 code; the default tile rule at llama-8b's shapes; and the dispatch."""
import pytest
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.nvfp4_gemm import reference as ref

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _weight(n, k, gen):
    packed, scale, glob = ref.quantize_nvfp4(torch.randn(n, k, generator=gen) * k**-0.5)
    return packed, scale, (glob * (1 + torch.rand(n, generator=gen))).contiguous()  # a row scale per row


def _check(device, m, n, k, dtype, weight=None, x_scale=1.0, **tiles):
    from qsaserve.ops.nvfp4_gemm.triton_gemv import nvfp4_gemv_triton

    gen = torch.Generator().manual_seed(m * 19 + n + k)
    packed, scale, rs = weight or _weight(n, k, gen)
    x = (torch.randn(m, k, generator=gen) * x_scale).to(dtype)
    got = nvfp4_gemv_triton(x.to(device), packed.to(device), scale.to(device), rs.to(device), **tiles).cpu()
    want = ref.nvfp4_w4a16_gemm_reference(x, packed, scale, rs)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got / x_scale, want / x_scale, **tol)  # tolerances relative to x's size


def _every_code_weight(n, k):
    """Rows cycling through all 256 bytes (every code in both nibbles), unit group scales."""
    packed = (torch.arange(n * k // 2) % 256).to(torch.uint8).view(n, k // 2)
    scale = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
    return packed, scale, torch.ones(n)


def _triton_checks(device):
    for m in (1, 2, 3, 4):
        # N = 200: a ragged last row block; K = 336: 21 groups, a ragged last tile
        _check(device, m, 200, 336, torch.float32, block_n_tile=16, block_k=128)
    _check(device, 3, 200, 336, torch.float32, block_n_tile=8, block_k=64, split_k=3)  # 7 groups each
    _check(device, 1, 40, 64, torch.float32, block_n_tile=4, block_k=64, split_k=8)  # 4 groups, 8 programs
    _check(device, 2, 24, 320, torch.float32, block_n_tile=8, block_k=128, split_k=2, num_stages=1)
    _check(device, 2, 32, 256, torch.float32, weight=_every_code_weight(32, 256), block_n_tile=16, block_k=128)
    # x far from 1 (the kernel scales x by 2^64 and the sums back): large and tiny activations
    _check(device, 1, 24, 128, torch.float32, x_scale=1e12)
    _check(device, 1, 24, 128, torch.float32, x_scale=1e-12)
    gen = torch.Generator().manual_seed(2)
    packed, scale, rs = _weight(24, 512, gen)
    # columns 128-383 of the wider weight: packed rows 256 bytes apart, a view that is not contiguous
    _check(device, 1, 24, 256, torch.float32, weight=(packed[:, 64:192], scale[:, 8:24].contiguous(), rs))
    for m in (1, 2, 4):
        _check(device, m, 72, 320, torch.bfloat16, block_n_tile=16, block_k=64)
    _check(device, 1, 48, 256, torch.bfloat16)  # the default tile (K caps BLOCK_K)
    if device == "cpu":
        # the default tiles of llama-8b's projections (pick_gemv_tile on 132 SMs; N and K kept
        # small) at each row variant with bf16 x, and the benchmark's sweep at one row, so the
        # sm_90 compile check sees the launches the engine and bench_fp8_gemm make
        for bn, bk, split in ((16, 512, 2), (8, 1024, 2), (16, 512, 1)):
            for m in (1, 2, 4):
                _check(device, m, 48, 2048, torch.bfloat16, block_n_tile=bn, block_k=bk, split_k=split)
        for bn, bk, split in ((16, 1024, 1), (4, 2048, 1), (8, 1024, 4)):
            _check(device, 1, 48, 2048, torch.bfloat16, block_n_tile=bn, block_k=bk, split_k=split)
    if device == "cuda":  # llama-8b's projections at the default tiles, and the dispatch
        from qsaserve.ops.nvfp4_gemm import nvfp4_linear

        for n, k in LLAMA_8B.values():
            for m in (1, 4):
                _check(device, m, n, k, torch.bfloat16)
        packed, scale, rs = _weight(4096, 4096, torch.Generator().manual_seed(5))
        x = torch.randn(3, 4096).to(torch.bfloat16)
        torch.testing.assert_close(nvfp4_linear(x.cuda(), packed.cuda(), scale.cuda(), rs.cuda()).cpu(),
                                   ref.nvfp4_w4a16_gemm_reference(x, packed, scale, rs), rtol=1e-2, atol=1e-2)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_default_tiles_at_llama_8b_shapes():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.nvfp4_gemm.triton_gemv import pick_gemv_tile

    tiles = {name: pick_gemv_tile(n, k, 132) for name, (n, k) in LLAMA_8B.items()}
    assert tiles == {"qkv": (16, 512, 2), "o": (8, 1024, 2), "gate_up": (16, 512, 1), "down": (8, 1024, 2)}
    for name, (bn, _, split) in tiles.items():
        assert -(-LLAMA_8B[name][0] // bn) * split >= 2 * 132  # every SM gets >= 2 programs
    assert pick_gemv_tile(576, 96, 132) == (4, 128, 1)  # small K caps BLOCK_K; too short to split


def test_rejects_more_rows_and_bad_tiles():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.nvfp4_gemm.triton_gemv import nvfp4_gemv_triton

    packed, scale, rs = _weight(16, 128, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="nvfp4_gemv"):
        nvfp4_gemv_triton(torch.zeros(5, 128), packed, scale, rs)
    with pytest.raises(ValueError, match="block_k"):
        nvfp4_gemv_triton(torch.zeros(1, 128), packed, scale, rs, block_k=96)


def test_nvfp4_dispatch_takes_the_gemv_up_to_gemv_rows(monkeypatch):
    """On CUDA tensors (faked: use_triton patched, the kernels replaced by recorders) nvfp4_linear
    takes the GEMV up to GEMV_ROWS rows and the tensor-core kernel above."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    import qsaserve.ops.nvfp4_gemm as nvfp4_gemm

    calls = []
    monkeypatch.setattr(nvfp4_gemm, "use_triton", lambda x: True)
    monkeypatch.setattr(nvfp4_gemm.triton_gemv, "nvfp4_gemv_triton",
                        lambda x, *a: calls.append(("gemv", x.shape[0])) or torch.zeros(x.shape[0], 16))
    monkeypatch.setattr(nvfp4_gemm.triton_gemm, "nvfp4_w4a16_gemm_triton",
                        lambda x, *a: calls.append(("tile", x.shape[0])) or torch.zeros(x.shape[0], 16))
    packed, scale, rs = _weight(16, 128, torch.Generator().manual_seed(0))
    monkeypatch.setattr(nvfp4_gemm.triton_swap_ab, "nvfp4_w4a16_swap_triton",
                        lambda x, *a, **tile: calls.append(("swap", x.shape[0])) or torch.zeros(x.shape[0], 16))
    for m in (1, nvfp4_gemm.GEMV_ROWS, nvfp4_gemm.GEMV_ROWS + 1, 64, 65):
        nvfp4_gemm.nvfp4_linear(torch.zeros(m, 128), packed, scale, rs)
    # auto: 16 weight rows are one 64-row block, too few for the tile kernel: transposed to 64 rows
    assert nvfp4_gemm.GEMV_ROWS == 4 and nvfp4_gemm.DECODE_KERNEL == "auto"
    assert calls == [("gemv", 1), ("gemv", 4), ("swap", 5), ("swap", 64), ("tile", 65)]
    # 264 row blocks (2 a program on 132 SMs) and more keep the tile kernel, from one row
    assert nvfp4_gemm.takes_swap(8, 263 * 64, 132) and not nvfp4_gemm.takes_swap(8, 264 * 64, 132)
    assert nvfp4_gemm.WIDE_N == 264 * 64
    assert nvfp4_gemm.takes_gemv(4, nvfp4_gemm.WIDE_N - 1) and not nvfp4_gemm.takes_gemv(1, nvfp4_gemm.WIDE_N)
    assert not nvfp4_gemm.takes_swap(1, nvfp4_gemm.WIDE_N, 132)
    monkeypatch.setattr(nvfp4_gemm, "DECODE_KERNEL", "tile")  # QSASERVE_NVFP4_DECODE_KERNEL=tile
    nvfp4_gemm.nvfp4_linear(torch.zeros(8, 128), packed, scale, rs)
    monkeypatch.setattr(nvfp4_gemm, "DECODE_KERNEL", "swap")  # every decode batch, 5-64 rows
    for m in (4, 5, 64, 65):
        nvfp4_gemm.nvfp4_linear(torch.zeros(m, 128), packed, scale, rs)
    assert calls[5:] == [("tile", 8), ("gemv", 4), ("swap", 5), ("swap", 64), ("tile", 65)]
