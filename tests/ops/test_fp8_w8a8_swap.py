"""The transposed block-FP8 W8A8 GEMM for decode and verify rows (ops/fp8_gemm/triton_w8a8_swap.py)
against the W8A8 reference, under the Triton interpreter (then compiled for sm_90) and on a GPU:
1 to 300 rows (one token block of 16 to 128 and several), block-128 / per-channel / per-tensor
scales and a block_n that does not divide the tile (48), N and K not multiples of the tile, split
over K (ranges of unequal and zero length), float32 and bf16 out; and its launch rule."""
import pytest
import torch
from test_fp8_gemm_triton import check_w8a8
from test_fp8_gemv_triton import _weight
from triton_interpreter import triton_check_tests

from qsaserve.ops.fp8_gemm import reference as ref


def _check(device, m, n, k, kind, out_dtype, **launch):
    from qsaserve.ops.fp8_gemm.triton_w8a8_swap import fp8_w8a8_swap_triton

    seed = m * 13 + n + k
    check_w8a8(fp8_w8a8_swap_triton, device, m, n, k, _weight(n, k, kind, torch.Generator().manual_seed(seed)),
               out_dtype, seed, **launch)


def _triton_checks(device):
    for kind in ("block", "channel", "tensor", "block48"):
        for m in (1, 5, 17, 40, 70, 130):  # 16 to 128 token columns; 130: two token blocks of 128
            # N = 200: a ragged last row block; K = 320: a ragged last group
            _check(device, m, 200, 320, kind, torch.float32, block_n_tile=64, num_stages=2)
        # split over 3 groups: 3 programs of one group, then 4 (one with none)
        _check(device, 9, 200, 320, kind, torch.float32, block_n_tile=64, split_k=3)
        _check(device, 33, 40, 320, kind, torch.float32, block_n_tile=32, split_k=4)
    for m in (3, 64, 100):  # the default launch (pick_w8a8_swap_tile), bf16 out
        _check(device, m, 136, 1024, "block", torch.bfloat16)
    _check(device, 300, 136, 384, "block", torch.bfloat16, block_n_tile=128, split_k=2)  # 3 token blocks
    if device == "cpu":  # the launches the rule gives llama-8b's shapes, at small N (the sm_90 compile sees them)
        for m in (8, 32, 64, 128, 256):
            for n, k in ((6144, 4096), (4096, 14336)):
                from qsaserve.ops.fp8_gemm.triton_w8a8_swap import pick_w8a8_swap_tile

                bn, split, warps, stages = pick_w8a8_swap_tile(m, n, k, 132)
                _check(device, m, bn, 128 * 2 * split, "block", torch.bfloat16, block_n_tile=bn, split_k=split,
                       num_warps=warps, num_stages=stages)
    if device == "cuda":  # llama-8b's projections at decode and verify rows
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            for m in (8, 64, 128, 256):
                _check(device, m, n, k, "block", torch.bfloat16)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_rejects_bad_launches_and_scales():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.fp8_gemm.triton_w8a8_swap import fp8_w8a8_swap_triton

    w, ws, bn = _weight(16, 256, "block", torch.Generator().manual_seed(0))
    xq, xs = ref.per_token_group_quant_reference(torch.zeros(4, 256))
    with pytest.raises(ValueError, match="split_k"):
        fp8_w8a8_swap_triton(xq, xs, w, ws, bn, torch.float32, block_n_tile=64, split_k=0, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="block_n_tile"):
        fp8_w8a8_swap_triton(xq, xs, w, ws, bn, torch.float32, block_n_tile=24, split_k=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="block_n_tile"):
        fp8_w8a8_swap_triton(xq, xs, w, ws, bn, torch.float32, block_n_tile=48, split_k=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_w8a8_swap_triton(xq, xs[:, :1], w, ws, bn, torch.float32)
    with pytest.raises(ValueError, match="unit column stride"):  # cuBLAS's column-major scales
        fp8_w8a8_swap_triton(xq, xs.t().contiguous().t(), w, ws, bn, torch.float32)
    with pytest.raises(ValueError, match="fp8_w8a8_swap"):
        fp8_w8a8_swap_triton(xq, xs, w, ws[:, :1].repeat(1, 3), bn, torch.float32)  # Sk neither 1 nor ceil(K/128)


def test_launch_rule_at_llama_8b_shapes():
    """pick_w8a8_swap_tile on 132 SMs at llama-8b's shapes: the launches that led (or came within
    3% of) the H200 sweep (docs/weight_quantization.md); a short K is not cut below 4 groups."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.fp8_gemm.triton_w8a8_swap import pick_w8a8_swap_tile

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    at = {m: {name: pick_w8a8_swap_tile(m, n, k, 132) for name, (n, k) in shapes.items()} for m in (8, 32, 64)}
    small = {"qkv": (64, 4, 4, 5), "o": (64, 4, 4, 5), "gate_up": (64, 1, 4, 3), "down": (64, 4, 4, 5)}
    assert at[8] == small and at[32] == small
    assert at[64] == {"qkv": (64, 4, 4, 3), "o": (64, 4, 4, 3), "gate_up": (128, 1, 4, 4), "down": (64, 4, 4, 3)}
    # 65-128 rows on the narrow weights (o, down; ops.fp8_gemm.takes_swap): the sweep's best at 128 rows
    assert {name: pick_w8a8_swap_tile(128, *shapes[name], 132) for name in ("o", "down")} == {
        "o": (64, 4, 4, 3), "down": (64, 4, 4, 3)}
    assert pick_w8a8_swap_tile(8, 4096, 512, 132)[1] == 1  # 4 groups: not cut
    assert pick_w8a8_swap_tile(8, 4096, 1024, 132)[1] == 2  # 8 groups: 2 programs of 4


def test_narrow_weights_keep_the_transposed_gemm_to_128_rows(monkeypatch):
    """On CUDA (faked) a W8A8 product takes the transposed GEMM up to DECODE_ROWS rows, and up to
    NARROW_SWAP_ROWS for weights of at most NARROW_N rows (cuBLAS's 128 x 128 tiles would leave
    most SMs idle); other rows take cuBLAS's block-scaled GEMM where it serves the call."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    import qsaserve.ops.fp8_gemm as fp8_gemm

    assert fp8_gemm.NARROW_N == 4096 and fp8_gemm.NARROW_SWAP_ROWS == 128
    calls = []
    monkeypatch.setattr(fp8_gemm, "use_triton", lambda t: True)
    monkeypatch.setattr(fp8_gemm.scaled_mm, "takes", lambda *a: True)
    monkeypatch.setattr(fp8_gemm.scaled_mm, "fp8_linear_scaled_mm", lambda x, *a, **k: calls.append(("cublas", x.shape[0])))
    monkeypatch.setattr(fp8_gemm, "per_token_group_quant", lambda x, gated=False: (x, None))
    monkeypatch.setattr(fp8_gemm.triton_w8a8_swap, "fp8_w8a8_swap_triton", lambda x, *a: calls.append(("swap", x.shape[0])))
    for n, m in ((4096, 64), (4096, 65), (4096, 128), (4096, 129), (4224, 65), (6144, 64), (6144, 128)):
        fp8_gemm._w8a8_linear(torch.zeros(m, 256), torch.zeros(n, 256, dtype=fp8_gemm.FP8), torch.ones(1, 2), 128)
    assert calls == [("swap", 64), ("swap", 65), ("swap", 128), ("cublas", 129), ("cublas", 65), ("swap", 64),
                     ("cublas", 128)]
