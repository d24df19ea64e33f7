"""Fused decoder kernels (ops/fused/triton_fused.py) against their torch references.

The same checks run on CPU under the Triton interpreter (a subprocess with TRITON_INTERPRET=1,
which must be set before triton is imported; fp16 and fp32, since the interpreter's bf16 is not
trustworthy) and on a CUDA GPU (marked gpu; bf16, fp16, fp32, plus the llama-1b / llama-8b shapes).

Tolerances: the new residual is bit-equal (one rounding of an exact fp32 sum, like the torch add);
the other outputs may differ from the reference by the last bit of the output dtype (the fp32 sum
of squares is reduced in another order, exp/rsqrt/fma differ in their last fp32 bits), so they
are compared with rtol = 2 ulp of the dtype (1e-5 in fp32).
"""
from __future__ import annotations

import os

import pytest
import torch

from qsaserve.layers.rotary import RotaryEmbedding
from triton_interpreter import run_under_interpreter
from qsaserve.ops import dispatch
from qsaserve.ops.fused.reference import (add_rms_norm_reference, rms_norm_reference, rope_qk_reference_,
                                          silu_mul_reference)


def _tol(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:  # a few fp32 ulps: approximate rsqrt/exp, fma, reduction order
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-3)


def check_rms_norm(device, dtype, rows=5, dim=72, heads=3, head_dim=40):
    from qsaserve.ops.fused import triton_fused as tf

    gen = torch.Generator().manual_seed(dim + rows)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype).to(device)
    res = torch.randn(rows, dim, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype).to(device)
    x_in, res_in = x.clone(), res.clone()
    torch.testing.assert_close(tf.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), **_tol(dtype))
    out, new_res = tf.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = add_rms_norm_reference(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    assert torch.equal(x, x_in) and torch.equal(res, res_in)  # inputs are not overwritten
    # Per-head norm of q inside a wider qkv row (Qwen3 q_norm): a strided 3-D view, no copy needed.
    qkv = torch.randn(rows, heads * head_dim + 17, generator=gen).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    wq = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype).to(device)
    got = tf.rms_norm(q, wq, 1e-6)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm_reference(q, wq, 1e-6), **_tol(dtype))
    # A strided 2-D x (a column slice) with a contiguous residual.
    wide = torch.randn(rows, dim + 8, generator=gen).to(dtype).to(device)[:, 4 : 4 + dim]
    out, new_res = tf.add_rms_norm(wide, res, w, 1e-6)
    ref_out, ref_res = add_rms_norm_reference(wide, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    with pytest.raises(ValueError, match="weight"):
        tf.rms_norm(x, w[:-1], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        tf.add_rms_norm(x, res[:-1], w, 1e-6)


def check_rope(device, dtype, tokens=7, hq=6, hk=2, head_dim=32, rotary_dim=32, max_pos=5000):
    from qsaserve.ops.fused import triton_fused as tf

    gen = torch.Generator().manual_seed(hq * head_dim + rotary_dim)
    rope = RotaryEmbedding(rotary_dim, max_pos, 500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    cos, sin = rope.cos.to(device), rope.sin.to(device)
    qs, ks = hq * head_dim, hk * head_dim
    qkv = (torch.randn(tokens, qs + 2 * ks, generator=gen) * 2).to(dtype).to(device)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    positions[0] = 0
    positions[-1] = max_pos - 1
    ref, orig = qkv.clone(), qkv.clone()
    q, k = qkv[:, :qs].view(tokens, hq, head_dim), qkv[:, qs : qs + ks].view(tokens, hk, head_dim)
    rq, rk = ref[:, :qs].view(tokens, hq, head_dim), ref[:, qs : qs + ks].view(tokens, hk, head_dim)
    got_q, got_k = tf.rope_qk_(q, k, positions, cos, sin)
    rope_qk_reference_(rq, rk, positions, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(qkv[:, qs + ks :], ref[:, qs + ks :])  # v untouched
    assert torch.equal(q[..., rotary_dim:], rq[..., rotary_dim:])  # channels past rotary_dim untouched
    torch.testing.assert_close(qkv, ref, **_tol(dtype))
    # The layer's CPU path (out of place) is the in-place reference, bit for bit.
    lq, lk = rope.rotate_qk(positions.cpu(), orig[:, :qs].view(tokens, hq, head_dim).cpu(),
                            orig[:, qs : qs + ks].view(tokens, hk, head_dim).cpu())
    assert torch.equal(lq, rq.cpu()) and torch.equal(lk, rk.cpu())
    with pytest.raises(ValueError, match="positions"):
        tf.rope_qk_(q, k, positions[:-1], cos, sin)
    with pytest.raises(ValueError, match="q, k"):
        tf.rope_qk_(q, k[:-1], positions, cos, sin)


def check_silu_mul(device, dtype, tokens=3, inter=1500):
    from qsaserve.ops.fused import triton_fused as tf

    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(tokens, 2 * inter + 6, generator=gen) * 4).to(dtype).to(device)[:, 3 : 3 + 2 * inter]
    got = tf.silu_mul(x)
    assert got.shape == (tokens, inter) and got.is_contiguous()
    torch.testing.assert_close(got, silu_mul_reference(x), **_tol(dtype))
    with pytest.raises(ValueError, match="x"):
        tf.silu_mul(x[:, :-1])


def check_norm_rope_heads(device, dtype, tokens=4, heads=3, head_dim=48, rot=24):
    """Qwen4Exp's per-head q/k path (1-centred RMSNorm then partial RoPE) from a strided view (q
    slices of the fused q|gate projection), against norm_rope_heads_reference."""
    from qsaserve.ops.fused import triton_fused as tf
    from qsaserve.ops.fused.reference import norm_rope_heads_reference
    from qsaserve.ops.qsa_indexer.reference import rope_cos_sin, rope_inv_freq

    gen = torch.Generator().manual_seed(head_dim + rot)
    qg = (torch.randn(tokens, heads, 2 * head_dim, generator=gen) * 3).to(dtype)
    x = qg[..., :head_dim]  # a strided view, as the model passes it
    w = (torch.randn(head_dim, generator=gen) * 0.2).to(dtype)
    inv = rope_inv_freq(head_dim, rot / head_dim, 10000.0)
    cos, sin = rope_cos_sin(torch.tensor([0, 5, 77, 4000][:tokens]), inv, dtype)
    want = norm_rope_heads_reference(x, w, cos, sin, 1e-6)
    got = tf.norm_rope_heads(x.to(device), w.to(device), cos.to(device), sin.to(device), 1e-6).cpu()
    tol = _tol(dtype)
    if dtype != torch.float32:
        # The GPU's rsqrt can move a normed value (RMS ~1) by one ulp; the RoPE sum of two rounded
        # products then differs by that ulp even where the sum cancels to near zero.
        tol["atol"] = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, **tol)


def check_grouped_rms_norm(device, dtype, rows=3, groups=4, group=48):
    """Qwen4Exp's grouped 1-centred RMSNorm (the PLE layer's norms) against its torch reference."""
    from qsaserve.ops.fused.reference import one_centred_rms_norm_reference as rms_norm
    from qsaserve.ops.fused import triton_fused as tf

    gen = torch.Generator().manual_seed(groups * group)
    x = (torch.randn(rows, 2, groups * group, generator=gen) * 3).to(dtype)
    w = (torch.randn(groups * group, generator=gen) * 0.2).to(dtype)
    want = rms_norm(x, w, 1e-6, group)  # CPU tensors: the torch path
    got = tf.grouped_rms_norm(x.to(device), w.to(device), 1e-6, group).cpu()
    torch.testing.assert_close(got, want, **_tol(dtype))


def check_sigmoid_gated_add(device, dtype, rows=3, cols=300):
    """x + sigmoid(gate) * y with the gate a column of a wider tensor (as the fused MoE GEMM gives it)."""
    from qsaserve.ops.fused import triton_fused as tf
    from qsaserve.ops.fused.reference import sigmoid_gated_add_reference

    gen = torch.Generator().manual_seed(cols)
    x, y = (torch.randn(rows, cols, generator=gen) * 2).to(dtype), torch.randn(rows, cols, generator=gen).to(dtype)
    wide = (torch.randn(rows, 5, generator=gen) * 3).to(dtype)
    gate = wide[:, 2:3]
    got = tf.sigmoid_gated_add(x.to(device), y.to(device), gate.to(device)).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, sigmoid_gated_add_reference(x, y, gate), **_tol(dtype))
        return
    # The kernel rounds once, the torch reference after each op, so near-cancelling sums differ by
    # more than one ulp of the result. Hold the kernel to the fp32 answer: one rounding of a value
    # no larger than |x| + |y|.
    want = sigmoid_gated_add_reference(x.float(), y.float(), gate.float())
    bound = torch.finfo(dtype).eps * (x.float().abs() + y.float().abs()) + 1e-6
    assert ((got.float() - want).abs() <= bound).all(), (got.float() - want).abs().max()


def check_head_rotate_qk(device, dtype, tokens=3, hq=5, hk=2, head_dim=32):
    """q and k rotated in place inside one qkv-like buffer (v untouched) against rotate_heads."""
    from qsaserve.ops.fused import triton_fused as tf
    from qsaserve.quant.kv_rotation import hadamard_matrix, rotate_heads

    gen = torch.Generator().manual_seed(hq * head_dim + tokens)
    qkv = (torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen) * 3).to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    rot = hadamard_matrix(head_dim)
    want_q, want_k = rotate_heads(q, rot), rotate_heads(k, rot)
    buf = qkv.to(device)
    got_q, got_k = tf.head_rotate_qk_(buf[:, : hq * head_dim].view(tokens, hq, head_dim),
                                      buf[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim),
                                      rot.to(device))
    assert got_q.data_ptr() == buf.data_ptr()  # in place
    # One rounding of a float32 sum of D products on both sides, summed in another order.
    torch.testing.assert_close(buf[:, : hq * head_dim].cpu().view_as(want_q), want_q, **_tol(dtype))
    torch.testing.assert_close(buf[:, hq * head_dim : (hq + hk) * head_dim].cpu().view_as(want_k), want_k, **_tol(dtype))
    torch.testing.assert_close(buf[:, (hq + hk) * head_dim :].cpu(), qkv[:, (hq + hk) * head_dim :], rtol=0, atol=0)
    # Rotating twice is the identity (H is symmetric and orthogonal).
    tf.head_rotate_qk_(got_q, got_k, rot.to(device))
    # Each pass rounds every element once; H keeps the error vector's norm, so an element near
    # zero can carry its neighbours' rounding: a few ulps of the largest element, plus the float32
    # sums of head_dim products (observed on an H200 at D = 64: 7.6e-6 where 4 ulps gave 6.4e-6).
    scale = qkv.float().abs().max().item()
    bound = 4 * scale * (torch.finfo(dtype).eps + head_dim**0.5 * torch.finfo(torch.float32).eps)
    torch.testing.assert_close(buf.cpu().float(), qkv.float(), rtol=0, atol=bound)


