"""Paged attention kernels vs torch SDPA on the same GPU, in one run. Prints JSON.

Decode: bandwidth in TB/s of K/V bytes read (each context token's K and V once), Triton over a
paged cache with shuffled blocks vs SDPA over contiguous K/V (enable_gqa). Prefill: causal
TFLOP/s (4*Hq*D per visible query-key pair) vs SDPA's flash backend. Timing: triton's do_bench
(L2 flushed between runs), median.

FP8 (section fp8): bf16 vs FP8 E4M3 pages for the same decode (batch 8 at 8K/32K/128K): time,
effective TB/s of the K/V bytes each dtype reads, the fp8/bf16 speedup, and the KV capacity in
tokens each dtype gives at one byte budget (KVCacheSpec.num_blocks_for); SDPA over contiguous
bf16 K/V is the peer. Each row also times every FP8 launch candidate (fp8_variants: block_n,
warps, stages, ctas_per_sm, fp8_dot, fp8_permute_v, fp8_v_convert, splits; the default again with 8/16/32/64
forced splits) and names the fastest (fp8_best); max_abs_diff_vs_default checks each agrees with
the default's output. `--sections env,fp8` takes well under 3 minutes on an H200.

    python benchmarks/bench_attention.py [--sections env,copy,decode,fp8,layout,sweep,prefill,write] [--out f.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton

from qsaserve.bench.gpu_timing import do_bench_graph_s, do_bench_s
from qsaserve.ops.device import num_sms

from qsaserve.cache.kv_cache import KVCacheSpec
from qsaserve.ops.attention import configs, decode_triton, kv_write, triton_paged as tp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_decode_candidates import FP8_DECODE_CANDIDATES  # noqa: E402

HQ, HKV, D = 32, 8, 128
DT = torch.bfloat16
MEM_LIMIT = 40e9  # bytes per K/V copy; keeps ours + SDPA's buffers well inside 139 GiB


def make_meta(q_lens, s_lens, page, device, seed=0):
    """Block tables over shuffled blocks (a fragmented cache), as the engine would hand over."""
    nblk = [-(-s // page) for s in s_lens]
    ids = list(range(1, 1 + sum(nblk)))
    random.Random(seed).shuffle(ids)
    tables = torch.zeros(len(s_lens), max(nblk), dtype=torch.int32)
    o = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = torch.tensor(ids[o: o + n], dtype=torch.int32)
        o += n
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    meta = SimpleNamespace(
        block_tables=tables.to(device), seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=device),
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device), query_lens=list(q_lens),
        seq_lens_list=list(s_lens), slot_mapping=None,
    )
    return meta, 1 + sum(nblk)


def rand_(t):
    return t.normal_().clamp_(-4, 4)


def env_info(args):
    p = torch.cuda.get_device_properties(0)
    commit = args.commit or os.environ.get("QSASERVE_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:
            commit = "unknown"
    return {
        "device": torch.cuda.get_device_name(0), "sms": p.multi_processor_count,
        "memory_gib": round(p.total_memory / 2**30, 1), "date": datetime.date.today().isoformat(),
        "git_commit": commit, "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": sys.version.split()[0],
    }


def copy_bandwidth():
    n = 2 * 2**30  # 4 GiB of bf16
    a = torch.empty(n, dtype=DT, device="cuda").normal_()
    b = torch.empty_like(a)
    t = do_bench_s(lambda: b.copy_(a))
    del a, b
    return {"bytes_read_plus_written": 2 * n * 2, "tb_s": 2 * n * 2 / t / 1e12}


def sdpa_decode_time(b, ctx):
    q = rand_(torch.empty(b, HQ, 1, D, dtype=DT, device="cuda"))
    k = rand_(torch.empty(b, HKV, ctx, D, dtype=DT, device="cuda"))
    v = rand_(torch.empty(b, HKV, ctx, D, dtype=DT, device="cuda"))
    t = do_bench_s(lambda: F.scaled_dot_product_attention(q, k, v, scale=D**-0.5, enable_gqa=True))
    del q, k, v
    return t


def decode_case(b, ctx, page, cfg=None, num_splits=None, seed=0):
    """Returns (seconds, kv_bytes, splits used) for the Triton decode of B sequences at ctx."""
    meta, nb = make_meta([1] * b, [ctx] * b, page, "cuda", seed)
    cache = rand_(torch.empty(2, nb, page, HKV, D, dtype=DT, device="cuda"))
    q = rand_(torch.empty(b, HQ, D, dtype=DT, device="cuda"))
    out = torch.empty_like(q)
    default = configs.decode_config(b * HKV)
    cfg = cfg or default
    auto = configs.num_decode_splits(b * HKV, ctx, num_sms(q.device), cfg.block_n, cfg.ctas_per_sm, cfg.min_waves)
    if num_splits is None:
        num_splits = auto

    def run():
        decode_triton.paged_decode(q, cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, D**-0.5,
                                   num_seqs=b, max_seq_len=ctx, config=cfg, num_splits=num_splits)

    if cfg is default and num_splits == auto:
        run = lambda: tp.paged_attention(q, cache, meta, D**-0.5, out=out)  # noqa: E731  (the engine's entry point)
    t = do_bench_s(run)
    del cache
    return t, b * ctx * HKV * D * 2 * 2, num_splits


def decode_table(args):
    rows = []
    for ctx in (2048, 8192, 32768, 131072):
        for b in (1, 8, 64, 256):
            kv_bytes = b * ctx * HKV * D * 2 * 2
            if kv_bytes > MEM_LIMIT:
                rows.append({"ctx": ctx, "batch": b, "skipped": f"K/V {kv_bytes / 1e9:.0f} GB > {MEM_LIMIT / 1e9:.0f} GB"})
                continue
            row = {"ctx": ctx, "batch": b, "kv_gb": kv_bytes / 1e9}
            for page in args.pages:
                t, _, s = decode_case(b, ctx, page)
                row[f"triton_p{page}_us"] = t * 1e6
                row[f"triton_p{page}_tb_s"] = kv_bytes / t / 1e12
                row["splits"] = s
            torch.cuda.empty_cache()
            ts = sdpa_decode_time(b, ctx)
            row["sdpa_us"] = ts * 1e6
            row["sdpa_tb_s"] = kv_bytes / ts / 1e12
            for page in args.pages:
                row[f"ratio_p{page}"] = row[f"triton_p{page}_tb_s"] / row["sdpa_tb_s"]
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def decode_sweep(args):
    out = []
    for b, ctx in ((8, 32768), (8, 131072), (1, 131072), (64, 8192)):
        kv = b * ctx * HKV * D * 4
        for bn in (32, 64, 128):
            for nw in (4, 8):
                for ns in (2, 3, 4):
                    cfg = configs.DecodeConfig(bn, nw, ns)
                    try:
                        t, _, s = decode_case(b, ctx, 16, cfg)
                        out.append({"batch": b, "ctx": ctx, "block_n": bn, "warps": nw, "stages": ns, "splits": s, "tb_s": kv / t / 1e12})
                    except Exception as e:  # e.g. out of shared memory
                        out.append({"batch": b, "ctx": ctx, "block_n": bn, "warps": nw, "stages": ns, "error": type(e).__name__})
                    print(json.dumps(out[-1]), flush=True)
        best = max((r for r in out if r.get("ctx") == ctx and r.get("batch") == b and "tb_s" in r), key=lambda r: r["tb_s"])
        cfg = configs.DecodeConfig(best["block_n"], best["warps"], best["stages"])
        for s in (1, 2, 4, 8, 16, 33, 66, 128):
            if s * 512 > ctx:
                continue
            t, _, _ = decode_case(b, ctx, 16, cfg, num_splits=s)
            out.append({"batch": b, "ctx": ctx, "block_n": cfg.block_n, "warps": cfg.num_warps, "stages": cfg.num_stages,
                        "splits": s, "tb_s": kv / t / 1e12, "split_sweep": True})
            print(json.dumps(out[-1]), flush=True)
        torch.cuda.empty_cache()
    return out


def decode_diag(args):
    """Small cases are launch-bound in eager mode: split host overhead, CUDA-graph time and
    per-kernel device time (profiler), ours and SDPA's; plus block_n 64 vs 128 at low batch."""
    rows = []
    for b, ctx in ((1, 2048), (1, 8192), (1, 32768), (1, 131072), (2, 32768), (4, 32768), (8, 2048), (8, 8192), (8, 32768)):
        meta, nb = make_meta([1] * b, [ctx] * b, 16, "cuda")
        cache = rand_(torch.empty(2, nb, 16, HKV, D, dtype=DT, device="cuda"))
        q = rand_(torch.empty(b, HQ, D, dtype=DT, device="cuda"))
        out = torch.empty_like(q)
        kv = b * ctx * HKV * D * 4
        fn = lambda: tp.paged_attention(q, cache, meta, D**-0.5, out=out)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200
        torch.cuda.synchronize()
        row = {"batch": b, "ctx": ctx, "host_us_per_call": host * 1e6, "eager_us": do_bench_s(fn) * 1e6,
               "graph_us": do_bench_graph_s(fn) * 1e6}
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if "kernel" in e.key and ("_decode" in e.key or "_merge" in e.key):
                    row[f"{e.key}_us"] = getattr(e, "device_time", None) or e.cuda_time
        except Exception as e:  # profiler unavailable: keep the rest
            row["profiler_error"] = repr(e)[:200]
        row["graph_tb_s"] = kv / row["graph_us"] / 1e6
        for bn, nw in ((64, 4), (128, 4)):
            cfg = configs.DecodeConfig(bn, nw, 3, 1 if bn == 128 else 2)
            f2 = lambda: decode_triton.paged_decode(q, cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, D**-0.5,  # noqa: E731
                                                    num_seqs=b, max_seq_len=ctx, config=cfg)
            f2()
            row[f"graph_bn{bn}_tb_s"] = kv / (do_bench_graph_s(f2) * 1e6) / 1e6
        del cache
        qs = rand_(torch.empty(b, HQ, 1, D, dtype=DT, device="cuda"))
        k = rand_(torch.empty(b, HKV, ctx, D, dtype=DT, device="cuda"))
        v = rand_(torch.empty(b, HKV, ctx, D, dtype=DT, device="cuda"))
        fs = lambda: F.scaled_dot_product_attention(qs, k, v, scale=D**-0.5, enable_gqa=True)  # noqa: E731
        fs()
        row["sdpa_eager_us"] = do_bench_s(fs) * 1e6
        row["sdpa_graph_us"] = do_bench_graph_s(fs) * 1e6
        row["sdpa_graph_tb_s"] = kv / row["sdpa_graph_us"] / 1e6
        row["graph_ratio"] = row["graph_tb_s"] / row["sdpa_graph_tb_s"]
        del k, v
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def kv_capacity(budget_gib: float, num_layers: int, page: int) -> dict:
    """Tokens of KV that fit in budget_gib for a model of num_layers layers of this geometry."""
    out = {"budget_gib": budget_gib, "num_layers": num_layers, "block_size": page}
    for name, dtype in (("bf16", DT), ("fp8", torch.float8_e4m3fn)):
        spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=HKV, head_dim=D, dtype=DT, block_size=page, kv_dtype=dtype)
        out[f"{name}_tokens"] = spec.num_blocks_for(int(budget_gib * 2**30)) * page
    out["fp8_over_bf16"] = out["fp8_tokens"] / out["bf16_tokens"]
    return out


