"""The transposed NVFP4 W4A16 GEMM (ops/nvfp4_gemm/triton_swap_ab.py) against the W4A16 reference,
under the Triton interpreter (then compiled for sm_90) and on a GPU: 1 to 70 rows (one token block
and two), per-row row scales, N not a multiple of the tile and K of 128 (a partial last step),
split over K (ranges of unequal and zero length), every E2M1 code in both nibbles, E4M3 group
scales from the subnormal smallest to the largest, a column slice of a wider weight, float32, bf16
and fp16 x (fp16 takes the unscaled decode); on CPU also the tiles bench_fp8_gemm sweeps."""
import pytest
import torch
from test_fp8_swap_ab_triton import bench_fp8_gemm
from test_nvfp4_gemv_triton import _every_code_weight, _weight
from triton_interpreter import interpreter_bf16_dot_shim, triton_check_tests

from qsaserve.ops.nvfp4_gemm import reference as ref

# (block_n_tile, num_warps, num_stages) of bench_fp8_gemm.NVFP4_SWAP_TILES
BENCH_TILES = ((64, 4, 4), (128, 4, 4), (128, 8, 3))


def _check(device, m, n, k, dtype, weight=None, **tiles):
    from qsaserve.ops.nvfp4_gemm.triton_swap_ab import nvfp4_w4a16_swap_triton

    gen = torch.Generator().manual_seed(m * 23 + n + k)
    packed, scale, rs = weight or _weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = nvfp4_w4a16_swap_triton(x.to(device), packed.to(device), scale.to(device), rs.to(device), **tiles).cpu()
    want = ref.nvfp4_w4a16_gemm_reference(x, packed, scale, rs)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def _scale_extremes(n, k):
    """Random codes with group scales cycling from E4M3's smallest subnormal (2^-9) to 448."""
    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    codes = torch.tensor([1, 2, 0x30, 0x50, 0x70, 0x7E], dtype=torch.uint8)  # 2^-9, 2^-8, 0.5, 8, 128, 448
    scale = codes[torch.arange(n * k // 16) % len(codes)].view(n, k // 16).view(torch.float8_e4m3fn)
    return packed, scale, torch.full((n,), 0.01)


def _triton_checks(device):
    if device == "cpu":
        interpreter_bf16_dot_shim()
    for m in (1, 5, 17, 64, 70):
        # N = 200: a ragged last row block; K = 336: 2 full steps and one of 5 groups
        _check(device, m, 200, 336, torch.float32, block_n_tile=64, num_stages=2)
    _check(device, 9, 200, 336, torch.float32, block_n_tile=32, split_k=2)  # 3 steps over 2 programs
    _check(device, 9, 40, 256, torch.float32, block_n_tile=32, split_k=4)  # 2 steps, 4 programs (2 with none)
    _check(device, 8, 32, 256, torch.float32, weight=_every_code_weight(32, 256), block_n_tile=32)
    _check(device, 8, 48, 384, torch.float32, weight=_scale_extremes(48, 384), block_n_tile=32)
    gen = torch.Generator().manual_seed(2)
    packed, scale, rs = _weight(24, 512, gen)
    # columns 128-383 of the wider weight: packed rows 256 bytes apart, a view that is not contiguous
    _check(device, 6, 24, 256, torch.float32, weight=(packed[:, 64:192], scale[:, 8:24].contiguous(), rs),
           block_n_tile=32)
    for m in (3, 16, 48):
        _check(device, m, 136, 384, torch.bfloat16, block_n_tile=64)
    _check(device, 8, 48, 384, torch.bfloat16, weight=_scale_extremes(48, 384), block_n_tile=64)
    _check(device, 16, 72, 256, torch.float16, block_n_tile=64, split_k=2)
    _check(device, 8, 48, 384, torch.float16, weight=_scale_extremes(48, 384), block_n_tile=64)
    if device == "cpu":  # the benchmark's tiles, bf16 x (what sm_90 compiles)
        for bn, warps, stages in BENCH_TILES:
            for m in (8, 64):
                _check(device, m, 128, 512, torch.bfloat16, block_n_tile=bn, num_warps=warps, num_stages=stages,
                       split_k=2)
    if device == "cuda":  # llama-8b's projections
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            for m in (8, 64):
                _check(device, m, n, k, torch.bfloat16, block_n_tile=128, split_k=2)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_rejects_bad_shapes_and_launches():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.nvfp4_gemm.triton_swap_ab import nvfp4_w4a16_swap_triton

    packed, scale, rs = _weight(16, 256, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="split_k"):
        nvfp4_w4a16_swap_triton(torch.zeros(4, 256), packed, scale, rs, split_k=0)
    with pytest.raises(ValueError, match="nvfp4_w4a16_swap"):
        nvfp4_w4a16_swap_triton(torch.zeros(4, 128), packed, scale, rs)  # K mismatch


def test_the_compiled_tiles_are_the_benchmarks():
    assert tuple(bench_fp8_gemm().NVFP4_SWAP_TILES) == BENCH_TILES
