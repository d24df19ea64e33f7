"""PLE table rows gathered on the device from wherever the table lives: GPU memory, or host RAM
that is page-locked and mapped into the device's address space (UVA: torch's pinned memory, or
a region registered with cudaHostRegister, such as a memory-mapped checkpoint shard). The row
ids come from the device, the rows travel over PCIe inside the kernel: no host work per step,
so the gather can sit inside a CUDA graph. Triton's launcher resolves a host pointer through
cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER), which accepts page-locked mapped
memory and refuses pageable memory with "cannot be accessed from Triton (cpu tensor?)".

Reference: reference.gather_rows_into_reference_ (index_select on the table's device).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(table_ptr, rows_ptr, out_ptr, first_row, num_rows, D, stride_t, stride_o,
                        BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row = tl.load(rows_ptr + i).to(tl.int64) - first_row
    # A sharded table is gathered one shard per launch: rows of other shards are left alone.
    ok = (d < D) & (row >= 0) & (row < num_rows)
    # Rows are read once per step: keep them out of L2 (evict_first).
    vals = tl.load(table_ptr + row * stride_t + d, mask=ok, other=0.0, eviction_policy="evict_first")
    tl.store(out_ptr + i.to(tl.int64) * stride_o + d, vals.to(out_ptr.dtype.element_ty), mask=ok)


def gather_rows_into_(out: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """out [N, D] (on the device, any float dtype); table [R, D] (on the device or in mapped
    page-locked host memory, unit last stride); rows [N] int64 on the device. out[i] =
    table[rows[i] - first_row] (cast to out's dtype) for every rows[i] in [first_row,
    first_row + R); other rows of out are left as they are. Returns out."""
    n, dim = out.shape
    if table.dim() != 2 or table.shape[1] != dim or table.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"gather_rows_into_: table [R, {dim}] and out [N, {dim}] with unit last strides, "
                         f"got {tuple(table.shape)} and {tuple(out.shape)}")
    if rows.shape != (n,):
        raise ValueError(f"gather_rows_into_: rows [{n}], got {tuple(rows.shape)}")
    if n and table.shape[0]:
        block_d = min(triton.next_power_of_2(dim), 1024)
        _gather_rows_kernel[(n, triton.cdiv(dim, block_d))](
            table, rows.contiguous(), out, first_row, table.shape[0], dim, table.stride(0), out.stride(0),
            BLOCK_D=block_d, num_warps=1 if block_d <= 256 else 4)
    return out
