"""What the paged-attention kernels share (kv_write.py, decode_triton.py, prefill_triton.py):
the online-softmax constants, the FP8 scale checks, and the key positions and shard lengths under
decode context parallelism (ShardKeys: the pages hold only this rank's interleaved token shard, so
key lengths are the shard's and the causal mask compares global positions).

Nothing here touches CUDA at import time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Online-softmax running max starts finite, so a row that sees only masked keys in a tile keeps
# alpha = exp2(0) = 1 instead of exp2(-inf - -inf) = NaN.
_M_INIT = tl.constexpr(-1.0e30)
FP8 = torch.float8_e4m3fn


def check_scales(kv_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """True when the cache is FP8 (then both scales must be 1-element fp32 tensors on its device).
    Checks only host-side metadata: nothing syncs."""
    if kv_cache.dtype != FP8:
        return False
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"{name}: an fp8_e4m3 KV cache needs its layer's {name} (0-d float32 tensor), got {s!r}")
        if s.numel() != 1 or s.dtype != torch.float32 or s.device != kv_cache.device:
            raise ValueError(f"{name}: must be a 1-element float32 tensor on {kv_cache.device}, "
                             f"got shape {tuple(s.shape)} {s.dtype} on {s.device}")
    return True


# ----------------------------------------------------------------------------------------------
# Key positions under decode context parallelism (DCP_SIZE == 1: local row == position)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _key_position(j, rank, DCP_SIZE: tl.constexpr, DCP_I: tl.constexpr):
    """Global position of this rank's local row j (parallel/dcp.py: DcpGeometry.global_position)."""
    if DCP_SIZE == 1:
        p = j
    else:
        p = (j // DCP_I) * (DCP_SIZE * DCP_I) + rank * DCP_I + j % DCP_I
    return p


@triton.jit
def _local_len(n, rank, DCP_SIZE: tl.constexpr, DCP_I: tl.constexpr):
    """How many of positions [0, n) this rank holds (DcpGeometry.local_len)."""
    if DCP_SIZE == 1:
        m = n
    else:
        rem = n % (DCP_SIZE * DCP_I) - rank * DCP_I
        m = (n // (DCP_SIZE * DCP_I)) * DCP_I + tl.minimum(tl.maximum(rem, 0), DCP_I)
    return m


@dataclass(frozen=True)
class ShardKeys:
    """This rank's K/V shard under decode context parallelism (parallel/dcp.py): local row j of a
    sequence sits at global position (j // interleave) * size * interleave + rank * interleave
    + j % interleave, and sequence i has lens[i] local rows (lens_list: the same on the host)."""

    size: int
    rank: int
    interleave: int
    lens: torch.Tensor  # [B] int32, on the device
    lens_list: list[int]


def dcp_args(shard: ShardKeys | None, seq_lens: torch.Tensor):
    """(key_lens tensor, rank, DCP_SIZE, DCP_I) for the kernels."""
    if shard is None or shard.size == 1:
        return seq_lens, 0, 1, 1
    return shard.lens, shard.rank, shard.size, shard.interleave


def interpreted(kernel) -> bool:
    """True under TRITON_INTERPRET=1, where kernels run in numpy and inline asm cannot."""
    return type(kernel).__name__ == "InterpretedFunction"


def host_int32(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":  # pinned + non_blocking: the copy is queued, the host does not wait
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
