"""FP8 GEMVs (triton_gemv._gemv_body's program) joined to what surrounds a projection in a decode
step at 1-2 rows (reference.RESIDUAL_ROWS), each its own kernel (and name in profiles):

* fp8_gemv_residual_triton: the o or down projection; its epilogue adds the output to the residual
  stream and prepares the next RMSNorm (h, h * g and per-program sums of h's squares) instead of
  storing the output: the add and norm kernels of the unjoined step, gone;
* fp8_prenormed_gemv_triton: the qkv or gate_up projection after that norm: a plain GEMV over
  h * g whose sums are scaled by 1 / rms from the partial sums (the norm-joined GEMV,
  triton_gemv.fp8_norm_gemv_triton, has every program stream x, the residual and g and square
  them: 6-11% slower than the plain GEMV on an H200);
* fp8_prenormed_rope_kv_triton: the qkv projection so, whose epilogue also rotates q and k (RoPE)
  and writes k and v to the paged cache: the RoPE and KV-write kernels, gone.

Tiles from triton_gemv.pick_gemv_tile (the plain GEMV's); no split-K (an epilogue needs whole sums)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.fp8_gemm.reference import GROUP, RESIDUAL_ROWS
from qsaserve.ops.fp8_gemm.triton_gemm import _scale_k_stride, w8a16_operands
from qsaserve.ops.fp8_gemm.triton_gemv import PART_BLOCK, _gemv_body, gemv_operands, pick_gemv_tile

PART_COLS = 4  # the partial sums' row stride (triton_gemv.PART_ROWS)


@triton.jit
def _fp8_gemv_residual_kernel(x_ptr, res_ptr, g_ptr, h_ptr, hg_ptr, part_ptr, w_ptr, s_ptr, M, N, K, block_n,
                              stride_xm, stride_wn, stride_sn, stride_sk, stride_hm,
                              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_: tl.constexpr, ROW_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr,
                              GATED: tl.constexpr):
    _gemv_body(x_ptr, res_ptr, g_ptr, h_ptr, w_ptr, s_ptr, h_ptr, M, N, K, block_n, 0.0,
               stride_xm, stride_wn, stride_sn, stride_sk, stride_hm, 0,
               ROWS, BLOCK_N, BLOCK_K, GROUP_, 1, ROW_SCALE, NUM_STAGES, GATED, False, False,
               hg_ptr, part_ptr, 0, True, False, 1,
               x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, 0, 0, 0, 0, 1, 1, False, 1)


@triton.jit(do_not_specialize=["eps", "n_parts"])
def _fp8_prenormed_gemv_kernel(x_ptr, part_ptr, n_parts, eps, w_ptr, s_ptr, y_ptr, M, N, K, block_n,
                               stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
                               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_: tl.constexpr, ROW_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr,
                               PART_BLOCK_: tl.constexpr):
    _gemv_body(x_ptr, x_ptr, x_ptr, x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, block_n, eps,
               stride_xm, stride_wn, stride_sn, stride_sk, stride_ym, 0,
               ROWS, BLOCK_N, BLOCK_K, GROUP_, 1, ROW_SCALE, NUM_STAGES, False, False, False,
               x_ptr, part_ptr, n_parts, False, True, PART_BLOCK_,
               x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, 0, 0, 0, 0, 1, 1, False, 1)


# eps, the producer's program count, the cache's block stride and the page size unspecialized
@triton.jit(do_not_specialize=["eps", "n_parts", "stride_cb", "page"])
def _fp8_prenormed_rope_kv_kernel(x_ptr, part_ptr, n_parts, eps, w_ptr, s_ptr, y_ptr, M, N, K, block_n,
                                  stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
                                  pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, stride_cos, stride_c2, stride_cb,
                                  stride_ct, stride_ch, n_q_heads, n_kv_heads, page,
                                  ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  GROUP_: tl.constexpr, ROW_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr,
                                  PART_BLOCK_: tl.constexpr, HALF: tl.constexpr):
    _gemv_body(x_ptr, x_ptr, x_ptr, x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, block_n, eps,
               stride_xm, stride_wn, stride_sn, stride_sk, stride_ym, 0,
               ROWS, BLOCK_N, BLOCK_K, GROUP_, 1, ROW_SCALE, NUM_STAGES, False, False, False,
               x_ptr, part_ptr, n_parts, False, True, PART_BLOCK_,
               pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, stride_cos, stride_c2, stride_cb, stride_ct,
               stride_ch, n_q_heads, n_kv_heads, page, True, HALF)


def _launch(m: int, n: int, k: int, x: torch.Tensor, block_n_tile, block_k, num_warps) -> tuple[int, int, int]:
    bn, bk, _, warps = pick_gemv_tile(n, k, num_sms(x.device), m)
    bn, bk = block_n_tile or bn, block_k or bk
    if bk % GROUP or bk & (bk - 1):
        raise ValueError(f"fp8_gemv: block_k a power-of-two multiple of {GROUP}, got {bk}")
    return bn, bk, num_warps or warps


def fp8_gemv_residual_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                             residual: torch.Tensor, norm_weight: torch.Tensor, gated: bool = False,
                             block_n_tile: int | None = None, block_k: int | None = None,
                             num_warps: int | None = None,
                             num_stages: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GEMV with the residual add and the next RMSNorm's numerator in its epilogue: x [M, K]
    (M <= RESIDUAL_ROWS; gate | up [M, 2K] when gated, as triton_gemv.fp8_gemv_triton), residual
    [M, N] in x's dtype, norm_weight [N] -> (h, hg, partials): h = y + residual [M, N] (y = x @ W^T
    rounded to x's dtype, then the sum rounded: as fp8_gemv_triton then ops.fused's residual add),
    hg = h * norm_weight rounded to x's dtype, and partials [programs, 4] float32, row r's sums of
    h's squares over each program's columns, for the prenormed GEMVs. y itself is not stored."""
    x, h = gemv_operands(x, w, w_scale, block_n, gated, "fp8_gemv_residual")
    m, k, n = x.shape[0], w.shape[1], w.shape[0]
    if not 0 < m <= RESIDUAL_ROWS or residual.shape != (m, n) or residual.dtype != x.dtype or norm_weight.shape != (n,):
        raise ValueError(f"fp8_gemv_residual: 1-{RESIDUAL_ROWS} rows, residual [M, N] = [{m}, {n}] in {x.dtype} and "
                         f"norm_weight [N]; got {m} rows, residual {tuple(residual.shape)} {residual.dtype}, "
                         f"norm_weight {tuple(norm_weight.shape)}")
    bn, bk, warps = _launch(m, n, k, x, block_n_tile, block_k, num_warps)
    grid = triton.cdiv(n, bn)
    hg = torch.empty_like(h)
    partials = torch.empty((grid, PART_COLS), dtype=torch.float32, device=x.device)
    _fp8_gemv_residual_kernel[(grid,)](
        x, residual.contiguous(), norm_weight.contiguous(), h, hg, partials, w, w_scale, m, n, k, block_n,
        x.stride(0), w.stride(0), w_scale.stride(0), _scale_k_stride(w_scale), h.stride(0),
        ROWS=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, GROUP_=GROUP, ROW_SCALE=w_scale.shape[1] == 1,
        NUM_STAGES=num_stages, GATED=gated, num_warps=warps)
    return h, hg, partials


