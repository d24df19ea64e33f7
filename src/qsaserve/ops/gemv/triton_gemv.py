"""y = x @ W^T for a few rows of x (decode at batch 1-4): one program per BLOCK_N output features
streams those weight rows once and reuses each tile for every row of x. The weight read is the
whole cost, so the grid is sized to keep every SM busy (>= 2 programs per SM where N allows)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms

MAX_ROWS = 4  # rows of x handled in one pass over the weights


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                 M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.arange(0, 4)  # MAX_ROWS: row r's sums live in acc[r]
    acc = tl.zeros([4, BLOCK_N], tl.float32)
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        for r in tl.static_range(M):  # each weight tile is read once for all rows
            xr = tl.load(x_ptr + r * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
            acc = tl.where(rows[:, None] == r, acc + tl.sum(w * xr[None, :], 1)[None, :], acc)
    tl.store(y_ptr + rows[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & n_ok[None, :])


def pick_block_n(n: int, sms: int) -> int:
    """The widest output block (up to 16 features) that still gives >= 2 programs per SM."""
    for bn in (16, 8, 4, 2):
        if triton.cdiv(n, bn) >= 2 * sms:
            return bn
    return 1


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None, block_k: int = 256) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] with unit last stride -> [M, N] in x's dtype, as
    gemv_reference. block_n: output features per program (default pick_block_n)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"gemv: x [M <= {MAX_ROWS}, K], weight [N, K] with unit last stride; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bn = block_n or pick_block_n(n, num_sms(x.device))
    bk = min(block_k, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, bn),)](x, weight, y, n, k, x.stride(0), weight.stride(0), y.stride(0),
                                        M=m, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return y


__all__ = ["MAX_ROWS", "gemv", "pick_block_n"]
