"""One bf16 and one FP8 E4M3 paged decode launch at batch 8, 128K context (bench_attention's fp8
shapes), for Nsight Compute: where the FP8 kernel's bandwidth goes.

    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats python benchmarks/profile_fp8_decode.py

Each kind runs twice (a warm-up that also builds the kernel, then the profiled launch), bf16 first.
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_attention import D, DT, HKV, HQ, make_meta, rand_  # noqa: E402

from qsaserve.ops.attention import configs, triton_paged as tp  # noqa: E402


def main() -> int:
    b, ctx, page = 8, 131072, 16
    meta, nb = make_meta([1] * b, [ctx] * b, page, "cuda", seed=ctx)
    q = rand_(torch.empty(b, HQ, D, dtype=DT, device="cuda"))
    out = torch.empty_like(q)
    cache = rand_(torch.empty(2, nb, page, HKV, D, dtype=DT, device="cuda"))
    cache8 = (cache / 0.05).to(torch.float8_e4m3fn)
    ks = vs = torch.tensor(0.05, device="cuda")
    for _ in range(2):
        tp.paged_attention(q, cache, meta, D**-0.5, out=out)
    for _ in range(2):
        tp.paged_attention(q, cache8, meta, D**-0.5, out=out, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    print("bf16", configs.decode_config(b * HKV), "fp8", configs.decode_config(b * HKV, fp8=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