def _prenormed_operands(hg, partials, w, w_scale, block_n, what):
    hg, y = w8a16_operands(hg, w, w_scale, block_n, what)
    m = hg.shape[0]
    if not 0 < m <= RESIDUAL_ROWS or partials.dim() != 2 or partials.shape[1] != PART_COLS or partials.dtype != torch.float32:
        raise ValueError(f"{what}: 1-{RESIDUAL_ROWS} rows and float32 partials [P, {PART_COLS}]; got {m} rows, "
                         f"partials {tuple(partials.shape)} {partials.dtype}")
    return hg, y, partials.contiguous()


def fp8_prenormed_gemv_triton(hg: torch.Tensor, partials: torch.Tensor, eps: float, w: torch.Tensor,
                              w_scale: torch.Tensor, block_n: int, block_n_tile: int | None = None,
                              block_k: int | None = None, num_warps: int | None = None,
                              num_stages: int = 3) -> torch.Tensor:
    """The GEMV after fp8_gemv_residual_triton's epilogue: hg [M, K] and partials [P, 4] from it
    -> y [M, N] = (hg @ W^T) / rms in hg's dtype, rms = sqrt(sum of row r's partials / K + eps):
    RMSNorm(h) * g @ W^T with the normalization applied once to the float32 sums (as
    fp8_norm_gemv_triton, whose normalized input is not rounded either; here h * g is)."""
    hg, y, partials = _prenormed_operands(hg, partials, w, w_scale, block_n, "fp8_prenormed_gemv")
    m, k, n = hg.shape[0], w.shape[1], w.shape[0]
    bn, bk, warps = _launch(m, n, k, hg, block_n_tile, block_k, num_warps)
    _fp8_prenormed_gemv_kernel[(triton.cdiv(n, bn),)](
        hg, partials, partials.shape[0], eps, w, w_scale, y, m, n, k, block_n, hg.stride(0), w.stride(0),
        w_scale.stride(0), _scale_k_stride(w_scale), y.stride(0), ROWS=triton.next_power_of_2(m), BLOCK_N=bn,
        BLOCK_K=bk, GROUP_=GROUP, ROW_SCALE=w_scale.shape[1] == 1, NUM_STAGES=num_stages,
        PART_BLOCK_=PART_BLOCK, num_warps=warps)
    return y


