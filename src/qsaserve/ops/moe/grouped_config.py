"""Tile configurations of the grouped MoE GEMMs (triton_grouped.py), chosen by a fixed heuristic
over (token-choices, experts, N, K): no runtime autotuning, so the set of configurations a model
can hit is known at startup (`configs_for`) and the warm-up builds them all.

The token block BLOCK_M follows the mean token-choices per expert: decode-sized steps leave most
experts with 0-2 rows, where a 16-row block wastes the least MMA work and the step is bound by
reading expert weights (more pipeline stages keep more loads in flight); prefill-sized steps give
each expert hundreds of rows, where taller blocks re-read each weight tile fewer times."""
from __future__ import annotations

from dataclasses import dataclass

# (largest mean token-choices per expert, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
_TIERS = (
    (16, 16, 64, 128, 4, 4),
    (48, 32, 64, 128, 4, 4),
    (128, 64, 128, 64, 4, 3),
    (None, 128, 128, 64, 8, 3),
)
# shared memory one launch may plan for (sm_90 allows 227 KiB per block; leave room for the epilogue)
_SHARED_BUDGET = 192 * 1024
PROGRAMS_PER_SM = 2
FP8_BLOCK_K = 128


@dataclass(frozen=True)
class GroupedConfig:
    """One GEMM's tiles: BLOCK_M token-choice rows (the sort's padding unit, the same for both
    GEMMs of a step) x BLOCK_N output columns, stepping BLOCK_K over the reduction."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}: must be a power of 2 >= 16 (tl.dot's smallest tile), got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: must be a power of 2 <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: must be >= 1, got {self.num_stages}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tier(num_choices: int, num_experts: int) -> int:
    """Index into the tiers for a step of num_choices token-choices (tokens x top-k)."""
    mean = num_choices / max(1, num_experts)
    for i, (bound, *_rest) in enumerate(_TIERS):
        if bound is None or mean <= bound:
            return i
    raise AssertionError("the last tier has no bound")


def pick_config(num_choices: int, num_experts: int, n: int, k: int, elem_bytes: int, operands: int = 1,
                sms: int = 132, fp8: bool = False) -> GroupedConfig:
    """The tiles of one grouped GEMM: out [rows, n] = a [rows, k] @ w_e[n, k]^T over `operands`
    weight tiles per step (2: gate and up). Tiles shrink to the problem (never below 16) and
    stages drop until the A and weight tiles of all stages fit the shared-memory budget. In the
    first tier, where the GEMM only streams weights, BLOCK_N narrows until the grid's likely
    blocks (one per expert hit) give PROGRAMS_PER_SM programs per SM: fewer loads in flight
    would not read the weights at speed. fp8: block-FP8 weights (1 byte), BLOCK_K fixed at their
    128-channel scale block."""
    t = tier(num_choices, num_experts)
    _, bm, bn, bk, warps, stages = _TIERS[t]
    if fp8:
        bk = FP8_BLOCK_K
    bn = max(16, min(bn, _pow2_at_least(n)))
    if t == 0:
        while bn > 16 and min(num_experts, num_choices) * -(-n // bn) < PROGRAMS_PER_SM * sms:
            bn //= 2
    if not fp8:
        bk = max(16, min(bk, _pow2_at_least(k)))
    if operands == 2 and bm == 128:
        bn = min(bn, 64)  # two fp32 accumulators of 128 x 128 would take every register
    weight_bytes = 1 if fp8 else elem_bytes
    while stages > 1 and stages * (bm * elem_bytes + operands * bn * weight_bytes) * bk > _SHARED_BUDGET:
        stages -= 1
    return GroupedConfig(bm, bn, bk, warps, stages)


def step_configs(num_choices: int, num_experts: int, hidden: int, inter: int, elem_bytes: int,
                 sms: int = 132, fp8: bool = False) -> tuple[GroupedConfig, GroupedConfig]:
    """(gate/up GEMM, down GEMM) configurations of a step: [rows, H] -> [rows, I] with gate and up,
    then [rows, I] -> [rows, H]. elem_bytes: the activations' element size."""
    return (pick_config(num_choices, num_experts, inter, hidden, elem_bytes, operands=2, sms=sms, fp8=fp8),
            pick_config(num_choices, num_experts, hidden, inter, elem_bytes, sms=sms, fp8=fp8))


def configs_for(token_counts, top_k: int, num_experts: int, hidden: int, inter: int, elem_bytes: int,
                sms: int = 132, fp8: bool = False) -> dict[tuple[GroupedConfig, GroupedConfig], int]:
    """Every (gate/up, down) configuration steps of the given token counts take, each with the
    smallest count that takes it (what the warm-up runs)."""
    out: dict[tuple[GroupedConfig, GroupedConfig], int] = {}
    for n in sorted(token_counts):
        out.setdefault(step_configs(n * top_k, num_experts, hidden, inter, elem_bytes, sms, fp8), n)
    return out


def max_blocks(num_choices: int, num_experts: int, block_m: int) -> int:
    """A static bound on the BLOCK_M blocks of the expert-sorted rows: each expert with c > 0 rows
    takes ceil(c / block_m) <= (c + block_m - 1) / block_m blocks, and at most min(E, choices)
    experts have rows, so no host readback of the routing is needed to size the grids."""
    return (num_choices + min(num_experts, num_choices) * (block_m - 1)) // block_m


__all__ = ["PROGRAMS_PER_SM", "GroupedConfig", "configs_for", "max_blocks", "pick_config", "step_configs", "tier"]
