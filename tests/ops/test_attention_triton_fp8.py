"""Triton paged attention over FP8 E4M3 pages, the CUDA-graph contract and DCP partials (GPU).

Tolerances: the kernels dequantize E4M3 exactly, fold the per-tensor scales into the scores and
the output, accumulate in fp32 and keep fp32 split-KV partials. Against the fp32 reference reading
the *same* E4M3 pages:
- prefill, and decode with fp8_dot="query": q and P rounded to bf16 before the dots, the error of
  bf16 attention: relative Frobenius < 1.5e-2, elementwise atol = rtol = 4e-2
  (test_attention_triton.TOL);
- decode with fp8_dot="fp16" (the default): E4M3 -> fp16 is exact, q * scale and P are rounded to
  fp16 (2**-11, 4x finer than bf16), so the output's own rounding dominates: F16_DOT_TOL, bf16
  output (1 ulp = 2**-8 relative) relative Frobenius < 5e-3 and atol = rtol = 1e-2; fp16 output
  < 1e-3 and 2e-3. Range: q * scale * log2(e) * k_scale saturates at fp16's 65504 (never inf).
The quantize-on-write is bit-equal to the reference's. DCP LSE (base 2): atol 2e-2, rtol 2e-3
where finite, and -inf exactly where the reference has -inf.

The same properties run at small sizes in Triton's CPU interpreter
(test_attention_triton_interpret.py).
"""
from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

from qsaserve.cache.kv_cache import LayerCache
from qsaserve.layers.attention import Attention
from qsaserve.ops.attention.dcp_reference import paged_attention_partial as partial_reference
from qsaserve.ops.attention.reference import paged_attention_reference, write_kv_reference
from qsaserve.ops.qsa_attention.reference import merge_attention_partials
from qsaserve.parallel.dcp import DcpGeometry
from qsaserve.quant.fp8 import FP8_E4M3, quantize_fp8

from test_attention_triton import check_close, make_case

BF16 = torch.bfloat16
F16_DOT_TOL = {BF16: (5e-3, 1e-2), torch.float16: (1e-3, 2e-3)}
# benchmarks/fp8_decode_candidates.FP8_DECODE_CANDIDATES by name (collecting this file must not
# need triton; a CPU test checks the two lists agree).
FP8_CANDIDATES = ["bf16_dot_bn64", "f16_bn64_s3", "f16_bn128_s2", "f16_bn128_s2_c3", "f16_bn128_s3",
                  "f16_bn128_s3_c2", "f16_bn128_s4", "f16_bn128_s5", "f16_bn256_s2", "f16_bn256_s3",
                  "f16_bn128_s3_noperm", "f16_bn128_s3_w8", "f16_bn128_s3_r128", "f16_bn128_s4_r128", "f16_bn64_s3_r128",
                  "f16_bn128_s3_w2", "f16_bn128_s2_w2", "f16_bn64_s3_w2", "f16_bn128_s3_r128_asm"]
FP8_DEFAULT = "f16_bn128_s3_r128_asm"  # configs.DECODE_CONFIG_FP8
FP8_SHAPES = [(16, 128, 4, BF16), (16, 80, 2, BF16), (32, 64, 8, torch.float16)]
# The shipped config on every shape; the other candidates (timed by the benchmark, which also
# checks each agrees with the default) on the first.
FP8_CANDIDATE_CASES = [(name, *shape) for name in FP8_CANDIDATES for shape in FP8_SHAPES
                       if name == FP8_DEFAULT or shape == FP8_SHAPES[0]]


