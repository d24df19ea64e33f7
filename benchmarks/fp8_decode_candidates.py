"""FP8 paged-decode launch configs timed side by side with the default by
benchmarks/bench_attention.py (section fp8) and bench_fp8_decode_ab.py (--candidates); the GPU tests
(tests/ops/test_attention_triton_fp8.py) run each against the reference. Each was the default once
or was measured and not kept (figures in the bench_attention results files; docs/fp8.md summarizes
them). Importing this needs no Triton."""
from __future__ import annotations

from qsaserve.ops.attention.configs import DECODE_CONFIG_FP8, DecodeConfig

FP8_DECODE_CANDIDATES = {
    "bf16_dot_bn64": DecodeConfig(64, 4, 3, 2, fp8_dot="query", fp8_permute_v=False),
    "f16_bn64_s3": DecodeConfig(64, 4, 3, 4),
    "f16_bn128_s2": DecodeConfig(128, 4, 2, 4),
    "f16_bn128_s2_c3": DecodeConfig(128, 4, 2, 3),
    "f16_bn128_s3": DecodeConfig(128, 4, 3, 3),  # the default before the register cap
    "f16_bn128_s3_c2": DecodeConfig(128, 4, 3, 2),
    "f16_bn128_s4": DecodeConfig(128, 4, 4, 3),
    "f16_bn128_s5": DecodeConfig(128, 4, 5, 3),
    "f16_bn256_s2": DecodeConfig(256, 4, 2, 2),
    "f16_bn256_s3": DecodeConfig(256, 4, 3, 2),
    # Where the FP8 kernel's time goes (3.3-3.5 TB/s vs bf16's 4.3-4.45), neither is it: V read
    # without the column permute runs 1.26x at 128K (the permute earns ~0.3x), and the same tile
    # over 8 warps 0.77x (attention_fp8_h200_2026-11-30_b25eee6.json).
    "f16_bn128_s3_noperm": DecodeConfig(128, 4, 3, 3, fp8_permute_v=False),
    "f16_bn128_s3_w8": DecodeConfig(128, 8, 3, 2),
    # Nsight Compute on the uncapped kernel at 128K (c550cf3): 153 registers a thread hold it to 3
    # programs per SM (18% occupancy, 0.81 eligible warps per scheduler, 73% of DRAM peak; bf16's
    # kernel: 126 registers, 4 programs, 94%). These cap the registers so 4 programs fit.
    "f16_bn128_s3_r128": DecodeConfig(128, 4, 3, 4, maxnreg=128, min_waves=0.95),  # the default before V's asm
    "f16_bn128_s4_r128": DecodeConfig(128, 4, 4, 4, maxnreg=128),
    "f16_bn64_s3_r128": DecodeConfig(64, 4, 3, 4, maxnreg=128),
    # Two warps a program: the same warps per SM in more, smaller programs, each with its own load
    # pipeline (shared memory allows ~5 of the 128-key ones per SM, registers 6).
    "f16_bn128_s3_w2": DecodeConfig(128, 2, 3, 5),
    "f16_bn128_s2_w2": DecodeConfig(128, 2, 2, 6),
    "f16_bn64_s3_w2": DecodeConfig(64, 2, 3, 8),
    # V's E4M3 -> fp16 by inline asm (fp8_v_convert), the default.
    "f16_bn128_s3_r128_asm": DECODE_CONFIG_FP8,
}
