"""PLE table rows gathered on the device from wherever the table lives: GPU memory, or host RAM
that is page-locked and mapped into the device's address space (UVA: a region registered with
the driver, such as a host buffer or a memory-mapped checkpoint shard). The row ids come from
the device and the rows travel over PCIe inside the kernel: no host work per step, so the
gather can sit inside a CUDA graph. Triton's launcher resolves a host pointer through
cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER), which accepts page-locked mapped
memory and refuses pageable memory with "cannot be accessed from Triton (cpu tensor?)".

Reference: reference.gather_rows_reference_.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qsaserve.ops.ple.row_shards import RowShards


@triton.jit
def _gather_rows_kernel(shard0_ptr, offsets_ptr, starts_ptr, rows_ptr, out_ptr, num_shards, D, stride_o,
                        SEARCH_STEPS: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row = tl.load(rows_ptr + i).to(tl.int64)
    # The shard holding the row: the last s with starts[s] <= row (starts[num_shards] is the total).
    lo = row * 0
    hi = lo + num_shards
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(starts_ptr + mid) <= row
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    local = row - tl.load(starts_ptr + lo)
    base = tl.load(offsets_ptr + lo)
    ok = (d < D) & (row >= 0) & (row < tl.load(starts_ptr + num_shards))
    # Rows are read once per step: keep them out of L2 (evict_first).
    vals = tl.load(shard0_ptr + base + local * D + d, mask=ok, other=0.0, eviction_policy="evict_first")
    tl.store(out_ptr + i.to(tl.int64) * stride_o + d, vals.to(out_ptr.dtype.element_ty), mask=d < D)


def gather_rows_(out: torch.Tensor, table: RowShards, rows: torch.Tensor) -> torch.Tensor:
    """out [N, D] (on the device, any float dtype); table: row shards on the device or in mapped
    page-locked host memory, starts/offsets on the device; rows [N] int64 on the device, each in
    [0, table.rows). out[i] = table row rows[i], cast to out's dtype. Returns out."""
    n, dim = out.shape
    if table.dim != dim or out.stride(1) != 1:
        raise ValueError(f"gather_rows_: out [N, {table.dim}] with a unit last stride, got {tuple(out.shape)}")
    if rows.shape != (n,):
        raise ValueError(f"gather_rows_: rows [{n}], got {tuple(rows.shape)}")
    if n:
        num_shards = len(table.shards)
        block_d = min(triton.next_power_of_2(dim), 1024)
        _gather_rows_kernel[(n, triton.cdiv(dim, block_d))](
            table.shards[0], table.offsets, table.starts, rows.contiguous(), out, num_shards, dim, out.stride(0),
            SEARCH_STEPS=math.ceil(math.log2(num_shards)) if num_shards > 1 else 0, BLOCK_D=block_d,
            num_warps=1 if block_d <= 256 else 4)
    return out
