"""FP8-weight GEMMs (ops/fp8_gemm) on one GPU, at llama-8b's projection shapes (N x K: fused qkv
6144 x 4096, o 4096 x 4096, fused gate_up 28672 x 4096, down 4096 x 14336).

* prefill (M = 512, 2048, 8192): the block-FP8 W8A8 GEMM at its default tile and at TILES, and
  the best tile with its per-token-group activation quantization added, and cuBLAS's block-scaled
  GEMM on the same operands ("scaled_mm_blockwise", fp8_gemm/scaled_mm.py: what prefill runs on
  sm_90; "_with_act_quant": with its quantization; max_abs_diff_vs_triton: the two GEMMs'
  distance), against torch._scaled_mm per-tensor FP8 (the peer) and
  bf16 cuBLAS (F.linear), in the same run; TFLOP/s and the ratios the issue asks for (>= 0.9x
  _scaled_mm, >= 1.6x bf16).
* decode (M = 1 ... 64): the W8A16 kernel (bf16 activations, E4M3 weights; "fp8_w8a16" at its
  defaults, the others at DECODE_TILES, 3 stages; a tile whose shared memory
  (triton_gemm.w8a16_shared_bytes) exceeds the SM's gets a row with "skipped" instead of a time,
  as launching it would raise OutOfResources; each at split_k in DECODE_SPLITS too, named
  "fp8_w8a16_bn32_u4_s4" and so on: the split adds no shared memory; "fp8_w8a16_rule": the
  defaults with triton_gemm.pick_decode_split_k's proposed split; rows with a split carry
  workspace_bytes, the float32 partials written and read back, not counted in TB/s) and the NVFP4 W4A16
  kernel (ops/nvfp4_gemm) against bf16 cuBLAS; from SWAP_M rows also the transposed W8A16 kernel
  (fp8_gemm/triton_swap_ab.py), "fp8_w8a16_swap_bnB_wW_stS" at SWAP_TILES (weight rows a program,
  warps, stages) and each split in SWAP_SPLITS ("_sN"), and its NVFP4 form
  (nvfp4_gemm/triton_swap_ab.py), "nvfp4_w4a16_swap_..." at NVFP4_SWAP_TILES x NVFP4_SWAP_SPLITS,
  and what the engine runs there: "fp8_w8a16_swap" (the transposed kernel's defaults),
  "nvfp4_dispatch" (ops.nvfp4_gemm.nvfp4_linear) and, as the alternative, "fp8_w8a8" (the
  activations quantized per token group, then the W8A8 GEMM at its default tile; "_bn64": 64
  weight rows a program; "_scaled_mm": cuBLAS's block-scaled GEMM);
  TB/s counts the weight and scale bytes read, and pct_roofline is that over the H200's 4.8 TB/s. At GEMV_M rows also the FMA GEMVs the dispatch
  takes up to 4 rows: "fp8_gemv" (fp8_gemm/triton_gemv.py at its pick_gemv_tile defaults, the row
  names its tile), "fp8_gemv_bnB_bkK_sS_wW_stT" at GEMV_SWEEP, "fp8_norm_gemv" (the GEMV with
  the RMSNorm and residual add before it joined in, defaults; 1-2 rows), "fp8_gemv_residual" (the
  GEMV adding its output to a residual and preparing the next norm), "fp8_prenormed_gemv" (the
  GEMV after that norm, 512 partial sums), "fp8_gemv_st1" (the
  defaults with the K loop not pipelined; one row only) and "nvfp4_gemv" (nvfp4_gemm/triton_gemv.py, defaults). A
  variant that raises gets a row with "error" and the others still run.
Times are CUDA-graph replays cycling over enough weight copies to exceed the L2. Prints JSON (one
line per case, then the document).

    PYTHONPATH=src python benchmarks/bench_fp8_gemm.py [--out f.json] [--phases prefill,decode] [--shapes qkv,o,...]
        [--decode-m 8,16,32,64] [--variants 'fp8_w8a16,fp8_w8a16_swap*,nvfp4_w4a16,nvfp4_w4a16_swap*']
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from qsaserve.bench.common import kernel_bench_main
from qsaserve.bench.gpu_timing import graph_ms
from qsaserve.ops.fp8_gemm import quantize_weight_block
from qsaserve.ops.device import max_shared_bytes, num_sms
from qsaserve.ops.fp8_gemm.triton_gemm import (decode_block_m, fp8_w8a16_gemm_triton, fp8_w8a8_gemm_triton,
                                              pick_decode_block_n, pick_decode_split_k, pick_decode_unroll,
                                              w8a16_shared_bytes)
from qsaserve.ops.fp8_gemm.triton_gemv import fp8_gemv_triton, fp8_norm_gemv_triton
from qsaserve.ops.fp8_gemm.triton_gemv_joined import fp8_gemv_residual_triton, fp8_prenormed_gemv_triton
from qsaserve.ops.fp8_gemm.triton_swap_ab import fp8_w8a16_swap_triton
from qsaserve.ops.fp8_gemm.triton_gemv import pick_gemv_tile as pick_fp8_gemv_tile
from qsaserve.ops.fp8_gemm.scaled_mm import ROWS_MULTIPLE, fp8_linear_scaled_mm, fp8_w8a8_gemm_scaled_mm
from qsaserve.ops.fp8_gemm.triton_quant import per_token_group_quant_triton
from qsaserve.ops.nvfp4_gemm import nvfp4_linear, quantize_nvfp4
from qsaserve.ops.nvfp4_gemm.triton_gemm import nvfp4_w4a16_gemm_triton
from qsaserve.ops.nvfp4_gemm.triton_gemv import nvfp4_gemv_triton
from qsaserve.ops.nvfp4_gemm.triton_swap_ab import nvfp4_w4a16_swap_triton
from qsaserve.ops.nvfp4_gemm.triton_gemv import pick_gemv_tile as pick_nvfp4_gemv_tile

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
PREFILL_M = (512, 2048, 8192)
DECODE_M = (1, 2, 4, 8, 16, 32, 64)
TILES = [dict(block_m=bm, block_n_tile=bn, num_warps=w, num_stages=s)
         for bm, bn, w, s in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4), (64, 64, 4, 4), (128, 64, 4, 3))]
DECODE_TILES = [dict(block_n_tile=bn, k_unroll=u) for bn, u in ((16, 1), (16, 4), (32, 4), (64, 4), (32, 2))]
DECODE_SPLITS = (1, 2, 4, 8)  # split_k of each decode tile (1: the variant's name has no _s suffix)
GEMV_M = (1, 2, 4)  # decode rows that also time the GEMVs
# block_n_tile, block_k, split_k, num_warps, num_stages: 8 KiB tiles against the 16 KiB defaults,
# the widest K tile, a 4-way split for the 4096-row projections, and more warps a program (each
# thread then holds half the tile: more warps an SM to hide the widening's latency) or more stages
GEMV_SWEEP = ((16, 512, 1, 4, 3), (8, 1024, 1, 4, 3), (16, 1024, 1, 4, 3), (4, 2048, 1, 4, 3), (8, 1024, 4, 4, 3),
              (16, 1024, 1, 8, 3), (32, 1024, 1, 8, 3), (16, 2048, 1, 8, 3), (32, 512, 1, 8, 4), (16, 1024, 1, 4, 4),
              (16, 512, 1, 2, 4), (8, 1024, 1, 2, 3),
              # 4 weight rows over 1 warp (the plain-weight GEMV's best tile at llama-8b's shapes, by bytes)
              (4, 1024, 1, 1, 3), (4, 2048, 1, 1, 3), (4, 1024, 1, 2, 3))
SWAP_M = 4  # decode rows from which the transposed kernel is timed too
SWAP_TILES = ((64, 4, 4), (128, 4, 4), (128, 8, 4), (64, 4, 6), (128, 4, 3))  # block_n_tile, num_warps, num_stages
SWAP_SPLITS = (1, 2, 4)
NVFP4_SWAP_TILES = ((64, 4, 4), (128, 4, 4), (128, 8, 3))
NVFP4_SWAP_SPLITS = (1, 2, 4)
HBM_TB_S = 4.8
L2_BYTES = 60 << 20


def _weights(n, k, dev, copies):
    out = []
    for i in range(copies):
        w = torch.randn(n, k, device=dev, generator=torch.Generator(device=dev).manual_seed(i)) * k**-0.5
        q, s = quantize_weight_block(w)
        out.append((w.to(torch.bfloat16), q, s))
    return out


def _per_tensor(w_bf16):
    s = (w_bf16.float().abs().amax() / 448).reshape(())
    return (w_bf16.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def prefill(name, n, k, m, dev) -> list[dict]:
    ws = _weights(n, k, dev, 2)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    flops = 2 * m * n * k
    xq, xs = per_token_group_quant_triton(x)
    xq4, xs4 = per_token_group_quant_triton(x, ROWS_MULTIPLE, scale_column_major=True)
    x_pt_s = (x.float().abs().amax() / 448).reshape(())
    x_pt = (x.float() / x_pt_s).clamp(-448, 448).to(torch.float8_e4m3fn)
    pts = [_per_tensor(w) for w, _, _ in ws]
    runs = {
        "bf16_cublas": lambda: [F.linear(x, w) for w, _, _ in ws],
        "scaled_mm_per_tensor": lambda: [torch._scaled_mm(x_pt, q.t(), scale_a=x_pt_s, scale_b=s, out_dtype=torch.bfloat16)
                                         for q, s in pts],
    }
    runs["scaled_mm_blockwise"] = lambda: [fp8_w8a8_gemm_scaled_mm(xq4, xs4, q, s, torch.bfloat16) for _, q, s in ws]
    runs["scaled_mm_blockwise_with_act_quant"] = lambda: [fp8_linear_scaled_mm(x, q, s) for _, q, s in ws]
    runs["block_fp8_gemm_default"] = lambda: [fp8_w8a8_gemm_triton(xq, xs, q, s, 128, torch.bfloat16) for _, q, s in ws]
    for i, tile in enumerate(TILES):
        runs[f"block_fp8_gemm_t{i}"] = lambda tile=tile: [fp8_w8a8_gemm_triton(xq, xs, q, s, 128, torch.bfloat16, **tile)
                                                          for _, q, s in ws]
    best_tile = None
    rows, us = [], {}
    for variant, fn in runs.items():
        try:
            us[variant] = graph_ms(fn) * 1e3 / len(ws)
        except Exception as exc:  # a tile that does not fit: reported, not fatal
            rows.append({"phase": "prefill", "shape": name, "m": m, "variant": variant, "error": str(exc)[:200]})
            continue
    gemm = {v: t for v, t in us.items() if v.startswith("block_fp8_gemm_t")}
    if gemm:
        best = min(gemm, key=gemm.get)
        best_tile = TILES[int(best.rsplit("_t", 1)[1])]
        quant_us = graph_ms(lambda: per_token_group_quant_triton(x)) * 1e3
        us["block_fp8_with_act_quant"] = gemm[best] + quant_us
    for variant, t in us.items():
        row = {"phase": "prefill", "shape": name, "n": n, "k": k, "m": m, "variant": variant, "us": round(t, 2),
               "tflops": round(flops / t / 1e6, 1)}
        if variant.startswith(("block_fp8", "scaled_mm_blockwise")) and "scaled_mm_per_tensor" in us:
            row["x_vs_scaled_mm"] = round(us["scaled_mm_per_tensor"] / t, 3)
            row["x_vs_bf16"] = round(us["bf16_cublas"] / t, 3)
        if variant == "block_fp8_with_act_quant":
            row["tile"] = best_tile
        if variant == "scaled_mm_blockwise":  # cuBLAS against the Triton GEMM on the same operands
            want = fp8_w8a8_gemm_triton(xq, xs, ws[0][1], ws[0][2], 128, torch.bfloat16).float()
            got = fp8_w8a8_gemm_scaled_mm(xq4, xs4, ws[0][1], ws[0][2], torch.bfloat16)[:m].float()
            row["max_abs_diff_vs_triton"] = float((got - want).abs().max())
            row["max_abs_triton"] = float(want.abs().max())
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def decode(name, n, k, m, dev, keep=None) -> list[dict]:
    """keep(variant name) -> bool: the variants timed (None: all; bf16_cublas always, the peer)."""
    copies = max(2, -(-2 * L2_BYTES // (n * k)))
    ws = _weights(n, k, dev, copies)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    fp8_bytes = n * k + ws[0][2].numel() * 4
    fp4 = []
    for w, _, _ in ws:
        packed, scale, glob = quantize_nvfp4(w)
        fp4.append((packed, scale, glob.expand(n).contiguous()))
    fp4_bytes = n * k // 2 + n * k // 16 + 4 * n
    rows = []
    variants = [("bf16_cublas", lambda: [F.linear(x, w) for w, _, _ in ws], 2 * n * k),
                ("fp8_w8a16", lambda: [fp8_w8a16_gemm_triton(x, q, s, 128) for _, q, s in ws], fp8_bytes)]
    max_shared = max_shared_bytes(x.device)
    sms = num_sms(x.device)
    skipped = {}
    splits = {}
    for t in DECODE_TILES:
        need = w8a16_shared_bytes(decode_block_m(m), t["block_n_tile"], t["k_unroll"], 3, x.element_size())
        for split in DECODE_SPLITS:
            variant = f"fp8_w8a16_bn{t['block_n_tile']}_u{t['k_unroll']}" + (f"_s{split}" if split > 1 else "")
            if need > max_shared:  # the launch would raise OutOfResources
                skipped[variant] = f"needs {need} bytes of shared memory, the SM has {max_shared}"
                continue
            splits[variant] = split
            variants.append((variant, lambda t=t, split=split: [
                fp8_w8a16_gemm_triton(x, q, s, 128, num_stages=3, split_k=split, **t) for _, q, s in ws], fp8_bytes))
    bm = decode_block_m(m)
    bn = pick_decode_block_n(n, sms, bm)
    ku, ns = pick_decode_unroll(bm, bn, x.element_size(), max_shared, 1 if bm == 64 else None)
    rule_split = splits["fp8_w8a16_rule"] = pick_decode_split_k(n, k, bn, sms)
    variants.append(("fp8_w8a16_rule", lambda: [fp8_w8a16_gemm_triton(x, q, s, 128, split_k=rule_split)
                                                for _, q, s in ws], fp8_bytes))
    variants.append(("nvfp4_w4a16", lambda: [nvfp4_w4a16_gemm_triton(x, *f) for f in fp4], fp4_bytes))
    tiles = {}
    if m >= SWAP_M:
        # what the engine runs at these rows: the transposed kernel at its defaults, NVFP4's
        # dispatch (transposed or tile by the weight's rows); and W8A8 (activations quantized per
        # token group, then the E4M3 x E4M3 GEMM; "_scaled_mm": cuBLAS's block-scaled GEMM) as the
        # alternative for the wider batches
        variants.append(("fp8_w8a16_swap", lambda: [fp8_w8a16_swap_triton(x, q, s, 128) for _, q, s in ws], fp8_bytes))
        variants.append(("nvfp4_dispatch", lambda: [nvfp4_linear(x, *f) for f in fp4], fp4_bytes))
        variants.append(("fp8_w8a8", lambda: [fp8_w8a8_gemm_triton(*per_token_group_quant_triton(x), q, s, 128, x.dtype)
                                              for _, q, s in ws], fp8_bytes))
        variants.append(("fp8_w8a8_scaled_mm", lambda: [fp8_linear_scaled_mm(x, q, s) for _, q, s in ws], fp8_bytes))
        variants.append(("fp8_w8a8_bn64", lambda: [fp8_w8a8_gemm_triton(*per_token_group_quant_triton(x), q, s, 128,
                                                                        x.dtype, block_n_tile=64) for _, q, s in ws],
                         fp8_bytes))
        for bn_t, warps, stages in SWAP_TILES:
            for split in SWAP_SPLITS:
                variant = f"fp8_w8a16_swap_bn{bn_t}_w{warps}_st{stages}" + (f"_s{split}" if split > 1 else "")
                splits[variant] = split
                tiles[variant] = dict(block_n_tile=bn_t, num_warps=warps, num_stages=stages, split_k=split)
                variants.append((variant, lambda t=tiles[variant]: [fp8_w8a16_swap_triton(x, q, s, 128, **t)
                                                                    for _, q, s in ws], fp8_bytes))
        for bn_t, warps, stages in NVFP4_SWAP_TILES:
            for split in NVFP4_SWAP_SPLITS:
                variant = f"nvfp4_w4a16_swap_bn{bn_t}_w{warps}_st{stages}" + (f"_s{split}" if split > 1 else "")
                splits[variant] = split
                tiles[variant] = dict(block_n_tile=bn_t, num_warps=warps, num_stages=stages, split_k=split)
                variants.append((variant, lambda t=tiles[variant]: [nvfp4_w4a16_swap_triton(x, *f, **t) for f in fp4],
                                 fp4_bytes))
    if m in GEMV_M:
        gbn, gbk, gsplit, gwarps = pick_fp8_gemv_tile(n, k, sms, m)
        tiles["fp8_gemv"] = dict(block_n_tile=gbn, block_k=gbk, split_k=gsplit, num_warps=gwarps, num_stages=3)
        splits["fp8_gemv"] = gsplit
        variants.append(("fp8_gemv", lambda: [fp8_gemv_triton(x, q, s, 128) for _, q, s in ws], fp8_bytes))
        for gt in GEMV_SWEEP:
            variant = "fp8_gemv_bn{}_bk{}_s{}_w{}_st{}".format(*gt)
            splits[variant] = gt[2]
            variants.append((variant, lambda gt=gt: [fp8_gemv_triton(x, q, s, 128, *gt) for _, q, s in ws], fp8_bytes))
        if m <= 2:  # the GEMV with the RMSNorm before it joined in (qkv and gate_up at batch 1), the GEMV
            # adding its output to the residual and preparing the next norm (o and down), the one after it
            g, gn, res = (torch.ones(k, device=dev, dtype=x.dtype), torch.ones(n, device=dev, dtype=x.dtype),
                          torch.zeros(m, n, device=dev, dtype=x.dtype))
            parts = torch.ones(512, 4, device=dev)
            variants.append(("fp8_norm_gemv", lambda: [fp8_norm_gemv_triton(x, x, g, 1e-5, q, s, 128)
                                                       for _, q, s in ws], fp8_bytes))
            variants.append(("fp8_gemv_residual", lambda: [fp8_gemv_residual_triton(x, q, s, 128, res, gn)
                                                           for _, q, s in ws], fp8_bytes))
            variants.append(("fp8_prenormed_gemv", lambda: [fp8_prenormed_gemv_triton(x, parts, 1e-5, q, s, 128)
                                                            for _, q, s in ws], fp8_bytes))
        if m == 1:
            tiles["fp8_gemv_st1"] = dict(tiles["fp8_gemv"], num_stages=1)
            splits["fp8_gemv_st1"] = gsplit
            variants.append(("fp8_gemv_st1", lambda: [fp8_gemv_triton(x, q, s, 128, num_stages=1) for _, q, s in ws],
                             fp8_bytes))
        fbn, fbk, fsplit = pick_nvfp4_gemv_tile(n, k, sms)
        tiles["nvfp4_gemv"] = dict(block_n_tile=fbn, block_k=fbk, split_k=fsplit, num_stages=3)
        splits["nvfp4_gemv"] = fsplit
        variants.append(("nvfp4_gemv", lambda: [nvfp4_gemv_triton(x, *f) for f in fp4], fp4_bytes))
    if keep is not None:
        variants = [v for v in variants if v[0] == "bf16_cublas" or keep(v[0])]
    for variant, fn, nbytes in variants:
        try:
            t = graph_ms(fn) * 1e3 / copies
        except Exception as exc:  # reported, not fatal: the other variants still run
            row = {"phase": "decode", "shape": name, "n": n, "k": k, "m": m, "variant": variant,
                   "error": f"{type(exc).__name__}: {exc}"[:300]}
            print(json.dumps(row), flush=True)
            rows.append(row)
            continue
        row = {"phase": "decode", "shape": name, "n": n, "k": k, "m": m, "variant": variant, "us": round(t, 2),
               "tb_s": round(nbytes / t / 1e6, 3), "pct_roofline": round(100 * nbytes / t / 1e6 / HBM_TB_S, 1)}
        if variant in ("fp8_w8a16", "fp8_w8a16_rule"):
            row["tile"] = dict(block_n_tile=bn, k_unroll=ku, num_stages=ns, split_k=splits.get(variant, 1))
        if variant in tiles:
            row["tile"] = tiles[variant]
        if splits.get(variant, 1) > 1:
            row["workspace_bytes"] = 2 * splits[variant] * m * n * 4
        print(json.dumps(row), flush=True)
        rows.append(row)
    bf16_us = next((r["us"] for r in rows if r["variant"] == "bf16_cublas" and "us" in r), None)
    for row in rows:
        if bf16_us is not None and row["variant"] != "bf16_cublas" and "us" in row:
            row["x_vs_bf16"] = round(bf16_us / row["us"], 3)
    for variant, why in skipped.items():
        row = {"phase": "decode", "shape": name, "n": n, "k": k, "m": m, "variant": variant, "skipped": why}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def make_rows(dev, args) -> list[dict]:
    phases, shapes = set(args.phases.split(",")), args.shapes.split(",")
    unknown = sorted((phases - {"prefill", "decode"}) | (set(shapes) - set(SHAPES)))
    if unknown:
        raise SystemExit(f"--phases / --shapes: unknown {unknown}; phases prefill, decode; shapes {', '.join(SHAPES)}")
    decode_m = [int(v) for v in args.decode_m.split(",")] if args.decode_m else DECODE_M
    prefixes = args.variants.split(",") if args.variants else None
    keep = (lambda v: any(v.startswith(p[:-1]) if p.endswith("*") else v == p for p in prefixes)) if prefixes else None
    rows = []
    for name in shapes:
        n, k = SHAPES[name]
        for m in PREFILL_M if "prefill" in phases else ():
            rows += prefill(name, n, k, m, dev)
        for m in decode_m if "decode" in phases else ():
            rows += decode(name, n, k, m, dev, keep)
    return rows


def configure(ap) -> None:
    ap.add_argument("--phases", default="prefill,decode", help="comma-separated: prefill, decode")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--decode-m", default=None, help=f"comma-separated decode rows (default {DECODE_M})")
    ap.add_argument("--variants", default=None,
                    help="comma-separated decode variants, a trailing * a name prefix, e.g. "
                         "fp8_w8a16,fp8_w8a16_swap*,nvfp4_w4a16 (default all; bf16_cublas always runs, the peer)")


def main() -> None:
    kernel_bench_main("fp8_gemm", make_rows, configure, shapes=SHAPES, prefill_m=PREFILL_M, decode_m=DECODE_M,
                      tiles=TILES, decode_tiles=DECODE_TILES, decode_splits=DECODE_SPLITS, gemv_m=GEMV_M,
                      gemv_sweep=GEMV_SWEEP, swap_m=SWAP_M, swap_tiles=SWAP_TILES, swap_splits=SWAP_SPLITS,
                      nvfp4_swap_tiles=NVFP4_SWAP_TILES, nvfp4_swap_splits=NVFP4_SWAP_SPLITS, hbm_tb_s=HBM_TB_S)


if __name__ == "__main__":
    main()