def check_head_transform_qk(device, dtype, tokens=3, hq=6, hk=2, head_dim=32, shared_q=False):
    """q and k multiplied in place by a matrix per KV head (q heads by their group's) inside one
    qkv-like buffer, against transform_heads; v untouched."""
    from qsaserve.ops.fused import triton_fused as tf
    from qsaserve.quant.kv_rotation import transform_heads

    gen = torch.Generator().manual_seed(hq * head_dim + tokens + 1)
    qkv = (torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen) * 3).to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    k_mats = torch.randn(hk, head_dim, head_dim, generator=gen) / head_dim**0.5
    q_mats = torch.randn(head_dim, head_dim, generator=gen) / head_dim**0.5 if shared_q else \
        torch.randn(hk, head_dim, head_dim, generator=gen) / head_dim**0.5
    want_q, want_k = transform_heads(q, q_mats), transform_heads(k, k_mats)
    buf = qkv.to(device)
    got_q, _ = tf.head_transform_qk_(buf[:, : hq * head_dim].view(tokens, hq, head_dim),
                                     buf[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim),
                                     q_mats.to(device), k_mats.to(device))
    assert got_q.data_ptr() == buf.data_ptr()  # in place
    torch.testing.assert_close(buf[:, : hq * head_dim].cpu().view_as(want_q), want_q, **_tol(dtype))
    torch.testing.assert_close(buf[:, hq * head_dim : (hq + hk) * head_dim].cpu().view_as(want_k), want_k, **_tol(dtype))
    torch.testing.assert_close(buf[:, (hq + hk) * head_dim :].cpu(), qkv[:, (hq + hk) * head_dim :], rtol=0, atol=0)