def fp8_variant_row(name, cfg, q, cache8, meta, out, ks, vs, ctx, elems, bf16_s, ref, num_splits=None):
    """One FP8 decode launch configuration timed through paged_decode (the merge included)."""
    b = q.shape[0]
    auto = configs.num_decode_splits(b * HKV, ctx, num_sms(q.device), cfg.block_n, cfg.ctas_per_sm, cfg.min_waves)
    splits = num_splits or auto

    def run():
        decode_triton.paged_decode(q, cache8, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, D**-0.5,
                                   num_seqs=b, max_seq_len=ctx, config=cfg, num_splits=splits, k_scale=ks, v_scale=vs)

    run()
    diff = (out.float() - ref).abs().max().item()
    t = do_bench_s(run)
    return {"name": name, **dataclasses.asdict(cfg), "splits": splits, "splits_forced": num_splits is not None,
            "us": t * 1e6, "tb_s": elems / t / 1e12, "speedup_vs_bf16": bf16_s / t, "max_abs_diff_vs_default": diff}


def fp8_table(args):
    """bf16 vs FP8 E4M3 pages, same decode batch, same shuffled block tables; then every FP8 decode
    candidate (fp8_decode_candidates.py) and the default with forced split counts."""
    b, page = 8, 16
    ks = torch.tensor(0.05, device="cuda")
    vs = torch.tensor(0.05, device="cuda")
    rows = []
    for ctx in (8192, 32768, 131072):
        meta, nb = make_meta([1] * b, [ctx] * b, page, "cuda", seed=ctx)
        q = rand_(torch.empty(b, HQ, D, dtype=DT, device="cuda"))
        out = torch.empty_like(q)
        elems = b * ctx * HKV * D * 2  # K and V values read
        row = {"batch": b, "ctx": ctx, "kv_gb_bf16": elems * 2 / 1e9, "kv_gb_fp8": elems / 1e9}
        cache = rand_(torch.empty(2, nb, page, HKV, D, dtype=DT, device="cuda"))
        t = do_bench_s(lambda: tp.paged_attention(q, cache, meta, D**-0.5, out=out))
        row.update(bf16_us=t * 1e6, bf16_tb_s=elems * 2 / t / 1e12)
        bf16_graph = do_bench_graph_s(lambda: tp.paged_attention(q, cache, meta, D**-0.5, out=out))
        cache8 = (cache / 0.05).to(torch.float8_e4m3fn)  # |x| <= 80: finite E4M3
        del cache
        fp8_cfg = configs.decode_config(b * HKV, fp8=True)
        row["fp8_config"] = dataclasses.asdict(fp8_cfg)
        row["fp8_splits"] = configs.num_decode_splits(b * HKV, ctx, num_sms(q.device), fp8_cfg.block_n, fp8_cfg.ctas_per_sm,
                                                      fp8_cfg.min_waves)
        tp.paged_attention(q, cache8, meta, D**-0.5, out=out, k_scale=ks, v_scale=vs)
        ref = out.float().clone()  # the default's output: every variant must agree with it
        t8 = do_bench_s(lambda: tp.paged_attention(q, cache8, meta, D**-0.5, out=out, k_scale=ks, v_scale=vs))
        row.update(fp8_us=t8 * 1e6, fp8_tb_s=elems / t8 / 1e12, fp8_speedup=t / t8)
        # As the engine runs decode: inside a CUDA graph, so launch overhead drops out.
        g8 = do_bench_graph_s(lambda: tp.paged_attention(q, cache8, meta, D**-0.5, out=out, k_scale=ks, v_scale=vs))
        row.update(fp8_graph_us=g8 * 1e6, bf16_graph_us=bf16_graph * 1e6)
        row["fp8_graph_speedup"] = row["bf16_graph_us"] / row["fp8_graph_us"]
        # The same pages stored head-major within each block ([2, blocks, Hkv, page, D] memory, passed
        # as a permuted view: the kernels take strides): one head's page is then page * D contiguous
        # bytes instead of D-byte rows Hkv * D apart, which matters most for 1-byte E4M3 rows.
        hnd8 = torch.empty(2, nb, HKV, page, D, dtype=cache8.dtype, device="cuda").permute(0, 1, 3, 2, 4)
        hnd8.copy_(cache8)
        th8 = do_bench_s(lambda: tp.paged_attention(q, hnd8, meta, D**-0.5, out=out, k_scale=ks, v_scale=vs))
        row["hnd_fp8_max_abs_diff"] = (out.float() - ref).abs().max().item()
        del hnd8
        hnd = torch.empty(2, nb, HKV, page, D, dtype=DT, device="cuda").permute(0, 1, 3, 2, 4)
        hnd.copy_(cache8.to(DT) * 0.05)
        thb = do_bench_s(lambda: tp.paged_attention(q, hnd, meta, D**-0.5, out=out))
        del hnd
        torch.cuda.empty_cache()
        row.update(hnd_fp8_us=th8 * 1e6, hnd_fp8_tb_s=elems / th8 / 1e12, hnd_bf16_us=thb * 1e6,
                   hnd_bf16_tb_s=elems * 2 / thb / 1e12, hnd_fp8_speedup_vs_nhd_bf16=t / th8,
                   hnd_fp8_speedup_vs_hnd_bf16=thb / th8)
        variants = []
        for name, cfg in FP8_DECODE_CANDIDATES.items():
            variants.append(fp8_variant_row(name, cfg, q, cache8, meta, out, ks, vs, ctx, elems, t, ref))
        # 8 x 64 pairs: 0.97 of one wave at 4 programs per SM (the default's plan); 6: the same at 3.
        for s in (6, 8, 12, 16, 32, 64):
            variants.append(fp8_variant_row("default", fp8_cfg, q, cache8, meta, out, ks, vs, ctx, elems, t, ref, s))
        row["fp8_variants"] = variants
        best = min(variants, key=lambda r: r["us"])
        row["fp8_best"] = {k: best[k] for k in ("name", "splits", "us", "tb_s", "speedup_vs_bf16")}
        del cache8
        torch.cuda.empty_cache()
        ts = sdpa_decode_time(b, ctx)
        row.update(sdpa_bf16_us=ts * 1e6, sdpa_bf16_tb_s=elems * 2 / ts / 1e12, fp8_over_sdpa=ts / t8)
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows, "capacity": kv_capacity(args.kv_budget_gib, args.num_layers, page),
            "scales": {"k": 0.05, "v": 0.05},
            "targets": {"fp8_speedup_at_131072": 1.6, "fp8_speedup_at_8192": 1.0}}


