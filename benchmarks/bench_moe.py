"""Routed-expert decode (ops/moe) on one GPU: the Triton kernels at several row-block sizes against
the torch path (`ops.moe.reference.moe_experts_sync_free`), at qwen4exp-small's expert shapes (64
experts, top 8, H 2048, I 512; I 256 is its TP2 shard). Times are CUDA-graph replays cycling over
LAYERS weight sets (more than the L2 holds), per call; TB/s counts the weight bytes of the experts
the batch actually chose. Prints JSON (one line per case, then the document).

    PYTHONPATH=src python benchmarks/bench_moe.py [--batches 1,4,16,64] [--inters 512,256] [--out f.json]
"""
from __future__ import annotations

import json

import torch

from qsaserve.bench.common import kernel_bench_main
from qsaserve.bench.gpu_timing import graph_ms
from qsaserve.ops.moe import moe_experts_sync_free
from qsaserve.ops.moe.triton_moe import BLOCK_N_CHOICES, moe_experts_decode_triton, pick_block_n

# (gate/up block_k, down block_k, num_stages, num_warps) at the default row blocks: "legacy" is the
# kernels' launch until 6cdf8dc (512 columns, 4 warps, no pipeline)
TILES = {"legacy": ((512, 512), 1, 4), "bk256_s3_w2": ((256, 512), 3, 2), "bk512_s3_w2": ((512, 512), 3, 2),
         "bk256_s2_w2": ((256, 512), 2, 2), "bk256_s3_w4": ((256, 512), 3, 4), "bk128_s4_w1": ((128, 256), 4, 1),
         "bk256_s3_w1": ((256, 256), 3, 1)}
from qsaserve.ops.device import num_sms

EXPERTS, TOP_K, HIDDEN = 64, 8, 2048
LAYERS = 4  # 4 x 64 experts x 6 MiB = 1.5 GiB of weights, far beyond the L2
BATCHES = (1, 4, 16, 64)


def case(batch: int, inter: int, dev) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(batch)
    x = torch.randn(batch, HIDDEN, generator=gen, device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen, device=dev)[:TOP_K] for _ in range(batch)])
    w = torch.softmax(torch.randn(batch, TOP_K, generator=gen, device=dev), -1).to(torch.bfloat16)
    layers = [((torch.randn(EXPERTS, 2 * inter, HIDDEN, generator=gen, device=dev) * 0.02).to(torch.bfloat16),
               (torch.randn(EXPERTS, HIDDEN, inter, generator=gen, device=dev) * 0.02).to(torch.bfloat16))
              for _ in range(LAYERS)]
    read = int(torch.unique(idx).numel()) * 3 * inter * HIDDEN * 2  # gate, up, down of each chosen expert
    sms = num_sms(dev)
    default = (pick_block_n(batch * TOP_K, inter, sms), pick_block_n(batch, HIDDEN, sms))
    # "dispatch": moe_experts_sync_free as the model calls it (these kernels at tiny batches, the
    # grouped GEMMs above: ops.moe.DECODE_KERNEL_MAX_TOKENS); the others force these kernels at the
    # given row blocks.
    variants = [("dispatch", None), ("default", default)] + [(f"bn{b}", (b, b)) for b in BLOCK_N_CHOICES]
    if batch <= 4:
        variants += [(name, default) for name in TILES]
    want = moe_experts_sync_free(x, idx, w, *layers[0])
    rows = []
    for name, block_n in variants:
        if block_n is None:
            def run():
                for gu, down in layers:
                    moe_experts_sync_free(x, idx, w, gu, down)
        else:
            bk, stages, warps = TILES.get(name, (None, None, None))
            kw = {} if bk is None else dict(block_k=bk, num_stages=stages, num_warps=warps)

            def run(block_n=block_n, kw=kw):
                for gu, down in layers:
                    moe_experts_decode_triton(x, idx, w, gu, down, block_n=block_n, **kw)
        got = want if block_n is None else moe_experts_decode_triton(x, idx, w, *layers[0], block_n=block_n, **kw)
        us = graph_ms(run) * 1e3 / LAYERS
        row = {"batch": batch, "inter": inter, "variant": name, "block_n": block_n, "us": round(us, 2),
               "tb_s": round(read / us / 1e6, 3), "max_diff_vs_dispatch": float((got.float() - want.float()).abs().max())}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    def configure(ap):
        ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
        ap.add_argument("--inters", default="512,256")

    def rows(dev, args):
        return [r for inter in map(int, args.inters.split(",")) for b in map(int, args.batches.split(","))
                for r in case(b, inter, dev)]

    kernel_bench_main("moe_decode", rows, configure,
                      shapes={"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "layers_cycled": LAYERS})


if __name__ == "__main__":
    main()