def fp8_prenormed_rope_kv_triton(hg: torch.Tensor, partials: torch.Tensor, eps: float, w: torch.Tensor,
                                 w_scale: torch.Tensor, block_n: int, num_q_heads: int, num_kv_heads: int,
                                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                 block_n_tile: int | None = None, block_k: int | None = None,
                                 num_warps: int | None = None, num_stages: int = 3) -> torch.Tensor:
    """fp8_prenormed_gemv_triton for a fused q | k | v projection (W [(Hq + 2 Hkv) * D, K]) that
    also applies RoPE and writes the KV cache: -> qkv [M, N] with q and k rotated at positions [M]
    (cos / sin float32 [max_positions, D / 2], full rotate-half: ops.fused.rope_qk), v as computed,
    and k, v stored at slot_mapping [M] (< 0: not stored) of kv_cache [2, blocks, page, Hkv, D]
    in its dtype (no FP8 scales or K offset: ops.attention.write_kv's plain form)."""
    hg, y, partials = _prenormed_operands(hg, partials, w, w_scale, block_n, "fp8_prenormed_rope_kv")
    m, k, n = hg.shape[0], w.shape[1], w.shape[0]
    head_dim = kv_cache.shape[-1]
    half = cos.shape[-1]
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3] != num_kv_heads or 2 * half != head_dim
            or n != (num_q_heads + 2 * num_kv_heads) * head_dim or sin.shape != cos.shape or kv_cache.stride(-1) != 1
            or positions.shape != (m,) or slot_mapping.shape != (m,) or cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        raise ValueError(f"fp8_prenormed_rope_kv: W [(Hq + 2 Hkv) * D, K] with kv_cache [2, blocks, page, Hkv, D], "
                         f"cos / sin [P, D / 2] and positions, slot_mapping [M]; got W {tuple(w.shape)}, Hq "
                         f"{num_q_heads}, Hkv {num_kv_heads}, kv_cache {tuple(kv_cache.shape)}, cos {tuple(cos.shape)},"
                         f" positions {tuple(positions.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    bn, bk, warps = _launch(m, n, k, hg, block_n_tile, block_k, num_warps)
    if block_n_tile is None:  # a program takes bn / 2 channel pairs of one head: halve until they divide D / 2
        bn = min(bn, 2 * half)
        while bn > 2 and half % (bn // 2):
            bn //= 2
    elif bn < 2 or half % (bn // 2):
        raise ValueError(f"fp8_prenormed_rope_kv: block_n_tile / 2 must divide D / 2 = {half}, got {bn}")
    _fp8_prenormed_rope_kv_kernel[(n // bn,)](
        hg, partials, partials.shape[0], eps, w, w_scale, y, m, n, k, block_n, hg.stride(0), w.stride(0),
        w_scale.stride(0), _scale_k_stride(w_scale), y.stride(0), positions, cos, sin, kv_cache, slot_mapping,
        cos.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), num_q_heads,
        num_kv_heads, kv_cache.shape[2], ROWS=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, GROUP_=GROUP,
        ROW_SCALE=w_scale.shape[1] == 1, NUM_STAGES=num_stages, PART_BLOCK_=PART_BLOCK, HALF=half, num_warps=warps)
    return y


__all__ = ["fp8_gemv_residual_triton", "fp8_prenormed_gemv_triton", "fp8_prenormed_rope_kv_triton"]
