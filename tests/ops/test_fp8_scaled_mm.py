"""Prefill of block-FP8 weights through cuBLAS's block-scaled GEMM (ops/fp8_gemm/scaled_mm.py):
which shapes take it, that fp8_linear hands it the activations in its layout (rows a multiple of 4,
scales column-major) and drops the padding rows, decode rows never take it; on an sm_90 GPU the
GEMM against the reference at llama-8b's shapes and through fp8_linear at a ragged token count."""
import pytest
import torch

from qsaserve.ops.fp8_gemm import reference as ref
from qsaserve.ops.fused.reference import silu_mul_reference


def _weight(n, k, seed=0):
    return ref.quantize_weight_block(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5)


def test_takes_whole_128_blocks_with_k_blocks_a_multiple_of_4(monkeypatch):
    from qsaserve.ops.fp8_gemm import scaled_mm

    monkeypatch.setattr(scaled_mm, "available", lambda t: True)
    x = torch.zeros(1, 1, dtype=torch.bfloat16)
    w, s = _weight(256, 512)
    assert not scaled_mm.takes(x.float(), w, s, 128) and not scaled_mm.takes(x.half(), w, s, 128)  # bf16 only
    for (n, k), want in (((256, 512), True), ((256, 384), False), ((200, 512), False), ((6144, 4096), True)):
        w, s = _weight(n, k)
        assert scaled_mm.takes(x, w, s, 128) is want, (n, k)
    w, s = _weight(256, 512)
    assert not scaled_mm.takes(x, w, s, 64)  # not 128-row blocks
    assert not scaled_mm.takes(x, w, *ref.quantize_weight_rows(torch.randn(256, 512))[1:], 128)  # per-channel scales
    assert not scaled_mm.takes(x, w, s[:, :2], 128)  # a scale grid that is not the weight's
    monkeypatch.setattr(scaled_mm, "available", lambda t: False)
    assert not scaled_mm.takes(x, w, s, 128)


def test_not_available_on_cpu_nor_before_cuda_12_9(monkeypatch):
    from qsaserve.ops.fp8_gemm import scaled_mm

    assert not scaled_mm.available(torch.zeros(1))
    for version, want in (("12.8", False), ("12.9", True), ("13.0", True), (None, False)):
        monkeypatch.setattr(torch.version, "cuda", version)
        assert scaled_mm._cuda_at_least(12, 9) is want, version


def test_fp8_linear_hands_prefill_to_it_in_its_layout(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    import qsaserve.ops.fp8_gemm as fp8
    from qsaserve.ops.fp8_gemm import scaled_mm, triton_quant

    calls = []

    def quant(x, rows_multiple=1, scale_column_major=False, gated=False):  # the kernel's contract, in torch
        x = silu_mul_reference(x) if gated else x
        q, s = ref.per_token_group_quant_reference(x)
        rows = -(-x.shape[0] // rows_multiple) * rows_multiple
        q = torch.cat([q, torch.zeros(rows - x.shape[0], x.shape[1], dtype=q.dtype)])
        s = torch.cat([s, torch.ones(rows - x.shape[0], s.shape[1])])
        return q, (s.t().contiguous().t() if scale_column_major else s)

    def gemm(xq, xs, w, ws, out_dtype):
        assert xq.shape[0] % scaled_mm.ROWS_MULTIPLE == 0 and xs.stride(0) == 1
        calls.append(xq.shape[0])
        return ref.fp8_w8a8_gemm_reference(xq, xs, w, ws, 128, out_dtype)

    monkeypatch.setattr(fp8, "use_triton", lambda t: True)
    monkeypatch.setattr(scaled_mm, "available", lambda t: True)
    monkeypatch.setattr(triton_quant, "per_token_group_quant_triton", quant)
    monkeypatch.setattr(scaled_mm, "fp8_w8a8_gemm_scaled_mm", gemm)
    monkeypatch.setattr(fp8, "fp8_w8a16_gemm", lambda x, w, s, bn: ref.fp8_w8a16_gemm_reference(x, w, s, bn))

    def decode_gemm(xq, xs, w, ws, bn, out_dtype):  # the transposed W8A8 GEMM of decode rows
        calls.append(("decode", xq.shape[0]))
        return ref.fp8_w8a8_gemm_reference(xq, xs, w, ws, bn, out_dtype)

    monkeypatch.setattr(fp8.triton_w8a8_swap, "fp8_w8a8_swap_triton", decode_gemm)
    w, s = _weight(256, 512)  # a narrow weight: the transposed GEMM to 128 rows (takes_swap), cuBLAS above
    x = torch.randn(130, 512).to(torch.bfloat16)
    torch.testing.assert_close(fp8.fp8_linear(x, w, s, 128), ref.fp8_linear_reference(x, w, s, 128))
    assert calls == [132]  # 130 tokens padded to 132; the output has 130 rows
    torch.testing.assert_close(fp8.fp8_linear(x[:8], w, s, 128), ref.fp8_linear_reference(x[:8], w, s, 128))
    assert calls == [132, ("decode", 8)]  # decode rows keep the decode kernels
    # SiLU * up into the quantization, prefill and decode rows: what silu_mul then fp8_linear gives
    w2, s2 = _weight(256, 512, seed=1)
    gate_up = torch.randn(130, 1024).to(torch.bfloat16)
    for rows in (130, 8):
        torch.testing.assert_close(fp8.fp8_linear_silu_mul(gate_up[:rows], w2, s2, 128),
                                   ref.fp8_linear_reference(silu_mul_reference(gate_up[:rows]), w2, s2, 128))
    assert calls[2:] == [132, ("decode", 8)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_block_scaled_gemm_equals_the_reference_on_sm90():
    from qsaserve.ops.fp8_gemm import fp8_linear, scaled_mm
    from qsaserve.ops.fp8_gemm.triton_quant import per_token_group_quant_triton

    x0 = torch.zeros(1, device="cuda")
    if not scaled_mm.available(x0):
        pytest.skip("cuBLAS's block-scaled FP8 GEMM runs on sm_90 with torch >= 2.10 only")
    for m, (n, k) in ((512, (6144, 4096)), (72, (4096, 14336))):
        w, s = _weight(n, k, seed=m)
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
        xq, xs = per_token_group_quant_triton(x.cuda(), scaled_mm.ROWS_MULTIPLE, scale_column_major=True)
        got = scaled_mm.fp8_w8a8_gemm_scaled_mm(xq, xs, w.cuda(), s.cuda(), torch.bfloat16).float().cpu()
        want = ref.fp8_w8a8_gemm_reference(xq.cpu(), xs.cpu(), w, s, 128, torch.float32)
        # bf16 output: half a bf16 step of the largest, plus float32 sums in another order
        torch.testing.assert_close(got, want, rtol=2**-8, atol=want.abs().max().item() * 2**-9)
    w, s = _weight(256, 512)
    x = torch.randn(130, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert scaled_mm.takes(x.cuda(), w.cuda(), s.cuda(), 128)  # fp8_linear's path below is cuBLAS's (> 128 rows)
    got = fp8_linear(x.cuda(), w.cuda(), s.cuda(), 128).float().cpu()
    # on the GPU's quantized activations (its division may round a tie the other way than torch's)
    xq, xs = per_token_group_quant_triton(x.cuda())
    want = ref.fp8_w8a8_gemm_reference(xq.cpu(), xs.cpu(), w, s, 128, torch.float32)
    assert got.shape == (130, 256)
    torch.testing.assert_close(got, want, rtol=2**-8, atol=want.abs().max().item() * 2**-9)
