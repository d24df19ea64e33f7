"""Decode projections with bf16 weights on one GPU: cuBLAS (F.linear) against the Triton GEMV
(ops/gemv) at its default tile and a sweep of tiles, at the decode shapes of llama-8b,
qwen4exp-small and qwen4exp-flash-12l, 1, 2 and 4 rows (the dispatch takes the GEMV at the row
counts measured faster: ops.gemv.GEMV_ROWS). Each call is timed as a CUDA-graph replay
cycling over enough weight copies to exceed the L2; TB/s counts the weight bytes read. Prints
JSON (one line per case, then the document with a per-shape summary).

    PYTHONPATH=src python benchmarks/bench_gemv.py [--rows 1,2,4] [--models ...] [--no-sweep] [--out f.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from qsaserve.bench.common import emit_report, kernel_report
from qsaserve.bench.gpu_timing import graph_ms
from qsaserve.ops.device import num_sms
from qsaserve.ops.gemv.triton_gemv import gemv, pick_gemv_tile

SHAPES = {  # (N, K) of each projection a decode step runs with plain weights
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                 "lm_head": (128256, 4096)},
    "qwen4exp-small": {"gdn_in": (12352, 2048), "gdn_out": (2048, 4096), "qsa_in": (11392, 2048),
                       "qsa_o": (2048, 4096), "moe_in": (1089, 2048), "shared_down": (2048, 512),
                       "hc_down": (320, 8192), "hc_inject": (4, 8192), "hc_up": (8192, 320),
                       "lm_head": (151936, 2048)},
    "qwen4exp-flash-12l": {"gdn_in": (16480, 2560), "gdn_out": (2560, 6144), "qsa_in": (13952, 2560),
                           "qsa_o": (2560, 6144), "moe_in": (1793, 2560), "shared_down": (2560, 640),
                           "hc_down": (320, 10240), "hc_up": (10240, 320), "lm_head": (248320, 2560)},
}
# (block_n, block_k, num_warps) tried at the default split and, for narrow outputs, at half / double it
TILES = [(8, 512, 2), (8, 1024, 2), (8, 256, 2), (16, 512, 4), (4, 512, 1), (4, 1024, 2), (16, 256, 2)]
L2_BYTES = 256 << 20  # cycle through at least this many weight bytes per timed call


def case(model: str, name: str, n: int, k: int, rows: int, dev, sweep: bool) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(n + k)
    nbytes = n * k * 2
    copies = max(1, -(-L2_BYTES // nbytes))
    weights = [(torch.randn(n, k, generator=gen, device=dev) * k**-0.5).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, generator=gen, device=dev).to(torch.bfloat16)
    want = F.linear(x, weights[0])
    bn, bk, split, warps = pick_gemv_tile(n, k, num_sms(dev))
    variants = [("cublas", None), ("triton_default", (bn, bk, split, warps))]
    if sweep:
        splits = sorted({split, max(1, split // 2), split * 2}) if split > 1 or n < 4096 else [1]
        variants += [(f"bn{b}_bk{kk}_w{w}_s{s}", (b, kk, s, w)) for b, kk, w in TILES for s in splits
                     if (b, kk, s, w) != (bn, bk, split, warps) and kk <= max(128, 2 * k) and k // s >= 128]
    out = []
    for label, tile in variants:
        if tile is None:
            def run():
                for w in weights:
                    F.linear(x, w)
            got = want
        else:
            kw = dict(block_n=tile[0], block_k=tile[1], split_k=tile[2], num_warps=tile[3])

            def run(kw=kw):
                for w in weights:
                    gemv(x, w, **kw)
            got = gemv(x, weights[0], **kw)
        us = graph_ms(run) * 1e3 / copies
        row = {"model": model, "proj": name, "n": n, "k": k, "rows": rows, "variant": label,
               "tile": None if tile is None else dict(zip(("block_n", "block_k", "split_k", "num_warps"), tile)),
               "us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3),
               "max_diff_vs_cublas": float((got.float() - want.float()).abs().max())}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--no-sweep", action="store_true", help="cuBLAS and the default tile only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    start = time.perf_counter()
    rows = [r for m in (int(v) for v in args.rows.split(",")) for model in args.models.split(",")
            for name, (n, k) in SHAPES[model].items() for r in case(model, name, n, k, m, dev, not args.no_sweep)]
    summary = []
    for key in dict.fromkeys((r["model"], r["proj"], r["rows"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["proj"], r["rows"]) == key]
        cublas = next(r for r in mine if r["variant"] == "cublas")
        default = next(r for r in mine if r["variant"] == "triton_default")
        best = min((r for r in mine if r["variant"] != "cublas"), key=lambda r: r["us"])
        summary.append({"model": key[0], "proj": key[1], "rows": key[2], "cublas_us": cublas["us"],
                        "default_us": default["us"], "default_over_cublas": round(cublas["us"] / default["us"], 3),
                        "best": best["variant"], "best_us": best["us"], "best_tb_s": best["tb_s"]})
    report = kernel_report("gemv_decode", rows=rows, summary=summary, wall_s=round(time.perf_counter() - start, 1))
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
