"""Triton paged attention vs the torch reference (GPU), plus CPU checks of import and planning.

Tolerance: the kernels take bf16/fp16 operands with fp32 accumulation and round P to the input
dtype before P@V, so we compare to the fp32 reference by relative Frobenius error
(bf16 < 1.5e-2, fp16 < 3e-3) and elementwise (atol = rtol = 4e-2 bf16, 8e-3 fp16).
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import subprocess
import tempfile

import pytest
import torch

from qsaserve.layers.attention import Attention, AttentionMetadata
from qsaserve.ops.attention.reference import paged_attention_reference, write_kv_reference

TOL = {torch.bfloat16: (1.5e-2, 4e-2), torch.float16: (3e-3, 8e-3), torch.float32: (1e-3, 5e-3)}


def make_case(specs, hq, hkv, d, page, dtype, device, seed=0, poison=None, extra_blocks=3):
    """specs: [(query_len, seq_len)]. Returns (q, k_new, v_new, kv_cache, meta): the cache holds
    every context token except the new ones (k_new/v_new, to be written). Unused cache space,
    null block 0 included, holds `poison` (NaN) or random garbage."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    nblk = [-(-s // page) for _, s in specs]
    num_blocks = 1 + sum(nblk) + extra_blocks
    shape = (2, num_blocks, page, hkv, d)
    if poison is None:
        cache = (torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)) * 3).to(dtype)
    else:
        cache = torch.full(shape, poison, dtype=dtype)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    max_blocks = max(nblk) + 2  # trailing null-block padding
    tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    slots_old, slots_new, k_old, v_old = [], [], [], []
    for i, (ql, sl) in enumerate(specs):
        blocks = [ids.pop() for _ in range(nblk[i])]
        tables[i, : nblk[i]] = torch.tensor(blocks, dtype=torch.int32)
        slots = [blocks[p // page] * page + p % page for p in range(sl)]
        slots_old += slots[: sl - ql]
        slots_new += slots[sl - ql:]
    n_old, n_new = len(slots_old), len(slots_new)
    k_old = torch.randn(n_old, hkv, d, generator=gen).to(dtype)
    v_old = torch.randn(n_old, hkv, d, generator=gen).to(dtype)
    write_kv_reference(k_old, v_old, cache, torch.tensor(slots_old, dtype=torch.int64))
    k_new = torch.randn(n_new, hkv, d, generator=gen).to(dtype)
    v_new = torch.randn(n_new, hkv, d, generator=gen).to(dtype)
    q = torch.randn(n_new, hq, d, generator=gen).to(dtype)
    qls = [ql for ql, _ in specs]
    sls = [sl for _, sl in specs]
    cu = torch.tensor([0] + list(torch.tensor(qls).cumsum(0).tolist()), dtype=torch.int32)
    fields = dict(
        slot_mapping=torch.tensor(slots_new, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(sls, dtype=torch.int32, device=device),
        cu_query_lens=cu.to(device),
        query_lens=qls,
        seq_lens_list=sls,
    )
    if "state_slots" in {f.name for f in dataclasses.fields(AttentionMetadata)}:
        fields["state_slots"] = list(range(len(specs)))
    meta = AttentionMetadata(**fields)
    return q.to(device), k_new.to(device), v_new.to(device), cache.to(device), meta


def reference(q, cache, meta, scale):
    return paged_attention_reference(q.float(), cache.float(), meta.block_tables, meta.query_lens, meta.seq_lens_list, scale)


def check_close(out, ref, dtype, what="", tol=None):
    """tol: (relative Frobenius, elementwise atol = rtol); default TOL[dtype]."""
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"non-finite output {what}"
    rel_tol, el_tol = tol or TOL[dtype]
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < rel_tol, f"relative error {rel:.2e} {what}"
    torch.testing.assert_close(out.float(), ref, atol=el_tol, rtol=el_tol, msg=lambda m: f"{what}: {m}")


def bind_cache(layer, cache):
    """Attach a per-layer KV tensor however the layer currently holds it."""
    from qsaserve.cache import kv_cache as kvc

    if hasattr(kvc, "LayerCache"):
        layer.cache = kvc.LayerCache(cache)
    else:
        layer.kv_cache = cache


def run_triton(q, k, v, cache, meta, scale, **kw):
    from qsaserve.ops.attention import kv_write, triton_paged as tp

    kv_write.write_kv(k, v, cache, meta.slot_mapping)
    return tp.paged_attention(q, cache, meta, scale, **kw)


def _decode_specs(rng, batch, max_ctx, qlen=1):
    return [(qlen, rng.randint(qlen, max_ctx)) for _ in range(batch)]


GRID = [(page, d, g) for page in (16, 32) for d in (64, 128) for g in (1, 4, 8)]


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hkv,d", [(1, 64), (8, 128), (3, 80)])
@pytest.mark.parametrize("page", [16, 32])
def test_write_kv(page, hkv, d, dtype):
    from qsaserve.ops.attention import kv_write

    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 40, page, hkv, d, generator=gen).to(dtype).cuda()
    t = 301
    # k/v as strided views of a fused projection, like the model hands them over.
    kv = torch.randn(t, 2 * hkv + 1, d, generator=gen).to(dtype).cuda()
    k, v = kv[:, :hkv], kv[:, hkv: 2 * hkv]
    slots = torch.randperm(39 * page, generator=gen)[:t] + page
    slots[::7] = -1  # padding tokens are skipped
    ref = cache.clone()
    keep = slots >= 0
    write_kv_reference(k[keep.cuda()], v[keep.cuda()], ref, slots[keep].cuda())
    kv_write.write_kv(k, v, cache, slots.cuda())
    assert torch.equal(cache, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page,d,g", GRID)
def test_decode(page, d, g):
    rng = random.Random(page * 1000 + d * 10 + g)
    hkv = 2
    cases = [
        (torch.bfloat16, [(1, 32768)]),  # batch 1, long context: many splits
        (torch.bfloat16, [(1, 1), (1, 17), (1, page), (1, page + 1), (1, 1000)]),  # unaligned
        (torch.bfloat16, _decode_specs(rng, 64, 200)),  # single split, written in place
        (torch.bfloat16, _decode_specs(rng, 64, 4096)),
        (torch.bfloat16, _decode_specs(rng, 8, 20000)),
        (torch.float16, _decode_specs(rng, 16, 3000)),
    ]
    for n, (dtype, specs) in enumerate(cases):
        q, k, v, cache, meta = make_case(specs, g * hkv, hkv, d, page, dtype, "cuda", seed=n, poison=float("nan"))
        scale = d**-0.5
        out = run_triton(q, k, v, cache, meta, scale)
        check_close(out, reference(q, cache, meta, scale), dtype, f"case {n}: {dtype} B={len(specs)}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("qlen", [2, 3, 8])
def test_decode_multi_token(g, qlen):
    """Speculative-decode verify: a few query tokens per sequence, still on the decode kernel."""
    from qsaserve.ops.attention import decode_triton

    assert qlen <= decode_triton.decode_qlen_cap(g)
    rng = random.Random(qlen * 10 + g)
    specs = _decode_specs(rng, 12, 9000, qlen) + [(qlen, qlen), (1, 5), (qlen, 30000)]
    q, k, v, cache, meta = make_case(specs, g * 2, 2, 128, 16, torch.bfloat16, "cuda", seed=qlen, poison=float("nan"))
    out = run_triton(q, k, v, cache, meta, 0.1)
    check_close(out, reference(q, cache, meta, 0.1), torch.bfloat16, f"qlen={qlen} g={g}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page,d,g", GRID)
def test_prefill(page, d, g):
    hkv = 2
    cases = [
        (torch.bfloat16, [(300, 300), (129, 129), (1000, 1000), (17, 17)]),  # fresh prefill, unaligned
        (torch.bfloat16, [(200, 5000), (1, 77), (513, 513), (64, 4096 + 3)]),  # cached prefix + a decode row
        (torch.bfloat16, [(1500, 32768)]),  # chunk at the end of a 32K context
        (torch.float16, [(700, 700), (333, 2000)]),
    ]
    for n, (dtype, specs) in enumerate(cases):
        q, k, v, cache, meta = make_case(specs, g * hkv, hkv, d, page, dtype, "cuda", seed=n, poison=float("nan"))
        scale = d**-0.5
        out = run_triton(q, k, v, cache, meta, scale)
        check_close(out, reference(q, cache, meta, scale), dtype, f"case {n}: {dtype} {specs}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_long_fresh():
    specs = [(4096, 4096), (3000, 3000)]
    q, k, v, cache, meta = make_case(specs, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=5)
    out = run_triton(q, k, v, cache, meta, 128**-0.5)
    check_close(out, reference(q, cache, meta, 128**-0.5), torch.bfloat16, "long prefill")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page", [16, 32])
def test_nan_poisoned_cache(page):
    """NaN in every unused cache byte (null block 0, free blocks, page tails) changes nothing."""
    specs = [(1, 1), (1, 4097), (3, 333), (250, 250), (100, 1030), (1, 65)]
    outs = []
    for poison in (None, float("nan")):
        q, k, v, cache, meta = make_case(specs, 16, 4, 128, page, torch.bfloat16, "cuda", seed=11, poison=poison)
        outs.append(run_triton(q, k, v, cache, meta, 0.09))
        # Also force many splits on the decode rows so the merge sees empty / short splits.
        from qsaserve.ops.attention import configs, decode_triton, triton_paged as tp

        plan = tp._plan(meta, 4, configs.prefill_config(128).block_m, q.device)
        out2 = outs[-1].clone()
        decode_triton.paged_decode(q, cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out2, 0.09,
                                   num_seqs=plan.num_decode, max_seq_len=plan.max_decode_len, qlen_max=plan.qlen_max,
                                   seq_ids=plan.decode_ids, num_splits=37)
        outs.append(out2)
    for o in outs:
        assert torch.isfinite(o).all()
    ref = reference(q, cache, meta, 0.09)
    check_close(outs[2], ref, torch.bfloat16, "poisoned")
    check_close(outs[3], ref, torch.bfloat16, "poisoned, 37 splits")
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_dispatches_to_triton(monkeypatch):
    from qsaserve.ops.attention import triton_paged as tp

    called = []
    real = tp.paged_attention
    monkeypatch.setattr(tp, "paged_attention", lambda *a, **k: called.append(1) or real(*a, **k))
    specs = [(1, 900), (40, 40)]
    q, k, v, cache, meta = make_case(specs, 8, 2, 64, 16, torch.bfloat16, "cuda", seed=3)
    layer = Attention(8, 2, 64, 0.125)
    bind_cache(layer, cache)
    out = layer(q.flatten(1), k.flatten(1), v.flatten(1), meta)
    assert called
    check_close(out.view(q.shape), reference(q, cache, meta, 0.125), torch.bfloat16, "layer")


# ----------------------------------------------------------------------------------------------
# CPU (CI)
# ----------------------------------------------------------------------------------------------
def test_cpu_layer_uses_reference():
    specs = [(1, 50), (7, 7)]
    q, k, v, cache, meta = make_case(specs, 4, 2, 16, 16, torch.float32, "cpu", seed=2, poison=float("nan"))
    layer = Attention(4, 2, 16, 0.25)
    bind_cache(layer, cache)
    out = layer(q.flatten(1), k.flatten(1), v.flatten(1), meta)
    assert torch.isfinite(out).all()
    check_close(out.view(q.shape), reference(q, cache, meta, 0.25), torch.float32, "cpu layer")


def test_triton_module_imports_without_cuda():
    pytest.importorskip("triton")
    from qsaserve.ops.attention import configs, triton_common, triton_paged as tp

    # Split heuristic: batch 1 at 256K and batch 256 at 2K both fill a 132-SM GPU.
    s = configs.num_decode_splits(pairs=1 * 8, max_len=262144, num_sms=132, block_n=64)
    assert s * 8 >= 132 * 2 * 0.9
    assert configs.num_decode_splits(pairs=256 * 8, max_len=2048, num_sms=132, block_n=64) == 1
    assert configs.num_decode_splits(pairs=8, max_len=100, num_sms=132, block_n=64) == 1
    # FP8's plan counts 0.95 of a wave as full: batch 8 x 8 KV heads at 128K, 4 programs per SM,
    # takes 8 splits (512 programs in 528 slots) where a whole wave would need 15 (1.8 waves).
    fp8 = configs.DECODE_CONFIG_FP8
    assert configs.num_decode_splits(64, 131072, 132, fp8.block_n, fp8.ctas_per_sm, fp8.min_waves) == 8
    assert configs.num_decode_splits(64, 131072, 132, fp8.block_n, fp8.ctas_per_sm) == 15
    plan = tp._make_plan([1, 300, 2, 1], [10, 300, 40, 7], group=4, block_m=128, device=torch.device("cpu"))
    assert plan.num_decode == 3 and plan.qlen_max == 2 and plan.max_decode_len == 40
    assert plan.decode_ids.tolist() == [0, 2, 3]
    assert plan.tiles.tolist() == [[1, 256], [1, 128], [1, 0]]
    assert math.isfinite(triton_common.LOG2E)


def test_decode_block_m_has_two_sizes_per_group():
    """The decode kernel's Q tile is the one-token tile while the rows fit, else the tile of the
    longest query it takes: varying multi-token rows cannot each compile the kernel again."""
    from qsaserve.ops.attention import decode_triton

    for group in (1, 2, 4, 8, 16, 32):
        cap = decode_triton.decode_qlen_cap(group)
        sizes = {decode_triton.decode_block_m(group, n) for n in range(1, cap + 1)}
        assert len(sizes) <= 2 and all(m >= group * 1 and m >= 16 for m in sizes)
        assert decode_triton.decode_block_m(group, 1) == max(16, group)
        assert decode_triton.decode_block_m(group, cap) >= group * cap  # every row of the longest query fits
    assert decode_triton.decode_block_m(4, 4) == 16 and decode_triton.decode_block_m(4, 5) == 64
    q = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="^qlen_max: the decode kernel takes queries of <= 16 tokens"):
        decode_triton.paged_decode(q, torch.zeros(2, 1, 16, 1, 16), None, None, None, q, 1.0, num_seqs=1, max_seq_len=1,
                                   qlen_max=17)


def test_kernels_compile_for_hopper():
    """Every kernel variant the engine launches (FP8 E4M3 / bf16 pages, K offset, split-KV merge
    with LSE, DCP shard positions, head_dim 80) compiles to an sm_90 cubin: the interpreter does
    not catch what only the compiler rejects. Needs Triton's NVIDIA backend (ptxas ships with it),
    not a GPU."""
    triton = pytest.importorskip("triton")
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qsaserve.ops.attention import decode_triton, kv_write, prefill_triton

    if "nvidia" not in backends:
        pytest.skip("Triton has no NVIDIA backend here")

    def build(fn, types, consts):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3})

    page_args = {"bt_ptr": "*i32", "seq_lens_ptr": "*i32", "key_lens_ptr": "*i32", "cu_q_ptr": "*i32",
                 "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    build(kv_write._write_kv_kernel, {"k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": "*fp8e4nv", "slot_ptr": "*i64",
                                "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "k_off_ptr": "*fp32"},
          dict(H=8, H_POW2=8, D=128, D_POW2=128, PAGE=16, IS_FP8=True, HAS_K_OFFSET=True))
    for fp8, single, dcp, f16, vg, asm in ((True, False, 2, True, 32, False), (True, True, 1, False, 0, False),
                                           (True, False, 1, True, 0, False), (True, False, 2, True, 32, True),
                                           (False, False, 1, False, 0, False)):
        build(decode_triton._decode_kernel, {**page_args, "q_ptr": "*bf16", "cache_ptr": "*fp8e4nv" if fp8 else "*bf16",
                                  "seq_ids_ptr": "*i32", "out_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"},
              dict(G=4, BLOCK_M=16, BLOCK_N=64, D=128, D_POW2=128, PAGE=16, HAS_SEQ_IDS=True,
                   SINGLE_SPLIT=single, IS_FP8=fp8, WRITE_LSE=dcp > 1, DCP_SIZE=dcp, DCP_I=8, F16_DOT=f16, V_GROUP=vg,
                   V_ASM=asm))
    build(decode_triton._merge_kernel, {"out_ptr": "*fp32", "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
                             "key_lens_ptr": "*i32", "cu_q_ptr": "*i32", "seq_ids_ptr": "*i32"},
          dict(S_POW2=128, S_BLOCK=16, D=128, BLOCK_D=64, HAS_SEQ_IDS=False, WRITE_LSE=True))
    build(prefill_triton._prefill_kernel, {**page_args, "q_ptr": "*bf16", "cache_ptr": "*fp8e4nv", "tiles_ptr": "*i32",
                               "out_ptr": "*fp32"},
          dict(G=4, BLOCK_M=128, BLOCK_N=64, D=80, D_POW2=128, PAGE=16, IS_FP8=True, WRITE_LSE=True, DCP_SIZE=2, DCP_I=1))


def _compile_fp8_decode_sm90(triton, decode_triton, cfg, block_m=16, dcp=False):
    """The FP8 decode kernel (d128, group 4) compiled for sm_90 as the launcher specializes it:
    data pointers and strides 16-byte aligned, metadata pointers and the do_not_specialize
    integers not. dcp: the partial form (fp32 out and LSE, two ranks)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = decode_triton._decode_kernel
    types = {"q_ptr": "*bf16", "cache_ptr": "*fp8e4nv", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "key_lens_ptr": "*i32",
             "cu_q_ptr": "*i32", "seq_ids_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             "out_ptr": "*fp32", "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
    consts = dict(G=4, BLOCK_M=block_m, BLOCK_N=cfg.block_n, D=128, D_POW2=128, PAGE=16, HAS_SEQ_IDS=False,
                  SINGLE_SPLIT=False, IS_FP8=True, WRITE_LSE=dcp, DCP_SIZE=2 if dcp else 1, DCP_I=1, F16_DOT=True,
                  V_GROUP=decode_triton._v_group(cfg, block_m, 128), V_ASM=cfg.fp8_v_convert == "asm")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if (n.startswith("stride_") or n.endswith("_ptr"))
               and n not in fn.do_not_specialize_on_alignment and n not in fn.do_not_specialize}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if decode_triton._maxnreg(cfg, block_m, 128):  # as paged_decode applies the cap
        options["maxnreg"] = decode_triton._maxnreg(cfg, block_m, 128)
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs=aligned), target=GPUTarget("cuda", 90, 32), options=options)
    return kernel, consts


def test_fp8_decode_sm90_code():
    """The sm_90 code of the default FP8 decode (d128, group 4, 16-byte-aligned strides as the
    launcher specializes them) is what makes it fast, and only the compiler shows it: E4M3 -> fp16
    by the native cvt (no bf16 round trip through f16/f32), V converted four bytes at a time by
    the inline asm, K and V tiles gathered with 16-byte async copies, and no byte-wise
    shared-memory reads of V (the head_dim permutation)."""
    triton = pytest.importorskip("triton")
    from triton.backends import backends

    from qsaserve.ops.attention import configs, decode_triton

    if "nvidia" not in backends:
        pytest.skip("Triton has no NVIDIA backend here")
    cfg = configs.DECODE_CONFIG_FP8
    kernel, consts = _compile_fp8_decode_sm90(triton, decode_triton, cfg)
    assert consts["V_GROUP"] > 0
    ptx = kernel.asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "cvt.bf16.f16" not in ptx and "cvt.f32.f16" not in ptx
    assert "ld.shared.b8" not in ptx and "ld.shared.u8" not in ptx
    # V's bytes reach the conversion as 32-bit words (fp8_v_convert "asm"): no per-pair 16-bit
    # shift-and-or assembly, which the compiler's own cast emits (64 of each per loop iteration).
    assert cfg.fp8_v_convert == "asm" and ptx.count("mov.b32 {lo, hi}") > 0
    assert "shl.b16" not in ptx and "or.b16" not in ptx
    # A K and a V tile of block_n x 128 bytes over 128 threads: block_n / 16 copies of 16 B per thread
    # per tile, in the loop and in the prologue; the only narrower copies are the 4-byte block-table
    # entries.
    sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", ptx)
    assert sizes.count("0x10") >= 2 * 2 * cfg.block_n // 16
    assert set(sizes) <= {"0x10", "0x4"}, sorted(set(sizes))  # block-table entries are async only when 3+ stages


@pytest.mark.parametrize("dcp, block_m", [(False, 16), (True, 16), (False, 64)])
def test_fp8_decode_programs_per_sm_fit(dcp, block_m):
    """The split plan assumes DECODE_CONFIG_FP8.ctas_per_sm programs resident per SM; the one-token
    Q tile's sm_90 build (plain and DCP partial form) must fit that many in the register file
    (registers per thread from ptxas, allocated per warp in units of 256) and in shared memory
    (228 KB per SM, 1 KB reserved per program). The old default planned 4 programs at 149-153
    registers a thread, of which 3 fit; the default now caps them at 128 for 4, which ptxas meets
    with at most a few bytes of spill. The 64-row tile of multi-token rows (2 programs per SM by
    its shared memory) is built without the cap, which would make it spill ~1.3 KB a thread."""
    triton = pytest.importorskip("triton")
    from triton.backends import backends

    from qsaserve.ops.attention import configs, decode_triton

    if "nvidia" not in backends:
        pytest.skip("Triton has no NVIDIA backend here")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.access(ptxas, os.X_OK):
        pytest.skip(f"no ptxas at {ptxas} to count registers")
    cfg = configs.DECODE_CONFIG_FP8
    kernel, _ = _compile_fp8_decode_sm90(triton, decode_triton, cfg, block_m=block_m, dcp=dcp)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as fh:
            fh.write(kernel.asm["ptx"])
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    report = info.stdout + info.stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    assert spill <= 64, (spill, regs, block_m)
    if block_m > 16:
        assert decode_triton._maxnreg(cfg, block_m, 128) is None
        return
    assert regs <= cfg.maxnreg, regs
    per_warp = -(-regs * 32 // 256) * 256
    assert cfg.ctas_per_sm * cfg.num_warps * per_warp <= 65536, (regs, cfg)
    assert cfg.ctas_per_sm * (kernel.metadata.shared + 1024) <= 228 * 1024, (kernel.metadata.shared, cfg)
