"""The FP8 GEMV whose epilogue adds the residual and prepares the next RMSNorm
(ops/fp8_gemm/triton_gemv_joined.fp8_gemv_residual_triton) and the GEMV after that norm
(fp8_prenormed_gemv_triton), under the Triton interpreter (then compiled for sm_90) and on a GPU,
against the W8A16 reference then ops.fused's residual add and RMSNorm: 1-2 rows, plain and gated
(SiLU(gate) * up) input, block-128 / per-channel / per-tensor scales and a block_n that does not
divide the tile (48), N and K not multiples of the tile, partial sums over more programs than one
PART_BLOCK; the dispatch (ops.fp8_gemm.joins_residual, fp8_linear_prenormed's fallback) and the
Llama decoder's use of it (greedy tokens of the joined path equal the unjoined one)."""
import pytest
import torch
from test_fp8_gemv_triton import _weight
from triton_interpreter import triton_check_tests

from qsaserve.ops.fp8_gemm import reference as ref
from qsaserve.ops.fused.reference import rms_norm_reference, silu_mul_reference

EPS = 1e-5


def _check(device, m, n, k, kind, dtype, gated=False, consumer_n=24, **tiles):
    from qsaserve.ops.fp8_gemm.triton_gemv_joined import fp8_gemv_residual_triton, fp8_prenormed_gemv_triton

    gen = torch.Generator().manual_seed(m * 23 + n + k + gated)
    w, ws, bn = _weight(n, k, kind, gen)
    x = (torch.randn(m, 2 * k if gated else k, generator=gen) * 2).to(dtype)
    res = torch.randn(m, n, generator=gen).to(dtype)
    g = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    w2, ws2, bn2 = _weight(consumer_n, n, kind, gen)
    dev = [t.to(device) for t in (x, w, ws, res, g, w2, ws2)]
    h, hg, partials = fp8_gemv_residual_triton(dev[0], dev[1], dev[2], bn, dev[3], dev[4], gated=gated, **tiles)
    y = fp8_prenormed_gemv_triton(hg, partials, EPS, dev[5], dev[6], bn2, **tiles)
    # (on CPU bf16 is launched for the sm_90 compile check only: the interpreter truncates bf16 casts)
    if dtype != torch.float32 and device == "cpu":
        return
    inp = silu_mul_reference(x) if gated else x
    want_h = (ref.fp8_w8a16_gemm_reference(inp, w, ws, bn).float() + res.float()).to(dtype)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(h.cpu(), want_h, **tol)
    hf = h.cpu().float()  # the rest from the kernel's own h: one bf16 step of h must not fail hg
    assert torch.equal(hg.cpu(), (hf * g.float()).to(dtype))
    torch.testing.assert_close(partials.cpu()[:, :m].sum(0), hf.pow(2).sum(-1), rtol=1e-5, atol=1e-5)
    assert partials.shape[1] == 4
    want_y = ref.fp8_w8a16_gemm_reference(rms_norm_reference(hf, g.float(), EPS), w2, ws2, bn2)
    assert y.shape == (m, consumer_n) and y.dtype == dtype
    torch.testing.assert_close(y.cpu().float(), want_y.float(), **tol)


