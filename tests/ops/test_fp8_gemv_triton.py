"""The FP8-weight decode GEMV (ops/fp8_gemm/triton_gemv.py) against the W8A16 reference, under the
Triton interpreter (then compiled for sm_90) and on a GPU: 1-4 rows, block-128 / per-channel /
per-tensor scales and a block_n that does not divide the tile (48), N and K not multiples of the
tile, split over K (ranges of unequal and zero length), float32 and bf16 x; the default tile rule
at llama-8b's shapes; and the dispatch (GEMV up to GEMV_ROWS rows, the tile kernel above)."""
import pytest
import torch
from test_fp8_gemm_triton import _weight as fp8_gemm_weight
from triton_interpreter import triton_check_tests

from qsaserve.ops.fp8_gemm import reference as ref

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _weight(n, k, kind, gen):
    """test_fp8_gemm_triton's weights, plus "block48": scale rows of 48 weight rows (a fused
    projection's common divisor)."""
    if kind != "block48":
        return fp8_gemm_weight(n, k, kind, gen)
    q, s = ref.quantize_weight_block(torch.randn(n, k, generator=gen) * k**-0.5)
    return q, torch.rand(-(-n // 48), s.shape[1], generator=gen) * 0.02 + 1e-3, 48


def check_w8a16(kernel, device, m, n, k, kind, dtype, seed, **tiles):
    """kernel(x, w, w_scale, block_n, **tiles) on `device` against the W8A16 reference."""
    gen = torch.Generator().manual_seed(seed)
    w, ws, bn = _weight(n, k, kind, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = kernel(x.to(device), w.to(device), ws.to(device), bn, **tiles).cpu()
    want = ref.fp8_w8a16_gemm_reference(x, w, ws, bn)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def _check(device, m, n, k, kind, dtype, **tiles):
    from qsaserve.ops.fp8_gemm.triton_gemv import fp8_gemv_triton

    check_w8a16(fp8_gemv_triton, device, m, n, k, kind, dtype, m * 17 + n + k, **tiles)


def _triton_checks(device):
    for kind in ("block", "channel", "tensor", "block48"):
        for m in (1, 2, 3, 4):
            # N = 200: a ragged last row block; K = 320: a ragged last group and tile
            _check(device, m, 200, 320, kind, torch.float32, block_n_tile=16, block_k=256)
        # split-K over 3 groups: 3 programs of one group each, then 4 programs (one with none)
        _check(device, 3, 200, 320, kind, torch.float32, block_n_tile=8, block_k=128, split_k=3)
        _check(device, 1, 40, 320, kind, torch.float32, block_n_tile=4, block_k=128, split_k=4)
    # 5 groups over 2 programs (2 and 3: the second's last 256-wide iteration half masked)
    _check(device, 2, 24, 640, "block", torch.float32, block_n_tile=8, block_k=256, split_k=2)
    _check(device, 4, 24, 640, "block48", torch.float32, block_n_tile=16, block_k=128, num_stages=1)
    for m in (1, 2, 4):
        _check(device, m, 72, 320, "block", torch.bfloat16, block_n_tile=16, block_k=128)
        _check(device, m, 72, 320, "channel", torch.bfloat16, block_n_tile=8, block_k=256, split_k=2)
    _check(device, 1, 48, 256, "block", torch.bfloat16)  # the default tile (K caps BLOCK_K)
    if device == "cpu":
        # the default tiles of llama-8b's projections (pick_gemv_tile on 132 SMs, given here to
        # keep N and K small) at each row variant, bf16 x, block and per-channel scales, so the
        # sm_90 compile check sees the launches the engine makes
        for bn, bk, split, warps in ((8, 1024, 1, 2), (16, 512, 1, 4), (16, 1024, 1, 4), (8, 2048, 1, 4),
                                     (16, 1024, 2, 4), (8, 2048, 2, 4)):
            for m in (1, 2, 4):
                _check(device, m, 48, 4096, "block", torch.bfloat16, block_n_tile=bn, block_k=bk, split_k=split,
                       num_warps=warps)
            _check(device, 1, 48, 4096, "channel", torch.bfloat16, block_n_tile=bn, block_k=bk, split_k=split)
            # the defaults unpipelined (bench_fp8_gemm's fp8_gemv_st1, one row)
            _check(device, 1, 48, 4096, "block", torch.bfloat16, block_n_tile=bn, block_k=bk, split_k=split,
                   num_stages=1)
        # the benchmark's sweep (bench_fp8_gemm.GEMV_SWEEP) at each row variant
        for bn, bk, split, warps, stages in ((16, 512, 1, 4, 3), (8, 1024, 1, 4, 3), (4, 2048, 1, 4, 3),
                                             (8, 1024, 4, 4, 3), (16, 1024, 1, 8, 3), (32, 1024, 1, 8, 3),
                                             (16, 2048, 1, 8, 3), (32, 512, 1, 8, 4), (16, 1024, 1, 4, 4),
                                             (16, 512, 1, 2, 4)):
            for m in (1, 2, 4):
                _check(device, m, 48, 4096, "block", torch.bfloat16, block_n_tile=bn, block_k=bk, split_k=split,
                       num_warps=warps, num_stages=stages)
    if device == "cuda":  # llama-8b's projections at the default tiles, and the dispatch
        from qsaserve.ops.fp8_gemm import fp8_w8a16_gemm

        for n, k in LLAMA_8B.values():
            for m in (1, 4):
                _check(device, m, n, k, "block", torch.bfloat16)
        _check(device, 2, 6144, 4096, "channel", torch.bfloat16)
        gen = torch.Generator().manual_seed(5)
        w, ws, bn = _weight(4096, 4096, "block", gen)
        x = torch.randn(4, 4096, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(fp8_w8a16_gemm(x.cuda(), w.cuda(), ws.cuda(), bn).cpu(),
                                   ref.fp8_w8a16_gemm_reference(x, w, ws, bn), rtol=1e-2, atol=1e-2)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_default_tiles_at_llama_8b_shapes():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.fp8_gemm.triton_gemv import pick_gemv_tile

    narrow, tall = (8, 1024, 1, 2), (16, 512, 1, 4)
    expected = {1: dict.fromkeys(LLAMA_8B, narrow),  # 8 rows over 2 warps at one row
                2: {"qkv": tall, "o": narrow, "gate_up": tall, "down": narrow}}  # at two, up to 4 x 8 rows a SM
    for m, want in expected.items():
        tiles = {name: pick_gemv_tile(n, k, 132, m) for name, (n, k) in LLAMA_8B.items()}
        assert tiles == want
        for name, (bn, _, _, _) in tiles.items():
            assert -(-LLAMA_8B[name][0] // bn) >= 132  # every SM gets a program
    assert pick_gemv_tile(576, 256, 132) == (4, 256, 1, 2)  # small N narrows the block, small K caps BLOCK_K


def test_rejects_more_rows_and_bad_tiles():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.fp8_gemm.triton_gemv import fp8_gemv_triton

    w, ws, bn = _weight(16, 256, "block", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="at most 4 rows"):
        fp8_gemv_triton(torch.zeros(5, 256), w, ws, bn)
    with pytest.raises(ValueError, match="block_k"):
        fp8_gemv_triton(torch.zeros(1, 256), w, ws, bn, block_k=192)
    with pytest.raises(ValueError, match="fp8_gemv"):
        fp8_gemv_triton(torch.zeros(1, 256), w, ws[:, :1].repeat(1, 3), bn)  # Sk neither 1 nor ceil(K/128)


def test_w8a16_dispatch_takes_the_gemv_up_to_gemv_rows(monkeypatch):
    """On CUDA tensors (faked: use_triton patched, the kernels replaced by recorders) the W8A16 op
    takes the GEMV up to GEMV_ROWS rows and the transposed kernel above (the tile kernel under
    QSASERVE_FP8_DECODE_KERNEL=tile); CPU tensors the reference."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    import qsaserve.ops.fp8_gemm as fp8_gemm

    calls = []
    monkeypatch.setattr(fp8_gemm, "use_triton", lambda x: True)
    monkeypatch.setattr(fp8_gemm.triton_gemv, "fp8_gemv_triton", lambda x, *a: calls.append(("gemv", x.shape[0])))
    monkeypatch.setattr(fp8_gemm.triton_gemm, "fp8_w8a16_gemm_triton", lambda x, *a: calls.append(("tile", x.shape[0])))
    monkeypatch.setattr(fp8_gemm.triton_swap_ab, "fp8_w8a16_swap_triton",
                        lambda x, *a, **tile: calls.append(("swap", x.shape[0], tile)))
    monkeypatch.setattr(fp8_gemm, "DECODE_KERNEL", "w8a8")  # the default (W8A16 past 2 rows: direct calls, A/B runs)
    w, ws, bn = _weight(16, 256, "block", torch.Generator().manual_seed(0))
    for m in (1, fp8_gemm.GEMV_ROWS, fp8_gemm.GEMV_ROWS + 1, 64):
        fp8_gemm.fp8_w8a16_gemm(torch.zeros(m, 256), w, ws, bn)
    assert fp8_gemm.GEMV_ROWS == 2
    # the transposed kernel at its own launch defaults (pick_swap_split_k per weight)
    assert calls == [("gemv", 1), ("gemv", 2), ("swap", 3, {}), ("swap", 64, {})]
    monkeypatch.setattr(fp8_gemm, "DECODE_KERNEL", "tile")  # QSASERVE_FP8_DECODE_KERNEL=tile
    fp8_gemm.fp8_w8a16_gemm(torch.zeros(2, 256), w, ws, bn)
    fp8_gemm.fp8_w8a16_gemm(torch.zeros(8, 256), w, ws, bn)
    assert calls[4:] == [("gemv", 2), ("tile", 8)]
    monkeypatch.undo()
    x = torch.randn(2, 256)
    torch.testing.assert_close(fp8_gemm.fp8_w8a16_gemm(x, w, ws, bn), ref.fp8_w8a16_gemm_reference(x, w, ws, bn))


def test_gated_gemv_is_silu_mul_then_the_gemv_under_the_interpreter():
    """fp8_gemv_triton(gated=True) on gate | up equals ops.fused's SiLU * up then the W8A16
    reference (float32 x: the interpreter truncates bf16 casts); 1-4 rows, a ragged K, split-K."""
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__, "t._gated_checks('cpu')")


def _gated_checks(device):
    import torch.nn.functional as F

    from qsaserve.ops.fp8_gemm.triton_gemv import fp8_gemv_triton

    gen = torch.Generator().manual_seed(5)
    for m, n, k, split in ((1, 40, 300, 1), (3, 24, 256, 2), (4, 16, 640, 1)):
        w, ws, bn = _weight(n, k, "block", gen)
        gate_up = torch.randn(m, 2 * k, generator=gen)
        want = ref.fp8_w8a16_gemm_reference(F.silu(gate_up[:, :k]) * gate_up[:, k:], w, ws, bn)
        got = fp8_gemv_triton(gate_up.to(device), w.to(device), ws.to(device), bn, split_k=split, gated=True).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        xb = gate_up.to(torch.bfloat16)  # bf16: SiLU and the product rounded as silu_mul rounds
        got = fp8_gemv_triton(xb.to(device), w.to(device), ws.to(device), bn, split_k=split, gated=True).cpu()
        if device != "cpu":  # (on CPU launched for the sm_90 compile check only)
            act = (F.silu(xb[:, :k].float()).to(torch.bfloat16).float() * xb[:, k:].float()).to(torch.bfloat16)
            want = ref.fp8_w8a16_gemm_reference(act.float(), w, ws, bn)
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_gated_gemv_on_gpu():
    _gated_checks("cuda")


def test_fp8_linear_silu_mul_fuses_at_gemv_rows_only(monkeypatch):
    """On CUDA (faked) SiLU * up goes into the GEMV up to GEMV_ROWS rows and into the activation
    quantization at W8A8 rows; W8A16 rows past the GEMV's (and CPU) run ops.fused.silu_mul then
    fp8_linear, whose result the fused form equals on CPU."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    import torch.nn.functional as F

    import qsaserve.ops.fp8_gemm as fp8_gemm

    w, ws, bn = _weight(16, 256, "block", torch.Generator().manual_seed(6))
    gate_up = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(fp8_gemm.fp8_linear_silu_mul(gate_up, w, ws, bn),
                               fp8_gemm.fp8_linear(F.silu(gate_up[:, :256]) * gate_up[:, 256:], w, ws, bn))
    calls = []
    monkeypatch.setattr(fp8_gemm, "use_triton", lambda x: True)
    monkeypatch.setattr(fp8_gemm.triton_gemv, "fp8_gemv_triton",
                        lambda x, *a, **kw: calls.append(("gemv", x.shape[0], kw.get("gated"))) or torch.zeros(x.shape[0], 16))
    monkeypatch.setattr(fp8_gemm, "fp8_linear", lambda x, *a: calls.append(("linear", x.shape[0])) or torch.zeros(x.shape[0], 16))
    monkeypatch.setattr(fp8_gemm, "_w8a8_linear",
                        lambda x, *a, gated=False: calls.append(("w8a8", x.shape[0], gated)) or torch.zeros(x.shape[0], 16))
    monkeypatch.setattr(fp8_gemm.fused, "silu_mul", lambda x: x[:, : x.shape[1] // 2])
    for m in (1, 2, 3, 70):
        fp8_gemm.fp8_linear_silu_mul(torch.zeros(m, 512), w, ws, bn)
    # W8A8 rows: the quantization computes SiLU * up (gated), no silu_mul launch
    assert calls == [("gemv", 1, True), ("gemv", 2, True), ("w8a8", 3, True), ("w8a8", 70, True)]
    monkeypatch.setattr(fp8_gemm, "takes_w8a8", lambda m, n: m > 64)  # QSASERVE_FP8_DECODE_KERNEL=swap's rows
    fp8_gemm.fp8_linear_silu_mul(torch.zeros(3, 512), w, ws, bn)
    assert calls[-1] == ("linear", 3)  # W8A16 past the GEMV's rows: silu_mul, then the linear
