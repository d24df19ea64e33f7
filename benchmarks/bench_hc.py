"""A hyper-connection's up projection and stream mix at decode rows on one GPU: the joined
kernel (ops.hyper_connection.triton_hc.up_mix_joined) at its default launch and a sweep of
(columns, warps), and as the engine runs it (activating the down | inject GEMV's split-K partials
as it loads them, joined_activating), against the unjoined path it replaces (the GEMV for u, then the mix kernel) and
the u GEMV alone (the bandwidth peer: the same weight bytes, no mix). Shapes of qwen4exp-small
(4 streams x 2,048, low rank 320) and qwen4exp-flash-12l (4 x 2,560), 1, 2 and 4 rows. Each call is a
CUDA-graph replay cycling over enough weight copies to exceed the L2; TB/s counts the up weight's
bytes. Prints JSON.

    PYTHONPATH=src python benchmarks/bench_hc.py [--out f.json]
"""
from __future__ import annotations

import torch
import triton

from qsaserve.bench.common import kernel_bench_main
from qsaserve.bench.gpu_timing import graph_ms
from qsaserve.ops.gemv.triton_gemv import gemv
from qsaserve.ops.hyper_connection import triton_hc

SHAPES = {"qwen4exp-small": (4, 2048, 320), "qwen4exp-flash-12l": (4, 2560, 320)}  # (hc, H, low rank)
SWEEP = [(2, 2), (4, 2), (4, 4), (8, 4), (8, 8), (16, 8), (2, 1)]  # (columns, warps) a program
L2_BYTES = 256 << 20


def _unjoined(d, w, xn, hc, h):
    u = gemv(d, w)
    mixed = torch.empty((d.shape[0], h), dtype=d.dtype, device=d.device)
    triton_hc._mix_streams_kernel[(d.shape[0], triton.cdiv(h, 1024))](
        u, xn, mixed, h, u.stride(0), xn.stride(0), mixed.stride(0), HC=hc, BLOCK=1024, num_warps=4)
    return mixed


def make_rows(dev) -> list[dict]:
    rows = []
    for model, (hc, h, lr) in SHAPES.items():
        nbytes = hc * h * lr * 2
        copies = max(1, -(-L2_BYTES // nbytes))
        gen = torch.Generator(device=dev).manual_seed(hc * h + lr)
        weights = [(torch.randn(hc * h, lr, generator=gen, device=dev) * lr**-0.5).to(torch.bfloat16)
                   for _ in range(copies)]
        for t in (1, 2, 4):
            d = torch.randn(t, lr, generator=gen, device=dev).to(torch.bfloat16)
            xn = torch.randn(t, hc * h, generator=gen, device=dev).to(torch.bfloat16)
            want = _unjoined(d, weights[0], xn, hc, h)
            # the engine's input: the down | inject GEMV's raw float32 split-K partials (2 planes)
            raw = torch.randn(2, t, lr + hc, generator=gen, device=dev) * 0.5
            inject = torch.empty(t, hc, dtype=torch.bfloat16, device=dev)
            variants = [("unjoined", lambda w: _unjoined(d, w, xn, hc, h)),
                        ("joined_activating", lambda w: triton_hc.up_mix_joined(raw, w, xn, hc, activate=True,
                                                                                 inject=inject)),
                        ("u_gemv_only", lambda w: gemv(d, w)),
                        ("joined_default", lambda w: triton_hc.up_mix_joined(d, w, xn, hc))]
            variants += [(f"joined_c{c}_w{nw}", lambda w, c=c, nw=nw: triton_hc.up_mix_joined(d, w, xn, hc, cols=c, num_warps=nw))
                         for c, nw in SWEEP if (c, nw) != (triton_hc.UP_MIX_COLS, triton_hc.UP_MIX_WARPS)]
            for label, fn in variants:
                got = fn(weights[0])

                def run(fn=fn):
                    for w in weights:
                        fn(w)
                us = graph_ms(run) * 1e3 / copies
                row = {"model": model, "rows": t, "hc": hc, "h": h, "low_rank": lr, "variant": label,
                       "us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3)}
                if label not in ("u_gemv_only", "joined_activating"):
                    row["max_diff_vs_unjoined"] = float((got.float() - want.float()).abs().max())
                print(row, flush=True)
                rows.append(row)
    return rows


if __name__ == "__main__":
    kernel_bench_main("hc_up_mix", make_rows, peer="the unjoined up GEMV + mix kernel, and the up GEMV alone, same run")