def layout_table(args):
    """Page layout and block size at 128K (batch 8): bf16 and FP8 decode with pages stored
    token-major ([blocks, page, Hkv, D], NHD, the engine's) or head-major within a block ([blocks,
    Hkv, page, D], HND, a permuted view: the kernels take strides), for block sizes 16 and 64.
    H200 (attention_layout_h200_2026-11-30_42e938a.json): HND and block 64 within 1% of the engine's
    layout for both dtypes. V alone stored channel-major (key-contiguous, as mma's B operand wants)
    ran 0.37x bf16 in FP8 (attention_layout_vt_h200_2026-11-30_401709b.json); not kept."""
    b, ctx = 8, 131072
    ks = torch.tensor(0.05, device="cuda")
    rows = []
    for page in (16, 64):
        meta, nb = make_meta([1] * b, [ctx] * b, page, "cuda", seed=page)
        q = rand_(torch.empty(b, HQ, D, dtype=DT, device="cuda"))
        out = torch.empty_like(q)
        elems = b * ctx * HKV * D * 2
        row = {"batch": b, "ctx": ctx, "page": page}
        for layout in ("nhd", "hnd"):
            shape = (2, nb, page, HKV, D) if layout == "nhd" else (2, nb, HKV, page, D)
            base = rand_(torch.empty(shape, dtype=DT, device="cuda"))
            cache = base if layout == "nhd" else base.permute(0, 1, 3, 2, 4)
            row[f"{layout}_bf16_us"] = do_bench_s(lambda: tp.paged_attention(q, cache, meta, D**-0.5, out=out)) * 1e6
            cache8 = (base / 0.05).to(torch.float8_e4m3fn)
            del base, cache
            cache8 = cache8 if layout == "nhd" else cache8.permute(0, 1, 3, 2, 4)
            row[f"{layout}_fp8_us"] = do_bench_s(
                lambda: tp.paged_attention(q, cache8, meta, D**-0.5, out=out, k_scale=ks, v_scale=ks)) * 1e6
            del cache8
            torch.cuda.empty_cache()
            row[f"{layout}_fp8_tb_s"] = elems / row[f"{layout}_fp8_us"] / 1e6
            row[f"{layout}_bf16_tb_s"] = elems * 2 / row[f"{layout}_bf16_us"] / 1e6
        row["fp8_speedup_nhd"] = row["nhd_bf16_us"] / row["nhd_fp8_us"]
        row["fp8_hnd_vs_nhd_bf16"] = row["nhd_bf16_us"] / row["hnd_fp8_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def prefill_flops(q_lens, s_lens):
    pairs = sum(sum(s - q + j + 1 for j in range(q)) for q, s in zip(q_lens, s_lens))
    return 4 * HQ * D * pairs


def prefill_case(q_lens, s_lens, page, cfg=None):
    meta, nb = make_meta(q_lens, s_lens, page, "cuda")
    cache = rand_(torch.empty(2, nb, page, HKV, D, dtype=DT, device="cuda"))
    q = rand_(torch.empty(sum(q_lens), HQ, D, dtype=DT, device="cuda"))
    out = torch.empty_like(q)
    t = do_bench_s(lambda: tp.paged_attention(q, cache, meta, D**-0.5, out=out, prefill_config=cfg))
    return t


def sdpa_prefill_time(b, n):
    q = rand_(torch.empty(b, HQ, n, D, dtype=DT, device="cuda"))
    k = rand_(torch.empty(b, HKV, n, D, dtype=DT, device="cuda"))
    v = rand_(torch.empty(b, HKV, n, D, dtype=DT, device="cuda"))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D**-0.5, enable_gqa=True)  # noqa: E731
            fn()
            how = "flash, enable_gqa"
        except RuntimeError:
            k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D**-0.5)  # noqa: E731
            how = "flash, K/V expanded"
        t = do_bench_s(fn)
    return t, how


