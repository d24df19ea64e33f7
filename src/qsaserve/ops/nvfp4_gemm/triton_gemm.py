"""NVFP4-weight GEMM as W4A16 (reference.py's layout): each program streams BLOCK_N weight rows as
packed E2M1 (half a byte a weight) with their E4M3 group scales, decodes them in registers to the
activation dtype (Marlin's idea: dequantize in the GEMM's load path) and runs tensor-core dots;
the per-row global scale is applied once to the output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.nvfp4_gemm.reference import GROUP


@triton.jit
def _e2m1(code):
    """uint8 E2M1 codes (low 4 bits: sign, 2 exponent bits, 1 mantissa bit) -> float32 values. The
    bits go into an fp16 (sign to bit 15, exponent and mantissa to bits 11..9), which reads as
    2^-14 times the E2M1 value for the normals and the subnormal 0.5 alike: two shifts and a
    bitcast, then one exact scale by 2^14 (which folds into the group scale's multiply)."""
    c = code.to(tl.uint16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_: tl.constexpr,
                  PRECISION: tl.constexpr):
    # A byte holds columns 2j (low nibble) and 2j + 1 (high nibble): the low codes meet the even
    # activation columns and the high codes the odd ones, in two dots, so the decoded weight tile
    # is never interleaved back into column order.
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    half = tl.arange(0, BLOCK_K // 2)
    groups = tl.arange(0, BLOCK_K // GROUP_)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    for k0 in range(0, K, BLOCK_K):
        byte = k0 // 2 + half
        byte_ok = byte < K // 2
        x_mask = m_ok[:, None] & byte_ok[None, :]
        x_even = tl.load(x_rows + 2 * byte[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + 2 * byte[None, :] + 1, mask=x_mask, other=0.0)
        packed = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + byte[None, :],
                         mask=n_ok[:, None] & byte_ok[None, :], other=0)
        g_ok = (k0 // GROUP_ + groups) < K // GROUP_
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + (k0 // GROUP_ + groups)[None, :],
                    mask=n_ok[:, None] & g_ok[None, :], other=0.0).to(tl.float32)
        # a group of GROUP_ columns is GROUP_ / 2 bytes: its scale covers that many codes of each half
        lo = tl.reshape(tl.reshape(_e2m1(packed & 0xF), (BLOCK_N, BLOCK_K // GROUP_, GROUP_ // 2)) * s[:, :, None],
                        (BLOCK_N, BLOCK_K // 2))
        hi = tl.reshape(tl.reshape(_e2m1(packed >> 4), (BLOCK_N, BLOCK_K // GROUP_, GROUP_ // 2)) * s[:, :, None],
                        (BLOCK_N, BLOCK_K // 2))
        acc += tl.dot(x_even, tl.trans(lo.to(x_even.dtype)), input_precision=PRECISION)
        acc += tl.dot(x_odd, tl.trans(hi.to(x_odd.dtype)), input_precision=PRECISION)
    r = tl.load(r_ptr + offs_n, mask=n_ok, other=0.0)
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
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
                        num_stages=num_stages)
    return y


__all__ = ["nvfp4_w4a16_gemm_triton", "pick_block_n"]
