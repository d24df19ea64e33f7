"""Routed experts (ops/moe) on one GPU at any step size: the grouped GEMMs (triton_grouped.py)
against the torch loop over experts (`reference.moe_experts`, the pre-grouped prefill path: one
host sync per layer) and the decode kernels (triton_moe.py), at qwen4exp-small's experts (64, top
8) and the released checkpoint's (512, top 10), H 2048, I 512, bf16, uniform random routing.

Rows: `variant` is "dispatch" (ops.moe.moe_experts as the model calls it: the decode kernels up
to DECODE_KERNEL_MAX_TOKENS, else the grouped GEMMs), "grouped", "decode" (forced; up to 256
tokens), "grouped_fp8" (the same weights in block FP8, activations quantized per token-group of
128) or "torch_loop". `us` is a CUDA-graph replay per call cycling over several weight sets (more
than the L2 holds); `us_eager` the same calls launched eagerly (what a prefill step pays, host
launch cost included; the torch loop has only this). TB/s counts the weight bytes of the experts
the step chose (1 byte per weight in FP8; its 128 x 128 scales are negligible), TFLOP/s
2 x choices x 3 x I x H. DECODE_KERNEL_MAX_TOKENS should be the largest token count where
"decode" beats "grouped". Prints JSON (one line per row, then the document).

    PYTHONPATH=src python benchmarks/bench_moe_grouped.py [--out f.json]
"""
from __future__ import annotations

import json

import torch

from qsaserve.bench.common import kernel_bench_main
from qsaserve.bench.gpu_timing import event_ms, graph_ms
from qsaserve.ops.device import num_sms
from qsaserve.ops.moe import block_fp8, moe_experts, reference, uses_decode_kernels
from qsaserve.ops.moe.grouped_config import step_configs
from qsaserve.ops.moe.triton_grouped import moe_experts_grouped_triton
from qsaserve.ops.moe.triton_moe import moe_experts_decode_triton

HIDDEN, INTER = 2048, 512
MODELS = ((64, 8, 4), (512, 10, 2))  # (experts, top-k, weight sets cycled: 1.5 GiB and 6 GiB)
TOKENS = (1, 4, 16, 64, 256, 1024, 8192)
DECODE_MAX_TOKENS = 256  # beyond, the decode kernels re-read each expert per token-choice for seconds


def case(experts: int, top_k: int, layers: int, tokens: int, dev) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen, device=dev).to(torch.bfloat16)
    w, idx = torch.softmax(torch.randn(tokens, experts, generator=gen, device=dev), -1).topk(top_k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    sets = [((torch.randn(experts, 2 * INTER, HIDDEN, generator=gen, device=dev) * 0.02).to(torch.bfloat16),
             (torch.randn(experts, HIDDEN, INTER, generator=gen, device=dev) * 0.02).to(torch.bfloat16))
            for _ in range(layers)]
    read = int(torch.unique(idx).numel()) * 3 * INTER * HIDDEN * 2
    flops = 2 * tokens * top_k * 3 * INTER * HIDDEN
    want = reference.moe_experts(x, idx, w, *sets[0])
    variants = {"dispatch": moe_experts, "grouped": moe_experts_grouped_triton, "torch_loop": reference.moe_experts}
    if tokens <= DECODE_MAX_TOKENS:
        variants["decode"] = moe_experts_decode_triton
    variants["grouped_fp8"] = "fp8"
    fp8_sets = []
    for gu, down in sets:  # block-FP8 copies of the same weights (half the bytes)
        (gq, gs), (dq, ds) = block_fp8.quantize_blocks(gu), block_fp8.quantize_blocks(down)
        fp8_sets.append((gq, dq, dict(w13_scale=gs, w2_scale=ds)))
    cfg = step_configs(tokens * top_k, experts, HIDDEN, INTER, 2, num_sms(dev))
    rows = []
    for name, fn in variants.items():
        if fn == "fp8":
            def run():
                for gq, dq, scales in fp8_sets:
                    moe_experts_grouped_triton(x, idx, w, gq, dq, **scales)
            gq, dq, scales = fp8_sets[0]
            got = moe_experts_grouped_triton(x, idx, w, gq, dq, **scales)
        else:
            def run(fn=fn):
                for gu, down in sets:
                    fn(x, idx, w, gu, down)
            got = fn(x, idx, w, *sets[0])
        slow = name == "torch_loop" or tokens >= 1024
        eager = event_ms(run, iters=3 if slow else 20, repeats=3) * 1e3 / layers
        graphed = None if name == "torch_loop" else graph_ms(run) * 1e3 / layers
        us = graphed if graphed is not None else eager
        weight_bytes = read // 2 if name == "grouped_fp8" else read
        row = {"experts": experts, "top_k": top_k, "tokens": tokens, "variant": name,
               "us": round(us, 2), "us_eager": round(eager, 2), "tb_s": round(weight_bytes / us / 1e6, 3),
               "tflop_s": round(flops / us / 1e6, 2),
               "max_diff_vs_torch_loop": float((got.float() - want.float()).abs().max()),
               "grouped_tiles": [[c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages] for c in cfg]
               if name == "grouped" or name == "dispatch" and not uses_decode_kernels(tokens, top_k, experts) else None}
        print(json.dumps(row), flush=True)
        rows.append(row)
    del sets, fp8_sets
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    kernel_bench_main("moe_grouped", lambda dev: [r for e, k, layers in MODELS for t in TOKENS
                                                  for r in case(e, k, layers, t, dev)],
                      shapes={"models": [{"experts": e, "top_k": k, "layers_cycled": n} for e, k, n in MODELS],
                              "hidden": HIDDEN, "inter": INTER, "tokens": list(TOKENS), "dtype": "bfloat16"})


if __name__ == "__main__":
    main()
