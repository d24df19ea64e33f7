"""Block-FP8 GEMMs at decode and verify rows (M = 8 ... 256) on one GPU, at llama-8b's projection
shapes (N x K: fused qkv 6144 x 4096, o 4096 x 4096, fused gate_up 28672 x 4096, down 4096 x
14336), against bf16 cuBLAS (F.linear, the peer) in the same run:

* "w8a8_swap": the transposed W8A8 GEMM (ops/fp8_gemm/triton_w8a8_swap.py) at its default launch
  (pick_w8a8_swap_tile), its activation quantization included (what fp8_linear runs);
  "w8a8_swap_bnB_wW_stS_sN": the GEMM alone (operands quantized beforehand) at SWEEP x SPLITS;
* what ran there before: "w8a16_swap" (triton_swap_ab.py, bf16 activations, up to 64 rows),
  "w8a8_tile" (quantization + triton_gemm's W8A8 GEMM, gate_up's path from 2 rows) and
  "scaled_mm" (quantization + cuBLAS's block-scaled GEMM, the path above 64 rows);
* "fp8_linear": ops.fp8_gemm.fp8_linear, whatever the dispatch takes at that row count;
* "act_quant": the per-token-group quantization alone.

TB/s counts the FP8 weight and scale bytes read (bf16: its weight bytes); x_vs_bf16 is bf16's time
over the variant's. Times are CUDA-graph replays cycling over enough weight copies to exceed the
L2. Prints JSON (one line per case, then the document).

    PYTHONPATH=src python benchmarks/bench_fp8_swap.py [--out f.json] [--shapes qkv,o] [--m 8,64,128]
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from qsaserve.bench.common import kernel_bench_main
from qsaserve.bench.gpu_timing import graph_ms
from qsaserve.ops.fp8_gemm import fp8_linear
from qsaserve.ops.fp8_gemm.scaled_mm import fp8_linear_scaled_mm
from qsaserve.ops.fp8_gemm.triton_gemm import fp8_w8a8_gemm_triton
from qsaserve.ops.fp8_gemm.triton_quant import per_token_group_quant_triton
from qsaserve.ops.fp8_gemm.triton_swap_ab import fp8_w8a16_swap_triton
from qsaserve.ops.fp8_gemm.triton_w8a8_swap import fp8_w8a8_swap_triton

from bench_fp8_gemm import L2_BYTES, SHAPES, _weights  # the same shapes and weight copies (benchmarks/ on sys.path)

M = (8, 16, 32, 64, 128, 256)
SWEEP = ((64, 4, 3), (64, 4, 5), (128, 4, 4), (128, 8, 4))  # block_n_tile, num_warps, num_stages
SPLITS = (1, 2, 4, 8)


def case(name, n, k, m, dev) -> list[dict]:
    ws = _weights(n, k, dev, max(2, -(-2 * L2_BYTES // (n * k))))
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    xq, xs = per_token_group_quant_triton(x)
    fp8_bytes = n * k + ws[0][2].numel() * 4
    runs = {
        "bf16_cublas": (lambda: [F.linear(x, w) for w, _, _ in ws], 2 * n * k),
        "fp8_linear": (lambda: [fp8_linear(x, q, s, 128) for _, q, s in ws], fp8_bytes),
        "w8a8_swap": (lambda: [fp8_w8a8_swap_triton(*per_token_group_quant_triton(x), q, s, 128, x.dtype)
                               for _, q, s in ws], fp8_bytes),
        "w8a8_tile": (lambda: [fp8_w8a8_gemm_triton(*per_token_group_quant_triton(x), q, s, 128, x.dtype)
                               for _, q, s in ws], fp8_bytes),
        "scaled_mm": (lambda: [fp8_linear_scaled_mm(x, q, s) for _, q, s in ws], fp8_bytes),
        "act_quant": (lambda: [per_token_group_quant_triton(x) for _ in ws], 0),
    }
    if m <= 64:
        runs["w8a16_swap"] = (lambda: [fp8_w8a16_swap_triton(x, q, s, 128) for _, q, s in ws], fp8_bytes)
    tiles = {}
    for bn, warps, stages in SWEEP:
        for split in SPLITS:
            variant = f"w8a8_swap_bn{bn}_w{warps}_st{stages}_s{split}"
            tiles[variant] = dict(block_n_tile=bn, num_warps=warps, num_stages=stages, split_k=split)
            runs[variant] = (lambda t=tiles[variant]: [fp8_w8a8_swap_triton(xq, xs, q, s, 128, x.dtype, **t)
                                                       for _, q, s in ws], fp8_bytes)
    rows, us = [], {}
    for variant, (fn, nbytes) in runs.items():
        row = {"shape": name, "n": n, "k": k, "m": m, "variant": variant}
        try:
            t = graph_ms(fn) * 1e3 / len(ws)
        except Exception as exc:  # a launch that does not fit: reported, not fatal
            row["error"] = str(exc)[:200]
        else:
            us[variant] = t
            row.update(us=round(t, 2), tb_s=round(nbytes / t / 1e6, 3) if nbytes else None)
            if variant in tiles:
                row["tile"] = tiles[variant]
        rows.append(row)
    for row in rows:
        if "us" in row and row["variant"] != "bf16_cublas":
            row["x_vs_bf16"] = round(us["bf16_cublas"] / row["us"], 3)
        print(json.dumps(row), flush=True)
    swept = {v: t for v, t in us.items() if v in tiles}
    if swept:
        best = min(swept, key=swept.get)
        rows.append({"shape": name, "n": n, "k": k, "m": m, "variant": "best_swept", "best": best,
                     "us": round(swept[best], 2), "tile": tiles[best]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def make_rows(dev, args) -> list[dict]:
    shapes = args.shapes.split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; of {', '.join(SHAPES)}")
    ms = [int(v) for v in args.m.split(",")]
    return [row for name in shapes for m in ms for row in case(name, *SHAPES[name], m, dev)]


def configure(ap) -> None:
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--m", default=",".join(map(str, M)), help="comma-separated rows")


def main() -> None:
    kernel_bench_main("fp8_swap", make_rows, configure, shapes=SHAPES, m=M, sweep=SWEEP, splits=SPLITS)


if __name__ == "__main__":
    main()
