"""Batch-1 (and batch-4) decode projections on one GPU: cuBLAS (F.linear) against the Triton GEMV
(ops/gemv) at several output-block sizes, at llama-1b and llama-8b shapes. Each call is timed as
a CUDA-graph replay cycling over enough weight copies to exceed the L2; TB/s counts the weight
bytes read. Prints JSON (one line per case, then the document).

    PYTHONPATH=src python benchmarks/bench_gemv.py [--out f.json]
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
from qsaserve.ops.gemv.triton_gemv import gemv, pick_block_n

SHAPES = {  # (N, K) of each projection
    "llama-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                 "lm_head": (128256, 2048)},
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                 "lm_head": (128256, 4096)},
}
L2_BYTES = 256 << 20  # cycle through at least this many weight bytes per timed call


def case(model: str, name: str, n: int, k: int, rows: int, dev) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(n + k)
    nbytes = n * k * 2
    copies = max(1, -(-L2_BYTES // nbytes))
    weights = [(torch.randn(n, k, generator=gen, device=dev) * k**-0.5).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, generator=gen, device=dev).to(torch.bfloat16)
    want = F.linear(x, weights[0])
    default = pick_block_n(n, num_sms(dev))
    variants = [("cublas", None), ("triton_default", default)] + [(f"triton_bn{b}", b) for b in (16, 8, 4, 2)]
    out = []
    for label, bn in variants:
        if bn is None:
            def run():
                for w in weights:
                    F.linear(x, w)
        else:
            def run(bn=bn):
                for w in weights:
                    gemv(x, w, block_n=bn)
        got = want if bn is None else gemv(x, weights[0], block_n=bn)
        us = graph_ms(run) * 1e3 / copies
        row = {"model": model, "proj": name, "n": n, "k": k, "rows": rows, "variant": label, "block_n": bn,
               "us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3),
               "max_diff_vs_cublas": float((got.float() - want.float()).abs().max())}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    start = time.perf_counter()
    rows = [r for m in (int(v) for v in args.rows.split(",")) for model, projs in SHAPES.items()
            for name, (n, k) in projs.items() for r in case(model, name, n, k, m, dev)]
    best = {}
    for r in rows:
        key = (r["model"], r["proj"], r["rows"])
        if r["variant"] != "cublas" and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    summary = [{"model": m, "proj": p, "rows": n,
                "cublas_tb_s": next(r["tb_s"] for r in rows if (r["model"], r["proj"], r["rows"]) == (m, p, n)
                                    and r["variant"] == "cublas"),
                "best_triton": b["variant"], "best_triton_tb_s": b["tb_s"]} for (m, p, n), b in best.items()]
    report = kernel_report("gemv_decode", rows=rows, summary=summary, wall_s=round(time.perf_counter() - start, 1))
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
