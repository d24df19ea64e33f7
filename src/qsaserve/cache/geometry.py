"""Block geometry: the one place that decides how many tokens a KV page holds, how often the
prefix cache keeps a recurrent-state snapshot, and how a memory budget splits between KV pages
and snapshots.

What a page size must be a multiple of:
  * the QSA compress ratio r (`indexer_compress_ratio`): each page holds whole groups of r tokens,
    pooled into `block_size / r` block keys in the page's index page;
  * the DCP interleave I (`dcp_interleave_size`): a rank's run of I consecutive tokens never
    straddles two of its pages (parallel/dcp.py).
Nothing else: the paged kernels address a token as page * PAGE + offset for any PAGE, and the
ones that want a power of two (the Triton block-key pooling, the sparse kernel's run of r tokens)
are routed around by their dispatch for other ratios. Without a user choice the engine takes the
smallest common multiple of r, I and KERNEL_TILE_TOKENS, the tile the paged attention kernels
read a page in (16 tokens: whole pages per tile, one block-table read per page).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from qsaserve.errors import InvalidRequestError

KERNEL_TILE_TOKENS = 16


@dataclass(frozen=True)
class BlockGeometry:
    block_size: int  # tokens per KV page on one rank (--block-size)
    reason: str  # why this size, for the startup log


def choose_block_size(requested: int | None, compress_ratio: int = 1, dcp_interleave: int = 1) -> BlockGeometry:
    """The page size: `requested` when it fits the model and layout (else an InvalidRequestError
    naming the parameter to change), or the smallest multiple of KERNEL_TILE_TOKENS that the
    compress ratio and the DCP interleave both divide."""
    if requested is None:
        size = math.lcm(KERNEL_TILE_TOKENS, compress_ratio, dcp_interleave)
        parts = [f"the kernels' {KERNEL_TILE_TOKENS}-token tile"]
        if compress_ratio > 1:
            parts.append(f"the QSA compress ratio {compress_ratio}")
        if dcp_interleave > 1:
            parts.append(f"the DCP interleave {dcp_interleave}")
        if len(parts) == 1:
            return BlockGeometry(size, parts[0])
        return BlockGeometry(size, "the least common multiple of " + ", ".join(parts[:-1]) + " and " + parts[-1])
    if requested % compress_ratio:
        fit = math.lcm(KERNEL_TILE_TOKENS, compress_ratio, dcp_interleave)
        raise InvalidRequestError(
            "block_size", f"must be a multiple of the model's QSA compress ratio (indexer_compress_ratio = "
                          f"{compress_ratio}), got {requested}; e.g. {fit}, or leave --block-size unset to let the "
                          f"engine choose")
    if requested % dcp_interleave:
        raise InvalidRequestError(
            "dcp_interleave_size", f"must divide block_size ({requested}); got {dcp_interleave}")
    return BlockGeometry(requested, "as requested")


def default_state_interval(block_tokens: int, snapshot_bytes: int, bytes_per_block: int) -> int:
    """Tokens between two recurrent-state snapshots when the user gives none: every block while a
    snapshot costs no more than one block of KV, else the fewest whole blocks whose KV costs at
    least one snapshot, so snapshots never take more memory than the KV of the tokens they cover."""
    return block_tokens * max(1, -(-snapshot_bytes // max(bytes_per_block, 1)))


def check_state_interval(interval: int, block_tokens: int) -> None:
    """Snapshots sit at block boundaries: the interval is a whole number of engine blocks."""
    if interval < 1 or interval % block_tokens:
        raise InvalidRequestError(
            "prefix_state_interval", f"must be a positive multiple of the engine block ({block_tokens} tokens), got "
                                     f"{interval}")


@dataclass(frozen=True)
class CacheSplit:
    num_blocks: int  # KV blocks (the null block among them)
    num_snapshots: int  # recurrent-state snapshot rows of the prefix cache


def split_cache_budget(budget_bytes: int, bytes_per_block: int, block_tokens: int, snapshot_bytes: int = 0,
                       interval: int = 0) -> CacheSplit:
    """Divides a budget between KV blocks and state snapshots so that every `interval` tokens of
    KV the pool can hold has room for one snapshot: a block then costs its KV bytes plus its share
    (block_tokens / interval) of a snapshot. No snapshots (snapshot_bytes 0): all KV."""
    if not snapshot_bytes or not interval:
        return CacheSplit(int(budget_bytes // bytes_per_block), 0)
    per_block = bytes_per_block + snapshot_bytes * block_tokens / interval
    num_blocks = int(budget_bytes // per_block)
    return CacheSplit(num_blocks, max(1, num_blocks * block_tokens // interval))
