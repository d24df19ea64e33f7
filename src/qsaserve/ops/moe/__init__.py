"""Qwen4Exp's sparse MoE routing and routed experts, dispatched (`ops.dispatch.use_triton`):

* `moe_route`: the one-kernel router (softmax, top-k, renormalisation) on CUDA, else the reference.
* `moe_experts`, `moe_experts_sync_free`: on CUDA for SiLU experts, the in-place decode kernels
  (triton_moe.py) for steps of at most DECODE_KERNEL_MAX_TOKENS tokens with fewer token-choices
  than experts, else the grouped GEMMs (triton_grouped.py); neither syncs with the host. Elsewhere
  the torch references (reference.py): the loop over experts, and its sync-free form.
  Block-FP8 experts (w13_scale, w2_scale given): on CUDA the decode kernels' FP8 form where the
  model-dtype experts take them (H and I multiples of 128), else the grouped GEMMs' FP8 form;
  block_fp8.moe_experts_block_fp8 elsewhere. NVFP4 experts (w13_row_scale, w2_row_scale given
  too): the grouped GEMMs' NVFP4 (W4A16) form at every size on CUDA, nvfp4.moe_experts_nvfp4
  elsewhere.
* `moe_router`, `moe_align_block_size`: references (the latter is the grouped path's sort).
* `warm_up`: builds every kernel variant the dispatch can pick for steps up to a token budget."""
from __future__ import annotations

import functools

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.moe import block_fp8, nvfp4, reference
from qsaserve.ops.moe.reference import moe_align_block_size, moe_router

try:  # CPU-only installs keep the reference
    from qsaserve.ops.moe import triton_grouped, triton_moe
except ImportError:
    triton_grouped = triton_moe = None

# The decode kernels read each (token, choice)'s expert weights in place, the grouped GEMMs read
# each expert hit once and use tensor cores: the former win only while tokens rarely share an
# expert and the GEMMs' 16-row tiles would be almost empty (benchmarks/bench_moe_grouped.py).
DECODE_KERNEL_MAX_TOKENS = 4


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert indices [N, k])."""
    if use_triton(logits):
        return triton_moe.moe_route_triton(logits, top_k, norm_topk_prob)
    return reference.moe_route(logits, top_k, norm_topk_prob)


def uses_decode_kernels(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """On CUDA: whether a step of num_tokens tokens takes the decode kernels (else the grouped GEMMs)."""
    return num_tokens <= DECODE_KERNEL_MAX_TOKENS and num_tokens * top_k < num_experts


def _decode_format_ok(scales: dict, hidden: int, inter: int) -> bool:
    """Whether the decode kernels take these experts: model-dtype or block-FP8 of whole 128-groups."""
    if not scales:
        return True
    return "w13_row_scale" not in scales and triton_moe.takes_fp8(hidden, inter)


def _experts_triton(x, indices, weights, gate_up_proj, down_proj, scales):
    if (uses_decode_kernels(indices.shape[0], indices.shape[1], gate_up_proj.shape[0])
            and _decode_format_ok(scales, x.shape[1], down_proj.shape[2])):
        return triton_moe.moe_experts_decode_triton(x, indices, weights.to(x.dtype), gate_up_proj, down_proj,
                                                    w13_scale=scales.get("w13_scale"), w2_scale=scales.get("w2_scale"))
    return triton_grouped.moe_experts_grouped_triton(x, indices, weights, gate_up_proj, down_proj, **scales)


def _scales(w13_scale, w2_scale, w13_row_scale, w2_row_scale) -> dict:
    given = {"w13_scale": w13_scale, "w2_scale": w2_scale, "w13_row_scale": w13_row_scale, "w2_row_scale": w2_row_scale}
    return {k: v for k, v in given.items() if v is not None}


def _experts_reference(x, indices, weights, gate_up_proj, down_proj, activation, scales, sync_free):
    if "w13_row_scale" in scales or "w2_row_scale" in scales:
        return nvfp4.moe_experts_nvfp4(x, indices, weights, gate_up_proj, down_proj, scales.get("w13_scale"),
                                       scales.get("w2_scale"), scales.get("w13_row_scale"), scales.get("w2_row_scale"),
                                       activation, sync_free=sync_free)
    if scales:
        return block_fp8.moe_experts_block_fp8(x, indices, weights, gate_up_proj, down_proj, scales.get("w13_scale"),
                                               scales.get("w2_scale"), activation, sync_free=sync_free)
    if sync_free:
        return reference.moe_experts_sync_free(x, indices, weights, gate_up_proj, down_proj, activation)
    return reference.moe_experts(x, indices, weights, gate_up_proj, down_proj, activation)


def moe_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, activation: str = "silu", *, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None, w13_row_scale: torch.Tensor | None = None,
                w2_row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H], indices / weights [N, k], gate_up_proj [E, 2I, H] (rows :I gate, I: up),
    down_proj [E, H, I] -> [N, H]: the routed experts of any step. Block-FP8 experts: E4M3
    weights with w13_scale [E, ceil(2I/128), ceil(H/128)], w2_scale [E, ceil(H/128), ceil(I/128)]
    (block_fp8.py; their activations are quantized per token-group of 128). NVFP4 experts (W4A16):
    packed uint8 gate_up_proj [E, 2I, H/2] / down_proj [E, H, I/2], E4M3 w13_scale [E, 2I, H/16] /
    w2_scale [E, H, I/16] and float32 w13_row_scale [E, 2I] / w2_row_scale [E, H] (nvfp4.py)."""
    scales = _scales(w13_scale, w2_scale, w13_row_scale, w2_row_scale)
    if use_triton(x) and activation in ("silu", "swish"):
        return _experts_triton(x, indices, weights, gate_up_proj, down_proj, scales)
    return _experts_reference(x, indices, weights, gate_up_proj, down_proj, activation, scales, sync_free=False)


