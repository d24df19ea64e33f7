"""The transposed ("swap AB") FP8-weight W8A16 GEMM (ops/fp8_gemm/triton_swap_ab.py) against the
W8A16 reference, under the Triton interpreter (then compiled for sm_90) and on a GPU: 1 to 70
rows (one token block and two), block-128 / per-channel / per-tensor scales and a block_n that
does not divide the tile (48), N and K not multiples of the tile, split over K (ranges of unequal
and zero length), float32 and bf16 x; on CPU also every tile benchmarks/bench_fp8_gemm.py sweeps,
so the sm_90 compile check sees their shared memory."""
import pytest
import torch
from test_fp8_gemv_triton import _weight, check_w8a16
from triton_interpreter import interpreter_bf16_dot_shim, triton_check_tests

# (block_n_tile, num_warps, num_stages) of bench_fp8_gemm.SWAP_TILES
BENCH_TILES = ((64, 4, 4), (128, 4, 4), (128, 8, 4), (64, 4, 6), (128, 4, 3))


def _check(device, m, n, k, kind, dtype, **tiles):
    from qsaserve.ops.fp8_gemm.triton_swap_ab import fp8_w8a16_swap_triton

    check_w8a16(fp8_w8a16_swap_triton, device, m, n, k, kind, dtype, m * 31 + n + k, **tiles)


def _triton_checks(device):
    if device == "cpu":
        interpreter_bf16_dot_shim()
    for kind in ("block", "channel", "tensor", "block48"):
        for m in (1, 5, 17, 64, 70):  # 16, 32 and 64 token columns; 70: two token blocks
            # N = 200: a ragged last row block; K = 320: a ragged last group
            _check(device, m, 200, 320, kind, torch.float32, block_n_tile=64, num_stages=2)
        # split over 3 groups: 3 programs of one group, then 4 (one with none)
        _check(device, 9, 200, 320, kind, torch.float32, block_n_tile=64, split_k=3)
        _check(device, 33, 40, 320, kind, torch.float32, block_n_tile=32, split_k=4)
    for m in (3, 16, 48):
        _check(device, m, 136, 384, "block", torch.bfloat16, block_n_tile=64)
        _check(device, m, 136, 384, "channel", torch.bfloat16, block_n_tile=128, split_k=2)
    if device == "cpu":  # the benchmark's tiles at its row counts, bf16 x (what sm_90 compiles)
        for bn, warps, stages in BENCH_TILES:
            for m in (8, 64):
                for split in (1, 4):
                    _check(device, m, 128, 512, "block", torch.bfloat16, block_n_tile=bn, num_warps=warps,
                           num_stages=stages, split_k=split)
    if device == "cuda":  # llama-8b's projections
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            for m in (8, 64):
                _check(device, m, n, k, "block", torch.bfloat16, block_n_tile=128, split_k=2)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_rejects_bad_launches():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.fp8_gemm.triton_swap_ab import fp8_w8a16_swap_triton

    w, ws, bn = _weight(16, 256, "block", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="split_k"):
        fp8_w8a16_swap_triton(torch.zeros(4, 256), w, ws, bn, split_k=0)
    with pytest.raises(ValueError, match="fp8_w8a16_swap"):
        fp8_w8a16_swap_triton(torch.zeros(4, 256), w, ws[:, :1].repeat(1, 3), bn)  # Sk neither 1 nor ceil(K/128)


def bench_fp8_gemm():
    """benchmarks/bench_fp8_gemm.py as a module (its tile lists)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "bench_fp8_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_fp8_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_compiled_tiles_are_the_benchmarks():
    assert tuple(bench_fp8_gemm().SWAP_TILES) == BENCH_TILES


def test_split_rule_gives_every_sm_two_programs_where_k_allows():
    """pick_swap_split_k at llama-8b's shapes on 132 SMs: the splits that led the H200 sweep
    (docs/weight_quantization.md); a short K is not cut below 4 groups a program."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.fp8_gemm.triton_swap_ab import pick_swap_split_k

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    assert {name: pick_swap_split_k(n, k, 132) for name, (n, k) in shapes.items()} == \
        {"qkv": 4, "o": 4, "gate_up": 1, "down": 4}
    assert pick_swap_split_k(4096, 1024, 132) == 2  # 8 groups of 128: 2 programs of 4
    assert pick_swap_split_k(4096, 512, 132) == 1
    assert pick_swap_split_k(8448, 4096, 132) == 2  # 132 row blocks: 2 a program with 2 splits