def fp8_decode_candidates() -> dict:
    """The FP8 decode candidates the benchmarks time (benchmarks/fp8_decode_candidates.py; the
    benchmarks folder is no package, so the file is loaded by path)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "fp8_decode_candidates.py")
    spec = importlib.util.spec_from_file_location("fp8_decode_candidates", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FP8_DECODE_CANDIDATES


def nan_bytes(shape, byte=0x7F, device="cpu"):
    """E4M3 NaN (0x7F, or 0xFF) in every byte."""
    return torch.full(shape, byte, dtype=torch.uint8, device=device).view(FP8_E4M3)


def fp8_case(specs, hq, hkv, d, page, seed, k_scale, v_scale, qdtype=BF16, device="cpu", poison=True):
    """make_case's layout with E4M3 pages: the context tokens quantized with the scales. poison:
    every unused byte (free blocks, page tails: 0x7F; null block 0: 0xFF) is an E4M3 NaN; else
    they hold finite garbage and the null block zeros. The new K/V (to be written) are fp32."""
    q, k, v, cache32, meta = make_case(specs, hq, hkv, d, page, torch.float32, device, seed=seed,
                                       poison=float("nan") if poison else None)
    k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    cache = torch.stack([quantize_fp8(cache32[0], k_scale), quantize_fp8(cache32[1], v_scale)])
    cache[:, 0] = nan_bytes(cache[:, 0].shape, 0xFF, device) if poison else 0
    return q.to(qdtype), k, v, cache, meta


def ref_fp8(q, cache, meta, scale, k_scale, v_scale):
    return paged_attention_reference(q.float(), cache, meta.block_tables, meta.query_lens, meta.seq_lens_list, scale,
                                     k_scale=k_scale, v_scale=v_scale)


def _scales(device="cuda"):
    return torch.tensor(0.021, device=device), torch.tensor(0.017, device=device)


# ----------------------------------------------------------------------------------------------
# FP8 write, decode, prefill
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hkv,d", [(1, 64), (8, 128), (3, 80)])
@pytest.mark.parametrize("with_offset", [False, True])
def test_write_kv_fp8_bit_equal(hkv, d, with_offset):
    """Quantize-on-write (x / scale, clamp +-448, round to nearest even; K minus its offset first)
    is bit-equal to the reference's, from strided bf16 views; slot -1 writes nothing."""
    from qsaserve.ops.attention import kv_write

    gen = torch.Generator().manual_seed(2)
    page, t = 16, 501
    cache = nan_bytes((2, 40, page, hkv, d), device="cuda")
    kv = (torch.randn(t, 2 * hkv + 1, d, generator=gen) * 8).to(BF16).cuda()  # strided views, like the model's
    k, v = kv[:, :hkv], kv[:, hkv: 2 * hkv]
    slots = torch.randperm(39 * page, generator=gen)[:t] + page
    slots[::7] = -1
    slots = slots.cuda()
    ks, vs = _scales()
    off = torch.randn(hkv, d, generator=gen).cuda() if with_offset else None
    ref = cache.clone()
    keep = slots >= 0
    kr = k[keep].float() - off if with_offset else k[keep]
    write_kv_reference(kr, v[keep], ref, slots[keep], ks, vs)
    kv_write.write_kv(k, v, cache, slots, ks, vs, k_offset=off)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page,d,g", [(16, 128, 4), (16, 64, 8), (32, 128, 1), (16, 80, 2)])
def test_fp8_decode_and_prefill(page, d, g):
    from qsaserve.ops.attention import kv_write, triton_paged as tp

    rng = random.Random(page + d + g)
    hkv = 2
    cases = [
        [(1, 32768)],  # batch 1, long context: many splits
        [(1, 1), (1, 17), (1, page), (1, page + 1), (1, 1000)],
        [(1, rng.randint(1, 4096)) for _ in range(64)],
        [(3, rng.randint(3, 9000)) for _ in range(8)],  # verify rows
        [(300, 300), (129, 129), (17, 17)],  # fresh prefill
        [(200, 5000), (1, 77), (513, 513), (64, 4099)],  # chunked prefill + a decode row
    ]
    ks, vs = _scales()
    for n, specs in enumerate(cases):
        q, k, v, cache, meta = fp8_case(specs, g * hkv, hkv, d, page, n, ks, vs, device="cuda")
        kv_write.write_kv(k.to(BF16), v.to(BF16), cache, meta.slot_mapping, ks, vs)
        out = tp.paged_attention(q, cache, meta, d**-0.5, k_scale=ks, v_scale=vs)
        check_close(out, ref_fp8(q, cache, meta, d**-0.5, ks, vs), BF16, f"fp8 case {n}: {specs[:4]}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page", [16, 32])