INTERPRETER_CHECKS = [
    ("head_transform_qk_fp32", lambda: check_head_transform_qk("cpu", torch.float32)),
    ("head_transform_qk_fp16_tokens_past_a_block", lambda: check_head_transform_qk("cpu", torch.float16, tokens=19,
                                                                                   hq=4, hk=4, head_dim=16,
                                                                                   shared_q=True)),
    ("head_rotate_qk_fp32", lambda: check_head_rotate_qk("cpu", torch.float32)),
    ("head_rotate_qk_fp16_many_heads", lambda: check_head_rotate_qk("cpu", torch.float16, tokens=2, hq=20, hk=17,
                                                                    head_dim=16)),
    ("sigmoid_gated_add_fp32", lambda: check_sigmoid_gated_add("cpu", torch.float32)),
    ("grouped_rms_norm_fp32", lambda: check_grouped_rms_norm("cpu", torch.float32)),
    ("norm_rope_heads_fp32", lambda: check_norm_rope_heads("cpu", torch.float32)),
    ("norm_rope_heads_full_rotary", lambda: check_norm_rope_heads("cpu", torch.float32, head_dim=32, rot=32)),
    ("rms_norm_fp32", lambda: check_rms_norm("cpu", torch.float32)),
    ("rms_norm_fp16", lambda: check_rms_norm("cpu", torch.float16)),
    ("rope_fp32", lambda: check_rope("cpu", torch.float32)),
    ("rope_fp16_partial_rotary", lambda: check_rope("cpu", torch.float16, hq=5, hk=1, head_dim=48, rotary_dim=24)),
    ("rope_fp16_head_blocks", lambda: check_rope("cpu", torch.float16, tokens=2, hq=80, hk=8, head_dim=128,
                                                 rotary_dim=128)),
    ("silu_mul_fp32", lambda: check_silu_mul("cpu", torch.float32)),
    ("silu_mul_fp16", lambda: check_silu_mul("cpu", torch.float16)),
]


