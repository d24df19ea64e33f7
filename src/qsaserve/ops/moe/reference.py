"""Plain-torch references of Qwen4Exp's sparse MoE routing and routed experts (the CPU path, and
what the Triton kernels in triton_moe.py are tested against)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["activation_fn", "moe_align_block_size", "moe_router", "moe_route", "moe_experts", "moe_experts_dequantized",
           "moe_experts_sync_free"]


def activation_fn(name: str):
    """The expert activation named by the config's hidden_act."""
    if name in ("silu", "swish"):
        return F.silu
    if name == "sigmoid":
        return torch.sigmoid
    raise ValueError(f"unsupported activation {name!r}")


def moe_router(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax (fp32) over ``mlp.gate.weight`` logits, top-k, optional renormalisation.

    ``x`` ``[N, H]``. Returns ``(logits [N, E], weights [N, k] in logits dtype, indices [N, k])``.
    """
    logits = F.linear(x, gate_weight)
    return (logits, *moe_route(logits, top_k, norm_topk_prob))


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert indices [N, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_i


def moe_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Routed experts. ``gate_up_proj`` ``[E, 2I, H]`` (rows ``:I`` gate, ``I:`` up), ``down_proj`` ``[E, H, I]``.

    ``out[n] = sum_j weights[n, j] * down_e(act(gate_e x) * up_e x)`` with ``e = indices[n, j]``.
    """
    act = activation_fn(activation)
    out = torch.zeros_like(x)
    for e in indices.unique().tolist():
        tok, slot = torch.where(indices == e)
        gate, up = F.linear(x[tok], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down_proj[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def moe_experts_sync_free(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """`moe_experts` without reading the routing back to the host (decode steps, CUDA graphs).

    Few rows (N * k < E): each row's k experts' weights are gathered and applied with batched
    matmuls. Many rows: every expert runs on every row and the routing weights (0 for experts not
    chosen) combine them; each expert's weights are then read once. Which branch runs depends on
    shapes only."""
    n, k = indices.shape
    num_experts, two_i, _ = gate_up_proj.shape
    act = activation_fn(activation)
    if n * k < num_experts:
        gu = torch.bmm(gate_up_proj[indices.flatten()], x.repeat_interleave(k, dim=0)[:, :, None])[:, :, 0]
        gate, up = gu.chunk(2, dim=-1)
        y = torch.bmm(down_proj[indices.flatten()], (act(gate) * up)[:, :, None])[:, :, 0]  # [N*k, H]
        return (y.view(n, k, -1) * weights[:, :, None]).sum(dim=1).to(x.dtype)
    dense_w = torch.zeros(n, num_experts, dtype=weights.dtype, device=x.device).scatter_(1, indices, weights)
    gu = torch.einsum("nh,eih->nei", x, gate_up_proj)
    gate, up = gu.split(two_i // 2, dim=-1)
    y = torch.einsum("nei,ehi->neh", act(gate) * up, down_proj)
    return (y * dense_w[:, :, None]).sum(dim=1).to(x.dtype)


def moe_experts_dequantized(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
                            expert_weights, activation: str = "silu", sync_free: bool = False,
                            round_input=None) -> torch.Tensor:
    """`moe_experts` on quantized experts (block_fp8.py, nvfp4.py), whose expert e's weights
    `expert_weights(e)` gives dequantized: (gate_up [2I, H], down [H, I]) float32.

    Each GEMM runs in float32 on its input (after `round_input`, the activation quantization a
    W8A8 GEMM applies; None for weight-only formats); the GEMM outputs, the activation, the
    product and the weighted rows are rounded to x's dtype, as the grouped kernels round them, and
    the k rows summed in float32. sync_free: loop over all E experts with zero weights for the
    tokens that did not choose them (no host read of the routing)."""
    n = indices.shape[0]
    dt, act = x.dtype, activation_fn(activation)
    rnd = round_input or (lambda t: t.float())
    xq = rnd(x)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    experts = range(num_experts) if sync_free else indices.unique().tolist()
    for e in experts:
        if sync_free:
            tok = torch.arange(n, device=x.device)
            w = (weights * (indices == e)).sum(-1)  # 0 where the token did not choose e
        else:
            tok, slot = torch.where(indices == e)
            w = weights[tok, slot]
        w13, w2 = expert_weights(e)
        gu = (xq[tok] @ w13.T).to(dt)
        gate, up = gu.split(w13.shape[0] // 2, dim=-1)
        a = act(gate) * up
        y = (rnd(a) @ w2.T).to(dt)
        out.index_add_(0, tok, (y * w.to(dt)[:, None]).float())
    return out.to(dt)


def moe_align_block_size(indices: torch.Tensor, num_experts: int, block_m: int,
                         num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token-choices of ``indices`` ``[N, k]`` grouped by expert, each expert's run padded to a
    multiple of ``block_m``, with no data-dependent shape (CUDA-graph safe).

    Returns ``sorted_ids [num_blocks * block_m]`` int32 (flat token-choice ids ``n * k + j``,
    expert by expert, in increasing id within an expert; padding rows hold ``N * k``),
    ``expert_ids [num_blocks]`` int32 (each block's expert; -1 for blocks past the used ones) and
    ``num_padded [1]`` int32 (the used rows). ``num_blocks`` must be at least
    ``grouped_config.max_blocks(N * k, E, block_m)``."""
    flat = indices.flatten()
    choices, dev = flat.numel(), flat.device
    sorted_e, order = torch.sort(flat.to(torch.int32), stable=True)
    starts = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, dtype=torch.int32, device=dev))
    counts = starts[1:] - starts[:-1]
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    b = torch.arange(num_blocks, device=dev)
    expert = torch.searchsorted(block_end, b, right=True)  # E for blocks past the used ones
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    row = (b - (block_end - blocks)[e])[:, None] * block_m + torch.arange(block_m, device=dev)  # within the expert
    valid = used[:, None] & (row < counts[e][:, None])
    src = (starts[e][:, None] + row).clamp(max=max(choices - 1, 0))
    ids = torch.where(valid, order[src] if choices else src, choices)
    expert_ids = torch.where(used, expert, -1)
    return (ids.flatten().to(torch.int32), expert_ids.to(torch.int32),
            (block_end[-1:] * block_m).to(torch.int32))
