"""Launch configurations of the paged-attention kernels and the decode split plan (pure Python:
importing this needs no Triton). Why each default is what it is: docs/benchmarks.md ("Kernel
launch choices") and docs/fp8.md ("Decode kernel speed"); the FP8 candidates the benchmark times
beside the default are in benchmarks/fp8_decode_candidates.py."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeConfig:
    """Decode launch parameters. The fp8_* fields apply to FP8 E4M3 pages only:
    fp8_dot "fp16" dequantizes E4M3 tiles to fp16 (one native conversion per pair on sm89+) and
    runs both dots in fp16, q pre-scaled (decode_triton._scaled_f16); "query" converts to the query
    dtype (for bf16 that goes through fp32, several instructions per value). fp8_permute_v reads V
    32 bits per key row instead of one byte (decode_triton._permute_cols). fp8_v_convert (fp16
    dots): how V becomes fp16, "cast" (the compiler's conversion) or "asm" (_e4m3_to_f16_asm). The
    block-table load takes one pipeline stage, so num_stages 5 double-buffers the K/V tiles and 3
    single-buffers them."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 2  # resident programs per SM the split heuristic plans for
    fp8_dot: str = "fp16"
    fp8_permute_v: bool = True
    fp8_v_convert: str = "cast"  # V's E4M3 -> fp16: "cast" or "asm" (decode_triton._e4m3_to_f16_asm)
    maxnreg: int | None = None  # cap on registers per thread (ptxas .maxnreg): more resident programs per SM
    min_waves: float = 1.0  # the split plan's grid must fill this much of one wave (num_decode_splits)

    def __post_init__(self):
        if self.fp8_dot not in ("fp16", "query"):
            raise ValueError(f"fp8_dot: must be 'fp16' or 'query', got {self.fp8_dot!r}")
        if self.fp8_v_convert not in ("cast", "asm"):
            raise ValueError(f"fp8_v_convert: must be 'cast' or 'asm', got {self.fp8_v_convert!r}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n: must be a power of two >= 16, got {self.block_n}")


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


DECODE_CONFIG = DecodeConfig()
# Few (seq, kv_head) pairs (batch 1-2): each program streams a long split, and longer tiles keep
# more bytes in flight per SM; from batch 8 on, 64-token tiles win (docs/benchmarks.md).
DECODE_CONFIG_FEW = DecodeConfig(block_n=128, num_warps=4, num_stages=3, ctas_per_sm=1)
FEW_PAIRS = 16
# FP8 pages, any batch: 128-key tiles (half of bf16's bytes, so twice the keys per tile), registers
# capped at 128 so 4 programs fit per SM (see decode_triton._maxnreg), a split plan that counts 0.95
# of a wave as full (batch 8 x 8 KV heads: 8 splits, 512 programs in 528 slots), and V converted
# by inline asm on 32-bit words.
DECODE_CONFIG_FP8 = DecodeConfig(block_n=128, num_warps=4, num_stages=3, ctas_per_sm=4, maxnreg=128, min_waves=0.95,
                                fp8_v_convert="asm")
# The 4-warp prefill tile is within noise of the fastest tried, with 2/3 of its shared memory.
PREFILL_CONFIG = {64: PrefillConfig(128, 64, 4, 3), 128: PrefillConfig(128, 64, 4, 3)}
MAX_SPLITS = 128
MIN_SPLIT_TOKENS = 256


def prefill_config(head_dim: int) -> PrefillConfig:
    return PREFILL_CONFIG[64] if head_dim <= 64 else PREFILL_CONFIG[128]


def decode_config(pairs: int, fp8: bool = False) -> DecodeConfig:
    if fp8:
        return DECODE_CONFIG_FP8
    return DECODE_CONFIG_FEW if pairs <= FEW_PAIRS else DECODE_CONFIG


@functools.lru_cache(maxsize=4096)
def num_decode_splits(pairs: int, max_len: int, num_sms: int, block_n: int, ctas_per_sm: int = 2,
                      min_waves: float = 1.0) -> int:
    """Splits per (seq, kv_head) so the grid fills the GPU in nearly whole waves.

    Fewest splits whose wave efficiency (programs / slots, over the waves started) is >= 0.9 and
    that fill at least min_waves of one wave; splits stay >= MIN_SPLIT_TOKENS long. Batch 256 at
    2K gets 1 split, batch 1 at 256K (8 kv heads) about 33."""
    limit = max(1, min(MAX_SPLITS, -(-max_len // max(MIN_SPLIT_TOKENS, block_n))))
    slots = num_sms * ctas_per_sm
    best, best_eff = 1, 0.0
    for s in range(1, limit + 1):
        waves = pairs * s / slots
        eff = waves / math.ceil(waves)
        if waves >= min_waves and eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best