def run_interpreter_checks() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for name, fn in INTERPRETER_CHECKS:
        fn()
        print("ok", name, flush=True)


def test_kernels_match_references_under_triton_interpreter():
    out = run_under_interpreter(__file__, "t.run_interpreter_checks()", timeout=300)
    assert out.count("ok ") == len(INTERPRETER_CHECKS)


def test_cpu_tensors_take_the_torch_path():
    assert not dispatch.use_triton(torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_rms_norm_on_gpu(dtype):
    check_grouped_rms_norm("cuda", dtype)
    check_grouped_rms_norm("cuda", dtype, rows=4, groups=4, group=2048)  # qwen4exp-small's PLE norms


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sigmoid_gated_add_on_gpu(dtype):
    check_sigmoid_gated_add("cuda", dtype)
    check_sigmoid_gated_add("cuda", dtype, rows=4, cols=2048)  # qwen4exp-small hidden


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_rope_heads_on_gpu(dtype):
    check_norm_rope_heads("cuda", dtype)
    check_norm_rope_heads("cuda", dtype, tokens=4, heads=16, head_dim=256, rot=64)  # qwen4exp-small q
    check_norm_rope_heads("cuda", dtype, tokens=4, heads=16, head_dim=128, rot=64)  # its indexer q


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_on_gpu(dtype):
    check_rms_norm("cuda", dtype)
    check_rms_norm("cuda", dtype, rows=33, dim=2048, heads=8, head_dim=128)  # llama-1b hidden, Qwen3 heads
    check_rms_norm("cuda", dtype, rows=4, dim=4096)  # llama-8b hidden


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_on_gpu(dtype):
    check_rope("cuda", dtype)
    check_rope("cuda", dtype, tokens=65, hq=32, hk=8, head_dim=64, rotary_dim=64)  # llama-1b
    check_rope("cuda", dtype, tokens=9, hq=128, hk=8, head_dim=128, rotary_dim=128)  # several head blocks
    check_rope("cuda", dtype, hq=5, hk=1, head_dim=48, rotary_dim=24)  # partial rotary


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("check", [check_head_rotate_qk, check_head_transform_qk], ids=["rotate", "per_head_transform"])
def test_head_rotate_and_transform_qk_on_gpu(check, dtype):
    check("cuda", dtype)
    check("cuda", dtype, tokens=33, hq=32, hk=8, head_dim=64)  # llama-1b
    check("cuda", dtype, tokens=5, hq=32, hk=8, head_dim=128)  # llama-8b
    check("cuda", dtype, tokens=1, hq=9, hk=3, head_dim=64)  # SmolLM2, decode


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_mul_on_gpu(dtype):
    check_silu_mul("cuda", dtype)
    check_silu_mul("cuda", dtype, tokens=17, inter=8192)  # llama-1b


if __name__ == "__main__":
    run_interpreter_checks()