def prefill_table(args):
    rows = []
    cfgs = [configs.prefill_config(D), configs.PrefillConfig(128, 128, 8, 2), configs.PrefillConfig(128, 64, 4, 3),
            configs.PrefillConfig(64, 64, 4, 3), configs.PrefillConfig(128, 32, 4, 4), configs.PrefillConfig(128, 128, 8, 3)]
    for b, n in ((1, 8192), (4, 4096), (1, 32768), (16, 1024)):
        fl = prefill_flops([n] * b, [n] * b)
        row = {"batch": b, "len": n, "kind": "fresh causal"}
        for i, cfg in enumerate(cfgs if (b, n) == (1, 8192) else cfgs[:1]):
            try:
                t = prefill_case([n] * b, [n] * b, 16, cfg)
                row[f"triton_tflops_cfg{i}"] = fl / t / 1e12
                row[f"cfg{i}"] = [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages]
            except Exception as e:
                row[f"cfg{i}_error"] = type(e).__name__
        row["triton_tflops"] = row.get("triton_tflops_cfg0")
        ts, how = sdpa_prefill_time(b, n)
        row["sdpa_tflops"] = fl / ts / 1e12
        row["sdpa"] = how
        row["ratio"] = row["triton_tflops"] / row["sdpa_tflops"] if row["triton_tflops"] else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    # Chunked prefill over a cached prefix (no SDPA peer: its causal mask cannot offset).
    for ql, sl in ((2048, 32768), (512, 131072)):
        t = prefill_case([ql], [sl], 16)
        row = {"batch": 1, "len": ql, "context": sl, "kind": "chunk over cached prefix",
               "triton_tflops": prefill_flops([ql], [sl]) / t / 1e12, "triton_us": t * 1e6}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def write_bench(args):
    t_tok = 16384
    k = rand_(torch.empty(t_tok, HKV, D, dtype=DT, device="cuda"))
    v = rand_(torch.empty(t_tok, HKV, D, dtype=DT, device="cuda"))
    cache = torch.zeros(2, t_tok // 16 + 1, 16, HKV, D, dtype=DT, device="cuda")
    slots = (torch.randperm(t_tok // 16, device="cuda") + 1)[:, None] * 16 + torch.arange(16, device="cuda")
    slots = slots.flatten()
    t = do_bench_s(lambda: kv_write.write_kv(k, v, cache, slots))
    by = 2 * 2 * t_tok * HKV * D * 2  # read k, v; write both
    return {"tokens": t_tok, "us": t * 1e6, "tb_s": by / t / 1e12}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="env,copy,decode,fp8,prefill,write")
    ap.add_argument("--kv-budget-gib", type=float, default=100.0, help="byte budget for the fp8 section's KV capacity")
    ap.add_argument("--num-layers", type=int, default=32, help="attention layers for the fp8 section's KV capacity")
    ap.add_argument("--pages", default="16", help="block sizes for the decode table, e.g. 16,32")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.pages = [int(x) for x in args.pages.split(",")]
    secs = args.sections.split(",")
    res = {"config": {"hq": HQ, "hkv": HKV, "head_dim": D, "dtype": "bfloat16", "timing": "triton do_bench median, L2 flushed",
                      "decode_config": dataclasses.asdict(configs.DECODE_CONFIG),
                      "prefill_config_d128": dataclasses.asdict(configs.prefill_config(D)),
                      "decode_config_few_pairs": dataclasses.asdict(configs.DECODE_CONFIG_FEW), "few_pairs": configs.FEW_PAIRS,
                      "decode_config_fp8": dataclasses.asdict(configs.DECODE_CONFIG_FP8),
                      "pages": args.pages}}
    t0 = time.time()
    res["env"] = env_info(args)
    if "copy" in secs:
        res["copy"] = copy_bandwidth()
        print(json.dumps(res["copy"]), flush=True)
    if "decode" in secs:
        res["decode"] = decode_table(args)
    if "fp8" in secs:
        res["fp8_decode"] = fp8_table(args)
        print(json.dumps(res["fp8_decode"]["capacity"]), flush=True)
    if "layout" in secs:
        res["layout"] = layout_table(args)
    if "diag" in secs:
        res["decode_diag"] = decode_diag(args)
    if "prefill" in secs:
        res["prefill"] = prefill_table(args)
    if "write" in secs:
        res["write_kv"] = write_bench(args)
        print(json.dumps(res["write_kv"]), flush=True)
    if "sweep" in secs:
        res["decode_sweep"] = decode_sweep(args)
    res["bench_seconds"] = time.time() - t0
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    # Short table last.
    for r in res.get("decode", []):
        if "skipped" in r:
            continue
        p = args.pages[0]
        print(f"decode B{r['batch']:>3} ctx{r['ctx']:>7}: triton {r[f'triton_p{p}_tb_s']:.2f} TB/s  sdpa {r['sdpa_tb_s']:.2f}  "
              f"ratio {r[f'ratio_p{p}']:.2f}  splits {r['splits']}")
    if "fp8_decode" in res:
        for r in res["fp8_decode"]["rows"]:
            bst = r["fp8_best"]
            print(f"fp8 decode B{r['batch']} ctx{r['ctx']:>7}: bf16 {r['bf16_us']:.0f}us ({r['bf16_tb_s']:.2f} TB/s)  "
                  f"fp8 {r['fp8_us']:.0f}us ({r['fp8_tb_s']:.2f} TB/s, {r['fp8_splits']} splits)  "
                  f"speedup {r['fp8_speedup']:.2f}  best {bst['name']} x{bst['splits']} {bst['us']:.0f}us "
                  f"({bst['speedup_vs_bf16']:.2f})  sdpa bf16 {r['sdpa_bf16_us']:.0f}us")
            for v in r["fp8_variants"]:
                print(f"    {v['name']:<20} splits {v['splits']:>3}{'*' if v['splits_forced'] else ' '} {v['us']:7.0f}us "
                      f"{v['tb_s']:.2f} TB/s  x{v['speedup_vs_bf16']:.2f} vs bf16  diff {v['max_abs_diff_vs_default']:.1e}")
        c = res["fp8_decode"]["capacity"]
        print(f"KV capacity at {c['budget_gib']} GiB, {c['num_layers']} layers: bf16 {c['bf16_tokens']} tokens, "
              f"fp8 {c['fp8_tokens']} tokens ({c['fp8_over_bf16']:.2f}x)")
    for r in res.get("decode_diag", []):
        print(f"diag B{r['batch']} ctx{r['ctx']}: host {r['host_us_per_call']:.0f}us eager {r['eager_us']:.0f}us graph {r['graph_us']:.0f}us "
              f"(sdpa eager {r['sdpa_eager_us']:.0f} graph {r['sdpa_graph_us']:.0f}) graph ratio {r['graph_ratio']:.2f} "
              f"bn64 {r['graph_bn64_tb_s']:.2f} bn128 {r['graph_bn128_tb_s']:.2f} TB/s")
    for r in res.get("prefill", []):
        print(f"prefill {r['kind']} B{r['batch']} len{r['len']}: triton {r['triton_tflops']:.0f} TF/s  sdpa {r.get('sdpa_tflops', float('nan')):.0f}")


if __name__ == "__main__":
    main()