def test_fp8_nan_poisoned_pages_change_nothing(page):
    """E4M3 NaN bytes in the null block, free blocks and page tails: finite output, bit-equal to the
    run whose unused bytes are finite (single split and 37 forced splits)."""
    from qsaserve.ops.attention import configs, decode_triton, kv_write, triton_paged as tp

    specs = [(1, 1), (1, 4097), (3, 333), (250, 250), (100, 1030), (1, 65)]
    ks, vs = _scales()
    outs = []
    for poison in (False, True):
        q, k, v, cache, meta = fp8_case(specs, 16, 4, 128, page, 11, ks, vs, device="cuda", poison=poison)
        kv_write.write_kv(k.to(BF16), v.to(BF16), cache, meta.slot_mapping, ks, vs)
        out = tp.paged_attention(q, cache, meta, 0.09, k_scale=ks, v_scale=vs)
        plan = tp._plan(meta, 4, configs.prefill_config(128).block_m, q.device)
        split = out.clone()
        decode_triton.paged_decode(q, cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, split, 0.09,
                                   num_seqs=plan.num_decode, max_seq_len=plan.max_decode_len, qlen_max=plan.qlen_max,
                                   seq_ids=plan.decode_ids, num_splits=37, k_scale=ks, v_scale=vs)
        outs += [out, split]
    assert all(torch.isfinite(o).all() for o in outs)
    ref = ref_fp8(q, cache, meta, 0.09, ks, vs)
    check_close(outs[2], ref, BF16, "poisoned")
    check_close(outs[3], ref, BF16, "poisoned, 37 splits")
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def _decode(tp, q, cache, meta, scale, cfg, ks, vs, num_splits=None):
    from qsaserve.ops.attention import configs, decode_triton
    plan = tp._plan(meta, q.shape[1] // cache.shape[3], configs.prefill_config(q.shape[2]).block_m, q.device)
    assert plan.num_tiles == 0
    out = torch.full_like(q, float("nan"))
    return decode_triton.paged_decode(q, cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, scale,
                                      num_seqs=plan.num_decode, max_seq_len=plan.max_decode_len, qlen_max=plan.qlen_max,
                                      seq_ids=plan.decode_ids, config=cfg, num_splits=num_splits, k_scale=ks, v_scale=vs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,page,d,g,qdtype", FP8_CANDIDATE_CASES)
def test_fp8_decode_candidates(name, page, d, g, qdtype):
    """Each FP8 decode candidate the benchmark times equals the reference (F16_DOT_TOL for the
    fp16-dot ones): long single rows (many splits), many short rows, verify rows."""
    from qsaserve.ops.attention import kv_write, triton_paged as tp

    cfg = fp8_decode_candidates()[name]
    tol = F16_DOT_TOL[qdtype] if cfg.fp8_dot == "fp16" else None
    rng = random.Random(d + g)
    cases = [[(1, 65536), (1, 1), (1, 17), (1, 4097)], [(1, rng.randint(1, 4096)) for _ in range(64)],
             [(3, rng.randint(3, 9000)) for _ in range(8)]]
    ks, vs = _scales()
    for n, specs in enumerate(cases):
        q, k, v, cache, meta = fp8_case(specs, g * 2, 2, d, page, n, ks, vs, qdtype=qdtype, device="cuda")
        kv_write.write_kv(k.to(qdtype), v.to(qdtype), cache, meta.slot_mapping, ks, vs)
        ref = ref_fp8(q, cache, meta, d**-0.5, ks, vs)
        for splits in (None, 7):
            out = _decode(tp, q, cache, meta, d**-0.5, cfg, ks, vs, splits)
            check_close(out, ref, qdtype, f"{name} case {n} splits {splits}", tol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", FP8_CANDIDATES)
def test_fp8_nan_poisoned_pages_candidates(name):
    """Per candidate: E4M3 NaN bytes in the null block, free blocks and page tails change no bit of
    the decode output (auto splits and 37 forced splits), which stays finite and close to the
    reference."""
    from qsaserve.ops.attention import kv_write, triton_paged as tp

    cfg = fp8_decode_candidates()[name]
    specs = [(1, 1), (1, 4097), (3, 333), (1, 1030), (1, 65), (2, 20000)]
    ks, vs = _scales()
    outs = []
    for poison in (False, True):
        q, k, v, cache, meta = fp8_case(specs, 16, 4, 128, 16, 11, ks, vs, device="cuda", poison=poison)
        kv_write.write_kv(k.to(BF16), v.to(BF16), cache, meta.slot_mapping, ks, vs)
        outs += [_decode(tp, q, cache, meta, 0.09, cfg, ks, vs), _decode(tp, q, cache, meta, 0.09, cfg, ks, vs, 37)]
    assert all(torch.isfinite(o).all() for o in outs)
    ref = ref_fp8(q, cache, meta, 0.09, ks, vs)
    tol = F16_DOT_TOL[BF16] if cfg.fp8_dot == "fp16" else None
    check_close(outs[2], ref, BF16, f"{name} poisoned", tol=tol)
    check_close(outs[3], ref, BF16, f"{name} poisoned, 37 splits", tol=tol)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_fp8_cache_runs_triton(monkeypatch):
    from qsaserve.ops.attention import triton_paged as tp

    called = []
    real = tp.paged_attention
    monkeypatch.setattr(tp, "paged_attention", lambda *a, **k: called.append(k.get("k_scale")) or real(*a, **k))
    ks, vs = _scales()
    specs = [(1, 900), (40, 40), (1, 1)]
    q, k, v, cache, meta = fp8_case(specs, 8, 2, 64, 16, 3, ks, vs, device="cuda")
    ref_cache = cache.clone()
    layer = Attention(8, 2, 64, 0.125)
    layer.cache = LayerCache(cache, k_scale=ks, v_scale=vs)
    out = layer(q.flatten(1), k.to(BF16).flatten(1), v.to(BF16).flatten(1), meta)
    assert called and called[0] is ks
    check_close(out.view(q.shape), ref_fp8(q, cache, meta, 0.125, ks, vs), BF16, "fp8 layer")
    write_kv_reference(k.to(BF16), v.to(BF16), ref_cache, meta.slot_mapping, ks, vs)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# CUDA-graph contract: padding rows, a static seq_lens_list bound, capture and replay
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_padding_rows_and_bound(fp8):
    """One decode step (write + attention) captured with seq_lens_list = [bound] * B and two
    padding rows, then replayed for two batches of different true lengths written into the
    static inputs: each replay equals the reference, padding rows are 0 and write nothing."""
    from qsaserve.ops.attention import kv_write, triton_paged as tp

    hq, hkv, d, page, bound, pad = 32, 8, 128, 16, 16384, 2
    ks, vs = _scales() if fp8 else (None, None)
    steps = [[(1, 9000), (1, 300), (1, 17), (1, 1)], [(1, 1), (1, 16000), (1, 2048), (1, 5)]]
    b = len(steps[0]) + pad
    width = bound // page
    num_blocks = 1 + sum(-(-s // page) for _, s in steps[1]) + 8
    static = SimpleNamespace(
        q=torch.zeros(b, hq, d, dtype=BF16, device="cuda"), k=torch.zeros(b, hkv, d, dtype=BF16, device="cuda"),
        v=torch.zeros(b, hkv, d, dtype=BF16, device="cuda"),
        slot_mapping=torch.full((b,), -1, dtype=torch.int64, device="cuda"),
        block_tables=torch.zeros(b, width, dtype=torch.int32, device="cuda"),
        seq_lens=torch.zeros(b, dtype=torch.int32, device="cuda"),
        cu_query_lens=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
        query_lens=[1] * b, seq_lens_list=[bound] * b,
    )
    cache = nan_bytes((2, num_blocks, page, hkv, d), device="cuda") if fp8 else \
        torch.full((2, num_blocks, page, hkv, d), float("nan"), dtype=BF16, device="cuda")

    def step():
        kv_write.write_kv(static.k, static.v, cache, static.slot_mapping, ks, vs)
        return tp.paged_attention(static.q, cache, static, d**-0.5, k_scale=ks, v_scale=vs)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile and plan outside the capture
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for n, specs in enumerate(steps):
        if fp8:
            q, k, v, case_cache, meta = fp8_case(specs, hq, hkv, d, page, n, ks, vs, device="cuda")
        else:
            q, k, v, case_cache, meta = make_case(specs, hq, hkv, d, page, BF16, "cuda", seed=n, poison=float("nan"))
        cache.view(torch.uint8)[:, : case_cache.shape[1]].copy_(case_cache.view(torch.uint8))
        real = len(specs)
        static.q.zero_()[:real].copy_(q)
        static.k.zero_()[:real].copy_(k)
        static.v.zero_()[:real].copy_(v)
        static.slot_mapping.fill_(-1)[:real].copy_(meta.slot_mapping)
        static.block_tables.zero_()[:real, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        static.seq_lens.zero_()[:real].copy_(meta.seq_lens)
        expect = case_cache.clone()
        write_kv_reference(k.to(BF16), v.to(BF16), expect, meta.slot_mapping, ks, vs)
        graph.replay()
        torch.cuda.synchronize()
        got = cache[:, : case_cache.shape[1]]
        assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8)), "padding rows must write nothing"
        assert torch.equal(out[real:], torch.zeros_like(out[real:]))
        ref = ref_fp8(q, expect, meta, d**-0.5, ks, vs) if fp8 else \
            paged_attention_reference(q.float(), expect.float(), meta.block_tables, meta.query_lens, meta.seq_lens_list, d**-0.5)
        check_close(out[:real], ref, BF16, f"replay {n}")


# ----------------------------------------------------------------------------------------------
# Decode context parallel partials
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("size,interleave,fp8", [(2, 1, False), (2, 8, True), (4, 4, False), (3, 16, True)])
def test_dcp_partials_match_reference_and_merge(size, interleave, fp8):
    """Per simulated rank: Triton out/LSE == dcp_reference's (empty rows: 0 / -inf); merged over
    the ranks == paged attention over the whole context."""
    from qsaserve.ops.attention import kv_write, triton_common, triton_paged as tp

    page, hq, hkv, d = 16, 8, 1, 128
    specs = [(1, 1), (1, 3000), (4, 777), (300, 300), (100, 2100), (1, 2 * page * size + 1)]
    query_lens, seq_lens = [a for a, _ in specs], [b for _, b in specs]
    gen = torch.Generator().manual_seed(size * 100 + interleave)
    q = torch.randn(sum(query_lens), hq, d, generator=gen).to(BF16).cuda()
    scales = _scales() if fp8 else (None, None)
    engine_block = page * size
    widths = [-(-n // engine_block) for n in seq_lens]
    ids = torch.randperm(sum(widths), generator=gen) + 1
    tables = torch.zeros(len(specs), max(widths) + 1, dtype=torch.int32)
    o = 0
    for i, w in enumerate(widths):
        tables[i, :w] = ids[o: o + w]
        o += w
    tables = tables.cuda()
    k_all = [torch.randn(n, hkv, d, generator=gen).to(BF16).cuda() for n in seq_lens]
    v_all = [torch.randn(n, hkv, d, generator=gen).to(BF16).cuda() for n in seq_lens]
    full = torch.zeros(2, sum(widths) + 1, engine_block, hkv, d, dtype=BF16, device="cuda")
    for i, n in enumerate(seq_lens):
        slots = torch.tensor([int(tables[i, t // engine_block]) * engine_block + t % engine_block for t in range(n)],
                             device="cuda")
        write_kv_reference(k_all[i], v_all[i], full, slots)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    meta = SimpleNamespace(block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                           cu_query_lens=cu, query_lens=query_lens, seq_lens_list=seq_lens)
    outs, lses, ref_outs, ref_lses = [], [], [], []
    for rank in range(size):
        g = DcpGeometry(size, rank, interleave, page)
        shape = (2, sum(widths) + 1, page, hkv, d)
        shard = nan_bytes(shape, device="cuda") if fp8 else torch.full(shape, float("nan"), dtype=BF16, device="cuda")
        for i, n in enumerate(seq_lens):
            rows = [t for t in range(n) if g.owner(t) == rank]
            table = tables[i].tolist()
            slots = torch.tensor([g.local_slot(t, table) for t in rows], dtype=torch.long, device="cuda")
            kv_write.write_kv(k_all[i][rows], v_all[i][rows], shard, slots, *scales)
        local = [g.local_len(n) for n in seq_lens]
        keys = g.key_positions(max(local), "cuda")
        ref_out, ref_lse = partial_reference(q, shard, tables, query_lens, seq_lens, local, keys, d**-0.5, *scales)
        lens = torch.tensor(local, dtype=torch.int32, device="cuda")
        shard_keys = triton_common.ShardKeys(size, rank, interleave, lens, local)
        out, lse = tp.paged_attention_partial(q, shard, meta, d**-0.5, shard_keys, *scales)
        assert out.dtype == lse.dtype == torch.float32
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), empty) and torch.equal(out[empty], torch.zeros_like(out[empty]))
        check_close(out, ref_out, BF16, f"rank {rank} out")
        torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=2e-2, rtol=2e-3)
        outs.append(out)
        lses.append(lse)
        ref_outs.append(ref_out)
        ref_lses.append(ref_lse)
    assert torch.isinf(torch.stack(lses)).any()  # the 1-token sequence lives on rank 0 only
    merged, _ = merge_attention_partials(outs, lses)
    full_ref = paged_attention_reference(q.float(), full.float(), tables, query_lens, seq_lens, d**-0.5)
    if not fp8:
        check_close(merged, full_ref, BF16, "merged over ranks")
    else:  # E4M3 K/V: compare with the merge of the reference partials (same pages)
        ref_merged, _ = merge_attention_partials(ref_outs, ref_lses)
        check_close(merged, ref_merged, BF16, "merged over ranks (fp8)")
