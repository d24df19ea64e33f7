"""NVFP4-weight GEMM as W4A16 (reference.py's layout): each program streams BLOCK_N weight rows as
packed E2M1 (half a byte a weight) with their E4M3 group scales, decodes them in registers to the
activation dtype (Marlin's idea: dequantize in the GEMM's load path: triton_gemv's bit decode,
then the group scale times 2^63, exact) and runs tensor-core dots; the per-row global scale (and
2^63) is applied once to the output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.nvfp4_gemm.reference import GROUP
from qsaserve.ops.nvfp4_gemm.triton_gemv import e2m1_bits, scaled_e2m1, sums_factor


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_: tl.constexpr,
                  PRECISION: tl.constexpr, UNSCALED: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    half = tl.arange(0, BLOCK_K // 2)
    offs_k = tl.arange(0, BLOCK_K)
    groups = tl.arange(0, BLOCK_K // GROUP_)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        byte_ok = (k0 // 2 + half) < K // 2
        packed = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 // 2 + half)[None, :],
                         mask=n_ok[:, None] & byte_ok[None, :], other=0)
        lo, hi = e2m1_bits(packed & 0xF), e2m1_bits(packed >> 4)  # e2m1 * 2^-126
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K // GROUP_, GROUP_))  # [n, k]: even k from the low nibble
        g_ok = (k0 // GROUP_ + groups) < K // GROUP_
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + (k0 // GROUP_ + groups)[None, :],
                    mask=n_ok[:, None] & g_ok[None, :], other=0.0).to(tl.float32)
        w = scaled_e2m1(w, s, UNSCALED)
        acc += tl.dot(x, tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype)), input_precision=PRECISION)
    r = tl.load(r_ptr + offs_n, mask=n_ok, other=0.0)
    r = r * sums_factor(UNSCALED)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], (acc * r[None, :]).to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def pick_block_n(n: int, sms: int) -> int:
    for bn in (128, 64, 32):
        if triton.cdiv(n, bn) >= 2 * sms:
            return bn
    return 16


def nvfp4_w4a16_gemm_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                            block_n: int | None = None, block_k: int = 128, num_warps: int = 4,
                            num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (K a multiple of 16), packed uint8 [N, K/2], scale E4M3 [N, K/16], row_scale float32
    [N] -> [M, N] in x's dtype, as reference.nvfp4_w4a16_gemm_reference."""
    m, k = x.shape
    n = packed.shape[0]
    if k % GROUP or packed.shape[1] * 2 != k or tuple(scale.shape) != (n, k // GROUP) or row_scale.shape != (n,):
        raise ValueError(f"nvfp4_w4a16_gemm: x [M, K], packed [N, K/2], scale [N, K/16], row_scale [N]; got "
                         f"{tuple(x.shape)}, {tuple(packed.shape)}, {tuple(scale.shape)}, {tuple(row_scale.shape)}")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    bn = block_n or pick_block_n(n, num_sms(x.device))
    grid = (triton.cdiv(n, bn), triton.cdiv(m, block_m))
    _w4a16_kernel[grid](x, packed, scale, row_scale, y, m, n, k, x.stride(0), packed.stride(0), scale.stride(0),
                        y.stride(0), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=block_k, GROUP_=GROUP,
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UNSCALED=x.dtype == torch.float16,
                        num_warps=num_warps,
                        num_stages=num_stages)
    return y


__all__ = ["nvfp4_w4a16_gemm_triton", "pick_block_n"]