def moe_experts_sync_free(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                          down_proj: torch.Tensor, activation: str = "silu", *, w13_scale: torch.Tensor | None = None,
                          w2_scale: torch.Tensor | None = None, w13_row_scale: torch.Tensor | None = None,
                          w2_row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H], indices / weights [N, k], gate_up_proj [E, 2I, H], down_proj [E, H, I] -> [N, H]:
    the routed experts without host syncs (decode steps, CUDA graphs); scales as moe_experts."""
    scales = _scales(w13_scale, w2_scale, w13_row_scale, w2_row_scale)
    if use_triton(x) and activation in ("silu", "swish"):
        return _experts_triton(x, indices, weights, gate_up_proj, down_proj, scales)
    return _experts_reference(x, indices, weights, gate_up_proj, down_proj, activation, scales, sync_free=True)


def warm_up(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int, dtype: torch.dtype,
            max_tokens: int, *, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
            w13_row_scale: torch.Tensor | None = None, w2_row_scale: torch.Tensor | None = None) -> int:
    """Builds, now, every kernel variant moe_route and the routed experts take on steps of 1 to
    max_tokens tokens with these weights (gate_up_proj [E, 2I, H], down_proj [E, H, I], scales as
    moe_experts), so that no step waits for a Triton build. The token-count arguments are not
    specialized on, so one launch per configuration builds it. Returns the launches made (0 off CUDA)."""
    if not use_triton(gate_up_proj) or max_tokens < 1:
        return 0
    from qsaserve.ops.device import num_sms

    scales = _scales(w13_scale, w2_scale, w13_row_scale, w2_row_scale)
    fmt = "nvfp4" if "w13_row_scale" in scales else "fp8" if scales else ""
    num_experts, two_i = gate_up_proj.shape[:2]
    h = down_proj.shape[1]
    dev = gate_up_proj.device
    sms = num_sms(dev)

    def inputs(n):
        idx = (torch.arange(n * top_k, device=dev) % num_experts).view(n, top_k)
        return torch.zeros((n, h), dtype=dtype, device=dev), idx, torch.ones((n, top_k), dtype=dtype, device=dev)

    moe_route(torch.zeros((1, num_experts), dtype=dtype, device=dev), top_k, True)
    moe_route(torch.zeros((1, num_experts), dtype=dtype, device=dev), top_k, False)
    launches = 2
    decode_blocks, grouped = _warm_up_plan(max_tokens, top_k, num_experts, h, two_i // 2,
                                           torch.empty((), dtype=dtype).element_size(), sms, fmt)
    for block_n in decode_blocks:
        triton_moe.moe_experts_decode_triton(*inputs(1), gate_up_proj, down_proj, block_n=block_n,
                                             w13_scale=scales.get("w13_scale"), w2_scale=scales.get("w2_scale"))
        launches += 1
    for configs, n in grouped:
        triton_grouped.moe_experts_grouped_triton(*inputs(n), gate_up_proj, down_proj, configs=configs, **scales)
        launches += 1
    return launches


@functools.lru_cache(maxsize=None)
def _warm_up_plan(max_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, elem_bytes: int, sms: int,
                  fmt: str):
    """(decode-kernel row blocks, [(grouped configs, tokens)]) of steps of 1..max_tokens tokens;
    computed once per shape (every MoE layer of a model asks for the same). fmt: "" (model-dtype
    weights), "fp8" (the decode kernels where _decode_format_ok) or "nvfp4" (the grouped GEMMs at
    every size)."""
    from qsaserve.ops.moe.grouped_config import configs_for

    in_decode = fmt == "" or (fmt == "fp8" and triton_moe.takes_fp8(hidden, inter))
    decode = [n for n in range(1, max_tokens + 1) if in_decode and uses_decode_kernels(n, top_k, num_experts)]
    blocks = dict.fromkeys((triton_moe.pick_block_n(n * top_k, inter, sms), triton_moe.pick_block_n(n, hidden, sms))
                           for n in decode)
    grouped = [n for n in range(1, max_tokens + 1) if n not in decode]
    configs = configs_for(grouped, top_k, num_experts, hidden, inter, elem_bytes, sms, fmt == "fp8")
    return tuple(blocks), tuple(configs.items())


__all__ = ["DECODE_KERNEL_MAX_TOKENS", "moe_align_block_size", "moe_experts", "moe_experts_sync_free", "moe_route",
           "moe_router", "uses_decode_kernels", "warm_up"]
