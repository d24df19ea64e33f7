"""The FP8-weight GEMM kernels (ops/fp8_gemm) against their torch references, under the Triton
interpreter (then compiled for sm_90) and on a GPU: the per-token-group activation quantization
(scales exact, values within one E4M3 rounding), the W8A8 block GEMM and the W8A16 decode GEMM
at block-128, per-channel and per-tensor scales, N and K not multiples of the tiles, and split
over K (split_k: whole 128-column blocks a program, ranges of unequal and zero length)."""
import pytest
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.fp8_gemm import reference as ref


def _weight(n, k, kind, gen):
    w = torch.randn(n, k, generator=gen) * k**-0.5
    if kind == "block":
        q, s = ref.quantize_weight_block(w)
        return q, s, 128
    q, s = ref.quantize_weight_rows(w, per_tensor=kind == "tensor")
    return q, s, (n if kind == "tensor" else 1)


def _check_quant(device, m, k, rows_multiple=1, scale_column_major=False):
    from qsaserve.ops.fp8_gemm.triton_quant import per_token_group_quant_triton

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3
    q, s = per_token_group_quant_triton(x.to(device), rows_multiple, scale_column_major)
    rows = -(-m // rows_multiple) * rows_multiple
    assert q.shape == (rows, k) and s.shape == (rows, -(-k // 128))
    if scale_column_major:  # cuBLAS's block-scaled layout: a group's scales adjacent over the rows
        assert s.stride() == (1, rows)
    assert (q[m:].float() == 0).all() and (s[m:] == 1).all()  # padding rows: zero, unit scale
    q, s = q[:m], s[:m]
    want_q, want_s = ref.per_token_group_quant_reference(x)
    torch.testing.assert_close(s.cpu(), want_s, rtol=1e-6, atol=0)
    # same scale: the E4M3 values agree up to the rounding of one tie
    torch.testing.assert_close(q.cpu().float(), want_q.float(), rtol=0.07, atol=2**-9)
    assert (q.cpu().float() == want_q.float()).float().mean() > 0.99


def _check_gated_quant(device, m, k, rows_multiple=1, scale_column_major=False):
    """The quantization of SiLU(gate) * up from gate | up: bit-equal to ops.fused's silu_mul
    kernel then the quantization, run the same way (the interpreter, or the GPU in bf16); the
    scales within one rounding of torch's SiLU then the reference quantization."""
    import torch.nn.functional as F

    from qsaserve.ops.fp8_gemm.triton_quant import per_token_group_quant_triton
    from qsaserve.ops.fused import triton_fused

    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the interpreter truncates bf16 casts
    gate_up = (torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(m + 3 * k)) * 3).to(dtype).to(device)
    q, s = per_token_group_quant_triton(gate_up, rows_multiple, scale_column_major, gated=True)
    want_q, want_s = per_token_group_quant_triton(triton_fused.silu_mul(gate_up), rows_multiple, scale_column_major)
    assert torch.equal(s.cpu(), want_s.cpu()) and torch.equal(q.cpu().float(), want_q.cpu().float())
    assert s.stride() == want_s.stride()
    g = gate_up.cpu().float()
    act = (F.silu(g[:, :k]).to(dtype).float() * g[:, k:]).to(dtype)
    _, ref_s = ref.per_token_group_quant_reference(act.float())  # the scales: a group's amax / 448
    tol = dict(rtol=1e-6, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=0)
    torch.testing.assert_close(s[:m].cpu(), ref_s, **tol)


def _check_silu_mul_linear(device, m, n, k, dtype=torch.bfloat16, bias=False):
    """fp8_linear_silu_mul (the quantization computing SiLU * up at W8A8 rows, the GEMV at 1-2)
    bit-equal to ops.fused.silu_mul then fp8_linear, through the real kernels (GPU)."""
    from qsaserve.ops import fused
    from qsaserve.ops.fp8_gemm import fp8_linear, fp8_linear_silu_mul

    gen = torch.Generator().manual_seed(m + n)
    w, ws, bn = _weight(n, k, "block", gen)
    w, ws = w.to(device), ws.to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    big = torch.randn(m, 2 * k + 64, generator=gen).to(dtype).to(device)
    gate_up = big[:, : 2 * k]  # a row stride past its width, as a view of a wider buffer
    got = fp8_linear_silu_mul(gate_up, w, ws, bn, b)
    want = fp8_linear(fused.silu_mul(gate_up), w, ws, bn, b)
    if m <= 2 and not ref.takes_w8a8(m, n):  # the gated GEMV: the same sums in another order
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(got, want), (m, n, k)


def _check_w8a8(device, m, n, k, kind, out_dtype, **tiles):
    from qsaserve.ops.fp8_gemm.triton_gemm import fp8_w8a8_gemm_triton

    check_w8a8(fp8_w8a8_gemm_triton, device, m, n, k, _weight(n, k, kind, torch.Generator().manual_seed(m * 7 + n)),
               out_dtype, m * 7 + n, **tiles)


def check_w8a8(kernel, device, m, n, k, weight, out_dtype, seed, **tiles):
    """kernel(xq, x_scale, w, w_scale, block_n, out_dtype, **tiles) on `device` against the W8A8
    reference; weight = (w, w_scale, block_n)."""
    gen = torch.Generator().manual_seed(seed + 1)  # not the weight's stream: x independent of w
    w, ws, bn = weight
    xq, xs = ref.per_token_group_quant_reference(torch.randn(m, k, generator=gen))
    got = kernel(xq.to(device), xs.to(device), w.to(device), ws.to(device), bn, out_dtype, **tiles).cpu()
    want = ref.fp8_w8a8_gemm_reference(xq, xs, w, ws, bn, out_dtype)
    assert got.shape == (m, n) and got.dtype == out_dtype
    tol = dict(rtol=1e-4, atol=1e-4) if out_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    # float32 out on a GPU holds 1e-4 because the kernels multiply the E4M3 values on fp16 MMAs there
    # (triton_gemm.e4m3_dot): Hopper's FP8 MMA, the bf16 models' path, was 2^-11.6 of the largest
    # sum off at a 128 x 128 tile on an H200
    torch.testing.assert_close(got, want, **tol)


def _check_w8a16(device, m, n, k, kind, dtype, **tiles):
    from qsaserve.ops.fp8_gemm.triton_gemm import fp8_w8a16_gemm_triton

    gen = torch.Generator().manual_seed(m * 11 + n)
    w, ws, bn = _weight(n, k, kind, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = fp8_w8a16_gemm_triton(x.to(device), w.to(device), ws.to(device), bn, **tiles).cpu()
    want = ref.fp8_w8a16_gemm_reference(x, w, ws, bn)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def _launch_w8a16_bf16_for_compile_check(m=1, n=72, k=256, **tiles):
    from qsaserve.ops.fp8_gemm.triton_gemm import fp8_w8a16_gemm_triton

    w, ws, bn = _weight(n, k, "block", torch.Generator().manual_seed(3))
    assert fp8_w8a16_gemm_triton(torch.ones(m, k, dtype=torch.bfloat16), w, ws, bn, **tiles).shape == (m, n)


def _triton_checks(device):
    _check_quant(device, 3, 300)  # a ragged last group
    _check_quant(device, 2, 128)
    _check_quant(device, 5, 256, rows_multiple=4, scale_column_major=True)  # the block-scaled GEMM's operands
    _check_quant(device, 3, 1300)  # 11 groups: two programs of 8, the second masked past the 11th
    _check_gated_quant(device, 3, 1300)  # gate | up: a ragged last group, two programs
    _check_gated_quant(device, 5, 256, rows_multiple=4, scale_column_major=True)  # cuBLAS's layout
    for kind in ("block", "channel", "tensor"):
        _check_w8a8(device, 70, 200, 300, kind, torch.float32, block_m=32, block_n_tile=64)
        _check_w8a16(device, 3, 200, 300, kind, torch.float32, block_n_tile=64)
        _check_w8a16(device, 2, 40, 640, kind, torch.float32, block_n_tile=16, k_unroll=1)
        # split-K: 5 blocks over 4 programs (1, 1, 1, 2 blocks), over 2 (2, 3: the 4-step
        # iteration's tail masked), and a ragged last block (3 blocks: 1 and 2 with the 44 columns)
        _check_w8a16(device, 2, 40, 640, kind, torch.float32, block_n_tile=16, k_unroll=1, split_k=4)
        _check_w8a16(device, 3, 40, 640, kind, torch.float32, block_n_tile=32, split_k=2)
        _check_w8a16(device, 1, 24, 300, kind, torch.float32, block_n_tile=16, k_unroll=2, split_k=2)
    # more programs than blocks: 2 blocks over 4 programs, two of which write zero partials
    _check_w8a16(device, 17, 24, 256, "block", torch.float32, block_n_tile=16, split_k=4)
    _check_w8a8(device, 20, 72, 128, "block", torch.bfloat16, block_m=16, block_n_tile=32)
    _check_w8a8(device, 130, 130, 128, "block", torch.float32)  # the default tile above 128 rows
    if device == "cuda":
        _check_w8a16(device, 1, 72, 256, "block", torch.bfloat16)  # block_n from the SM count
    else:  # Triton 3.6's interpreter computes tl.dot of bf16 operands wrongly (any bf16 dot, not
        # only this kernel's): the bf16 variant is launched to be compiled for sm_90, its values
        # are checked on the GPU
        _check_w8a16(device, 1, 72, 256, "block", torch.float32)
        _launch_w8a16_bf16_for_compile_check()
        # the default k_unroll / num_stages at every row block and weight-row block llama-8b's
        # projections take (BLOCK_N 128 is what pick_decode_block_n gives N >= 264 x 128 rows on
        # 132 SMs; given here to keep N small), K over several K iterations so the loads pipeline:
        # the sm_90 compile check then sees the GPU's shared memory (BLOCK_M 64 at 4 x 128-deep
        # steps and 3 stages needed 278528 bytes at BLOCK_N 64, over the SM's 232448)
        for m, bn in ((1, 128), (20, 128), (40, 128), (64, 64), (33, 32), (64, 16)):
            _launch_w8a16_bf16_for_compile_check(m, 136, 1280, block_n_tile=bn)
        # the split-K variants bench_fp8_gemm sweeps (the proposed rule's 32 x 4 steps, 3 stages
        # at 1-32 rows; 16 x 1 step at 64) and the partial-sum kernel at each split
        for m, bn, split in ((1, 32, 2), (1, 32, 4), (20, 32, 8), (64, 16, 4)):
            _launch_w8a16_bf16_for_compile_check(m, 136, 1280, block_n_tile=bn, split_k=split,
                                                 k_unroll=1 if m == 64 else 4, num_stages=3)
    _check_w8a16(device, 40, 136, 1280, "block", torch.float32, block_n_tile=128)
    if device == "cuda":  # SiLU * up joined to the quantization / GEMV: decode, verify and prefill rows
        for m in (1, 3, 16, 64, 65, 128):
            _check_silu_mul_linear(device, m, 4096, 14336)  # llama-8b's down (cuBLAS from 65 rows)
        _check_silu_mul_linear(device, 2, ref.W8A8_DECODE_MIN_N, 256, bias=True)  # a wide weight: W8A8 at 2 rows
        _check_silu_mul_linear(device, 70, 256, 384, dtype=torch.float16)  # fp16: the Triton prefill GEMM
    if device == "cuda":  # llama-8b's fused q/k/v at prefill and decode
        _check_w8a8(device, 512, 6144, 4096, "block", torch.bfloat16)
        for m in (1, 16, 64):
            _check_w8a16(device, m, 6144, 4096, "block", torch.bfloat16)
            _check_w8a16(device, m, 6144, 4096, "block", torch.bfloat16, split_k=4)
        _check_w8a16(device, 1, 4096, 14336, "block", torch.bfloat16, block_n_tile=32, split_k=8)  # down


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)

# _w8a16_kernel's shared memory as tests/triton_compile_check compiles it for sm_90 (Triton 3.6,
# 4 warps, the GPU JIT's divisibility attrs): (BLOCK_M, BLOCK_N, K_UNROLL, num_stages, x bytes)
_W8A16_MEASURED_SHARED = {
    (16, 128, 4, 3, 2): 164352, (16, 128, 4, 4, 2): 246272, (16, 64, 4, 3, 2): 98304,
    (32, 128, 4, 3, 2): 197120, (32, 128, 4, 4, 2): 295424, (32, 64, 4, 3, 2): 131072,
    (64, 16, 4, 3, 2): 217088, (64, 32, 4, 3, 2): 237568, (64, 32, 2, 3, 2): 122880,
    (64, 64, 4, 3, 2): 278528, (64, 64, 2, 3, 2): 147456, (64, 64, 4, 2, 2): 180224,
    (64, 128, 4, 3, 2): 360448, (64, 128, 2, 3, 2): 196608, (64, 128, 2, 4, 2): 262144,
    (16, 64, 4, 3, 4): 163840, (16, 128, 2, 3, 4): 163840, (16, 128, 1, 4, 4): 139264,
    (32, 64, 4, 3, 4): 229376, (32, 128, 2, 4, 4): 262144, (64, 128, 1, 3, 4): 163840,
    # compiled with split_k 2/4 (16 x 32), 8 (32 x 32), 4 (64 x 16): the split adds no shared memory
    (16, 32, 4, 3, 2): 65536, (32, 32, 4, 3, 2): 98304, (64, 16, 1, 3, 2): 57344,
}


def test_w8a16_shared_bytes_bounds_the_compiled_sizes():
    from qsaserve.ops.device import SM90_SHARED_BYTES
    from qsaserve.ops.fp8_gemm.triton_gemm import w8a16_shared_bytes

    for (bm, bn, ku, ns, xb), measured in _W8A16_MEASURED_SHARED.items():
        est = w8a16_shared_bytes(bm, bn, ku, ns, xb)
        assert measured <= est <= measured + 128 * bn * xb, (bm, bn, ku, ns, xb)
        assert (est <= SM90_SHARED_BYTES) == (measured <= SM90_SHARED_BYTES), (bm, bn, ku, ns, xb)
        if bm == 64 or xb == 4:
            assert est == measured


def test_w8a16_default_tiles_fit_sm90_at_llama_8b_decode_shapes():
    from qsaserve.layers.quantization.warm_up import WARM_UP_ROWS
    from qsaserve.ops.device import SM90_SHARED_BYTES
    from qsaserve.ops.fp8_gemm.triton_gemm import (decode_block_m, pick_decode_block_n, pick_decode_unroll,
                                                  w8a16_shared_bytes)

    tiles = set()
    for n in (6144, 4096, 28672):  # qkv, o and down, gate_up
        for m in WARM_UP_ROWS:
            bm, bn = decode_block_m(m), pick_decode_block_n(n, 132, decode_block_m(m))
            ku, ns = pick_decode_unroll(bm, bn, 2, SM90_SHARED_BYTES, 1 if bm == 64 else None)
            assert w8a16_shared_bytes(bm, bn, ku, ns, 2) <= SM90_SHARED_BYTES
            tiles.add((bm, bn, ku, ns))
    assert {t for t in tiles if t[0] <= 32} == {(16, 32, 4, 3), (32, 32, 4, 3)}  # the measured best decode tile
    assert {t for t in tiles if t[0] == 64} == {(64, 16, 1, 3)}
    assert pick_decode_block_n(576, 132) == 16  # 18 blocks of 32 would leave most SMs idle


def test_pick_decode_split_k_proposal_at_llama_8b_shapes():
    from qsaserve.ops.fp8_gemm.triton_gemm import pick_decode_split_k

    # BLOCK_N 32 on 132 SMs: qkv's 192 programs, o's and down's 128 -> 4 splits (768, 512, 512);
    # gate_up's 896 already fill the SMs 3 deep
    assert [pick_decode_split_k(n, k, 32, 132) for n, k in ((6144, 4096), (4096, 4096), (4096, 14336),
                                                           (28672, 4096))] == [4, 4, 4, 1]
    assert pick_decode_split_k(4096, 14336, 64, 132) == 8  # 64 programs: 8 x 14 blocks
    assert pick_decode_split_k(4096, 2048, 32, 132) == 2  # 16 blocks: no split below 8 each
    assert pick_decode_split_k(4096, 1024, 32, 132) == 1
    assert pick_decode_split_k(576, 4096, 16, 132) == 4  # 36 programs, capped by the depth at 32 blocks


def test_block_quantization_round_trip_and_layout():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    q, s = ref.quantize_weight_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float32
    back = ref.dequantize_weight(q, s, 128)
    assert ((back - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-9).all()  # within half an E4M3 step
    # the block scale is its block's amax / 448
    torch.testing.assert_close(s[1, 2], w[128:, 256:].abs().max() / 448)


def test_fp8_linear_reference_switches_to_w8a8_above_the_w8a16_rows():
    """Up to W8A16_ROWS (2) rows the activations stay unquantized, from 3 rows on they are
    quantized per token group (the transposed W8A8 GEMM's decode rows, then prefill)."""
    if ref.DECODE_KERNEL != "w8a8":
        pytest.skip(f"QSASERVE_FP8_DECODE_KERNEL={ref.DECODE_KERNEL} keeps W8A16 to {ref.DECODE_ROWS} rows (an A/B run)")
    assert ref.W8A16_ROWS == 2
    gen = torch.Generator().manual_seed(1)
    w, ws, bn = _weight(64, 256, "block", gen)
    for rows in (ref.W8A16_ROWS + 1, ref.DECODE_ROWS + 1):
        x = torch.randn(rows, 256, generator=gen)
        xq, xs = ref.per_token_group_quant_reference(x)
        torch.testing.assert_close(ref.fp8_linear_reference(x, w, ws, bn),
                                   ref.fp8_w8a8_gemm_reference(xq, xs, w, ws, bn, x.dtype))
    few = x[: ref.W8A16_ROWS]
    torch.testing.assert_close(ref.fp8_linear_reference(few, w, ws, bn), few @ ref.dequantize_weight(w, ws, bn).t())


def test_decode_kernel_switch_keeps_w8a16_to_the_decode_rows():
    """QSASERVE_FP8_DECODE_KERNEL=swap (the A/B of the W8A8 decode path): W8A16 up to DECODE_ROWS,
    in a fresh interpreter (read at import); an unknown value is refused naming the variable."""
    import os
    import subprocess
    import sys

    code = ("from qsaserve.ops.fp8_gemm import reference as r; "
            "print(r.W8A16_ROWS, r.takes_w8a8(64, 4096), r.takes_w8a8(65, 4096))")
    env = dict(os.environ, QSASERVE_FP8_DECODE_KERNEL="swap")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["64", "False", "True"]
    env["QSASERVE_FP8_DECODE_KERNEL"] = "fast"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "QSASERVE_FP8_DECODE_KERNEL" in bad.stderr


def test_wide_weights_take_w8a8_from_two_rows():
    """A weight of W8A8_DECODE_MIN_N rows (132 x 128: its 64 x 128 W8A8 tiles fill an H200) takes
    W8A8 from 2 rows, on CPU as on the GPU; one row and narrower weights stay W8A16 (up to 2 rows
    by default)."""
    if ref.DECODE_KERNEL != "w8a8":
        pytest.skip(f"QSASERVE_FP8_DECODE_KERNEL={ref.DECODE_KERNEL} keeps W8A16 to {ref.DECODE_ROWS} rows (an A/B run)")
    assert ref.W8A8_DECODE_MIN_N == 132 * 128
    assert [ref.takes_w8a8(m, ref.W8A8_DECODE_MIN_N) for m in (1, 2, 64, 65)] == [False, True, True, True]
    assert [ref.takes_w8a8(m, ref.W8A8_DECODE_MIN_N - 1) for m in (1, 2, 3, 65)] == [False, False, True, True]
    gen = torch.Generator().manual_seed(2)
    w, ws, bn = _weight(ref.W8A8_DECODE_MIN_N, 128, "block", gen)
    x = torch.randn(2, 128, generator=gen)
    xq, xs = ref.per_token_group_quant_reference(x)
    torch.testing.assert_close(ref.fp8_linear_reference(x, w, ws, bn), ref.fp8_w8a8_gemm_reference(xq, xs, w, ws, bn, x.dtype))
    torch.testing.assert_close(ref.fp8_linear_reference(x[:1], w, ws, bn), x[:1] @ ref.dequantize_weight(w, ws, bn).t())