def _check_rope_kv(device, m, hq, hkv, d, dtype, slots, **tiles):
    """The prenormed GEMV of a q | k | v projection with RoPE and the KV write joined, against the
    prenormed reference, ops.fused's rope reference and write_kv's reference into a page pool."""
    from qsaserve.ops.attention.reference import write_kv_reference
    from qsaserve.ops.fp8_gemm.triton_gemv_joined import fp8_prenormed_rope_kv_triton
    from qsaserve.ops.fused.reference import rope_reference

    gen = torch.Generator().manual_seed(m * 31 + hq + d)
    k_in, n = 192, (hq + 2 * hkv) * d
    w, ws, bn = _weight(n, k_in, "block", gen)
    hg = torch.randn(m, k_in, generator=gen).to(dtype)
    partials = torch.rand(5, 4, generator=gen) * k_in / 5
    positions = torch.tensor([3, 17][:m])
    freqs = torch.outer(torch.arange(32, dtype=torch.float32), torch.rand(d // 2, generator=gen))
    cos, sin = freqs.cos(), freqs.sin()
    cache = torch.randn(2, 4, 8, hkv, d, generator=gen).to(dtype)  # 4 pages of 8 slots
    slot_mapping = torch.tensor(slots[:m])
    dev = [t.to(device) for t in (hg, partials, w, ws, positions, cos, sin, cache.clone(), slot_mapping)]
    y = fp8_prenormed_rope_kv_triton(dev[0], dev[1], EPS, dev[2], dev[3], bn, hq, hkv, dev[4], dev[5], dev[6],
                                     dev[7], dev[8], **tiles)
    if dtype != torch.float32 and device == "cpu":
        return
    inv_rms = torch.rsqrt(partials[:, :m].sum(0) / k_in + EPS)
    plain = (ref.fp8_w8a16_gemm_reference(hg.float(), w, ws, bn) * inv_rms[:, None]).to(dtype)
    q, kk, v = plain.view(m, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    want = torch.cat([rope_reference(q, positions, cos, sin), rope_reference(kk, positions, cos, sin), v], 1)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(y.cpu().view(m, -1, d), want, **tol)
    want_cache = cache.clone()
    keep = slot_mapping >= 0  # (the reference takes real slots only)
    write_kv_reference(want[keep, hq:hq + hkv], want[keep, hq + hkv:], want_cache, slot_mapping[keep])
    torch.testing.assert_close(dev[7].cpu(), want_cache, **tol)  # untouched where the slot is -1


def _triton_checks(device):
    for kind in ("block", "channel", "tensor", "block48"):
        for m in (1, 2):
            # N = 200 (the consumer's K): a ragged last row block and group; K = 320 a ragged last tile
            _check(device, m, 200, 320, kind, torch.float32, block_n_tile=16, block_k=256)
            _check(device, m, 200, 320, kind, torch.float32, gated=True, block_n_tile=8, block_k=128)
    # 300 producer programs: the partial sums take two PART_BLOCKs
    _check(device, 1, 1200, 256, "block", torch.float32, block_n_tile=4, block_k=128)
    for m in (1, 2):
        for gated in (False, True):
            _check(device, m, 72, 320, "block", torch.bfloat16, gated=gated, block_n_tile=8, block_k=128)
    for m, slots in ((1, [13]), (2, [5, 30]), (2, [-1, 9])):  # slot -1: a padded row, not written
        _check_rope_kv(device, m, 4, 2, 32, torch.float32, slots, block_n_tile=8, block_k=128)
    _check_rope_kv(device, 2, 3, 1, 64, torch.float32, [0, 31], block_n_tile=16, block_k=128)
    _check_rope_kv(device, 2, 2, 1, 24, torch.float32, [4, 12], block_k=128)  # D / 2 = 12: the default tile halves
    for m, (bn, warps) in ((1, (8, 2)), (2, (16, 4))):  # llama-8b's tiles, head_dim 128 (sm_90 compile check)
        _check_rope_kv(device, m, 4, 2, 128, torch.bfloat16, [2, 11], block_n_tile=bn, num_warps=warps)
    if device == "cpu":  # llama-8b's tiles (pick_gemv_tile on 132 SMs), K kept small: the sm_90 compile check
        for m, (bn, bk, warps) in ((1, (8, 1024, 2)), (2, (8, 1024, 2)), (2, (16, 512, 4))):
            for gated in (False, True):
                _check(device, m, 48, 2048, "block", torch.bfloat16, gated=gated, block_n_tile=bn, block_k=bk,
                       num_warps=warps)
    if device == "cuda":  # llama-8b's o -> gate_up and down -> qkv at the default tiles, its qkv with RoPE and KV
        for m in (1, 2):
            _check_rope_kv(device, m, 32, 8, 128, torch.bfloat16, [7, 20])
        for m in (1, 2):
            _check(device, m, 4096, 4096, "block", torch.bfloat16, consumer_n=28672)
            _check(device, m, 4096, 14336, "block", torch.bfloat16, gated=True, consumer_n=6144)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_rejects_bad_arguments():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.fp8_gemm.triton_gemv_joined import fp8_gemv_residual_triton, fp8_prenormed_gemv_triton

    w, ws, bn = _weight(16, 256, "block", torch.Generator().manual_seed(0))
    x = torch.zeros(1, 256)
    with pytest.raises(ValueError, match="residual"):
        fp8_gemv_residual_triton(x, w, ws, bn, torch.zeros(1, 8), torch.ones(16))
    with pytest.raises(ValueError, match="norm_weight"):
        fp8_gemv_residual_triton(x, w, ws, bn, torch.zeros(1, 16), torch.ones(8))
    with pytest.raises(ValueError, match="1-2 rows"):
        fp8_gemv_residual_triton(torch.zeros(3, 256), w, ws, bn, torch.zeros(3, 16), torch.ones(16))
    with pytest.raises(ValueError, match="gated"):
        fp8_gemv_residual_triton(x, w, ws, bn, torch.zeros(1, 16), torch.ones(16), gated=True)
    with pytest.raises(ValueError, match="partials"):
        fp8_prenormed_gemv_triton(x, torch.zeros(4, 2), EPS, w, ws, bn)


def test_dispatch_joins_the_residual_at_the_gemv_rows_only(monkeypatch):
    """joins_residual: CUDA (faked), 1-2 rows on the GEMV (a wide weight's 2 rows take W8A8), no
    bias, a residual of the output's shape and dtype; fp8_linear_prenormed takes the prenormed
    GEMV there and fp8_linear_rms_norm of h elsewhere (on CPU the reference's result)."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    import qsaserve.ops.fp8_gemm as fp8_gemm

    w = torch.zeros(16, 256, dtype=fp8_gemm.FP8)
    wide = torch.zeros(fp8_gemm.W8A8_DECODE_MIN_N, 256, dtype=fp8_gemm.FP8)
    x, res = torch.zeros(1, 256), torch.zeros(1, 16)
    assert not fp8_gemm.joins_residual(x, w, res)  # CPU
    monkeypatch.setattr(fp8_gemm, "use_triton", lambda t: True)
    assert fp8_gemm.joins_residual(x, w, res)
    assert fp8_gemm.joins_residual(torch.zeros(2, 256), w, torch.zeros(2, 16))
    assert not fp8_gemm.joins_residual(torch.zeros(3, 256), w, torch.zeros(3, 16))
    assert not fp8_gemm.joins_residual(torch.zeros(2, 256), wide, torch.zeros(2, wide.shape[0]))
    assert not fp8_gemm.joins_residual(x, w, None)
    assert not fp8_gemm.joins_residual(x, w, res, bias=torch.zeros(16))
    assert not fp8_gemm.joins_residual(x, w, res.to(torch.bfloat16))
    assert not fp8_gemm.joins_residual(x, w, torch.zeros(1, 8))
    calls = []
    monkeypatch.setattr(fp8_gemm.triton_gemv_joined, "fp8_prenormed_gemv_triton",
                        lambda hg, *a: calls.append(("prenormed", hg.shape[0])) or hg[:, :16])
    monkeypatch.setattr(fp8_gemm, "fp8_linear_rms_norm", lambda x, r, *a: calls.append(("norm_linear", x.shape[0], r))
                        or (x[:, :16], x))
    for m, weight in ((1, w), (2, w), (2, wide)):
        h = torch.zeros(m, 256)
        fp8_gemm.fp8_linear_prenormed(fp8_gemm.SummedResidual(h, h, torch.zeros(1, 4), torch.ones(256)), EPS, weight,
                                      torch.ones(1, 2), 128)
    assert calls == [("prenormed", 1), ("prenormed", 2), ("norm_linear", 2, None)]


def test_fallback_of_the_prenormed_form_is_rms_norm_then_fp8_linear():
    """On CPU the prenormed form falls back to the norm of h, then fp8_linear."""
    from qsaserve.ops.fp8_gemm import SummedResidual, fp8_linear, fp8_linear_prenormed

    gen = torch.Generator().manual_seed(4)
    w, ws, bn = _weight(16, 256, "block", gen)
    h, g = torch.randn(3, 256, generator=gen), torch.rand(256, generator=gen) + 0.5
    got = fp8_linear_prenormed(SummedResidual(h, h * g, torch.zeros(1, 4), g), EPS, w, ws, bn)
    torch.testing.assert_close(got, fp8_linear(rms_norm_reference(h, g, EPS), w, ws, bn))


def run_interpreted_layer_check():
    """layers.linear's residual-joined chain with the FP8 kernels taken (under the interpreter):
    a down projection adding its output to the residual and preparing the next norm
    (linear_residual, gated), then the qkv projection after that norm (rms_norm_linear), equal to
    the same calls with the joined kernels refused (silu_mul_linear, then the RMSNorm-joined
    GEMV), at 1 and 2 rows; 3 rows do not join."""
    import qsaserve.ops.fp8_gemm as fp8_gemm
    from qsaserve.layers.linear import linear_residual, rms_norm_linear
    from qsaserve.layers.quantization import Fp8Linear, weight_quant_config
    from qsaserve.layers.quantization import fp8 as fp8_layer
    from qsaserve.layers.rmsnorm import RMSNorm

    fp8_gemm.use_triton = lambda x: True
    gen = torch.Generator().manual_seed(8)
    down = Fp8Linear(384, [256], False, weight_quant_config({}, "fp8"), "mlp.down_proj")
    qkv = Fp8Linear(256, [256, 128], False, weight_quant_config({}, "fp8"), "self_attn.q_proj")
    for layer in (down, qkv):
        w, ws = fp8_gemm.quantize_weight_block(torch.randn(layer.out_features, layer.in_features, generator=gen) * 0.1)
        layer.weight.data, layer.weight_scale.data = w, ws
    norm = RMSNorm(256, EPS)
    norm.weight.data = torch.rand(256, generator=gen) + 0.5
    for m in (1, 2, 3):
        gate_up, residual = torch.randn(m, 768, generator=gen), torch.randn(m, 256, generator=gen)
        out, res = linear_residual(gate_up, down, residual, norm, gated=True)
        assert isinstance(out, fp8_gemm.SummedResidual) == (m <= 2) and (res is None) == (m <= 2)
        got, got_res = rms_norm_linear(out, res, norm, qkv)
        joins = fp8_layer.joins_residual
        fp8_layer.joins_residual = lambda *a, **k: False
        try:
            plain, plain_res = linear_residual(gate_up, down, residual, norm, gated=True)
            assert plain_res is residual and not isinstance(plain, fp8_gemm.SummedResidual)
            want, want_res = rms_norm_linear(plain, plain_res, norm, qkv)
        finally:
            fp8_layer.joins_residual = joins
        torch.testing.assert_close(got_res, want_res, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    print("checked")


def test_layer_chain_under_triton_interpreter_equals_the_unjoined_calls():
    from triton_interpreter import run_under_interpreter

    assert "checked" in run_under_interpreter(__file__, "t.run_interpreted_layer_check()")


def test_layer_chain_refuses_a_summed_residual_made_for_another_norm():
    from qsaserve.layers.linear import rms_norm_linear
    from qsaserve.layers.rmsnorm import RMSNorm
    from qsaserve.ops.fp8_gemm import SummedResidual

    h = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="SummedResidual"):
        rms_norm_linear(SummedResidual(h, h, torch.zeros(1, 4), torch.ones(8)), None, RMSNorm(8, EPS),
                        torch.nn.Linear(8, 4))
