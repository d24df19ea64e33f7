"""Triton KV cache write (reshape_and_cache): this step's K/V rows into their page slots, slot
-1 skipped, quantized to E4M3 for FP8 pages (bit-equal to torch's cast of x / scale) and less the
layer's K offset when it has one."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.attention.triton_common import check_scales

_E4M3_MAX = tl.constexpr(448.0)
_SIGN_BIT = tl.constexpr(-2147483648)  # 0x80000000 as int32
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (t + M) - M rounds |t| < 2**22 to nearest even


@triton.jit
def _quantize_e4m3(x, scale):
    """fp32 x -> x / scale clamped to +-448 and rounded to nearest-even on the E4M3 grid, as an
    fp32 value that E4M3 holds exactly (so the final cast cannot round differently). Bit-equal to
    torch's `(x / scale).clamp(-448, 448).to(float8_e4m3fn)`, on every backend."""
    y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))  # IEEE division, like torch (`/` is approximate)
    y = tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX)
    bits = y.to(tl.int32, bitcast=True)
    # Spacing of E4M3 values around y: 2**(e - 3) for normals (3 mantissa bits), 2**-9 below 2**-6.
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - e) << 23).to(tl.float32, bitcast=True)
    r = ((y * inv_ulp + _RNE_MAGIC) - _RNE_MAGIC) * ulp  # scaling by powers of two is exact
    return (r.to(tl.int32, bitcast=True) | (bits & _SIGN_BIT)).to(tl.float32, bitcast=True)  # keep -0


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, k_off_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c2, stride_cb, stride_ct, stride_ch,
    H: tl.constexpr, H_POW2: tl.constexpr, D: tl.constexpr, D_POW2: tl.constexpr, PAGE: tl.constexpr,
    IS_FP8: tl.constexpr, HAS_K_OFFSET: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padded token: nothing to store
        return
    h = tl.arange(0, H_POW2)[:, None]
    d = tl.arange(0, D_POW2)[None, :]
    mask = (h < H) & (d < D)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    if HAS_K_OFFSET:  # K is stored relative to a per-channel offset; softmax does not see it
        k = k.to(tl.float32) - tl.load(k_off_ptr + h * D + d, mask=mask, other=0.0)
    if IS_FP8:
        k = _quantize_e4m3(k.to(tl.float32), tl.load(k_scale_ptr))
        v = _quantize_e4m3(v.to(tl.float32), tl.load(v_scale_ptr))
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + h * stride_ch + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c2, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             k_offset: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; slot_mapping: [T] (<0 skips).

    FP8 cache: stores E4M3 of clamp(x / scale, +-448) (scales 0-d fp32 device tensors, read by the
    kernel). k_offset: optional float32 [Hkv, D]; K is stored as (k - k_offset) (then quantized)."""
    t, h, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("k, v, kv_cache: the last (head_dim) dimension must be contiguous")
    fp8 = check_scales(kv_cache, k_scale, v_scale)
    if k_offset is not None:
        if k_offset.shape != (h, d) or k_offset.dtype != torch.float32 or k_offset.device != k.device:
            raise ValueError(f"k_offset: must be float32 [{h}, {d}] on {k.device}, "
                             f"got {tuple(k_offset.shape)} {k_offset.dtype} on {k_offset.device}")
        k_offset = k_offset.contiguous()
    dummy = slot_mapping  # any pointer for the unused arguments
    _write_kv_kernel[(t,)](
        k, v, kv_cache, slot_mapping,
        k_scale if fp8 else dummy, v_scale if fp8 else dummy, k_offset if k_offset is not None else dummy,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        H=h, H_POW2=triton.next_power_of_2(h), D=d, D_POW2=triton.next_power_of_2(d), PAGE=kv_cache.shape[2],
        IS_FP8=fp8, HAS_K_OFFSET=k_offset is not None,
        num_warps=4 if h * d >= 1024 else 1,
    )

