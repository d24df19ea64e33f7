"""Plain-PyTorch reference of the Qwen4Exp QSA (Qwen sparse attention) token indexer.

Per QSA layer and request (transformers ``Qwen4ExpTextQSAIndexer``):

* ``index_qk_proj(h)`` -> ``n_heads`` query heads + 1 key head, each ``head_dim``.
  Queries: 1-centred RMSNorm (``q_layernorm``) then RoPE at the query position.
  Keys: cached *raw* (no norm, no RoPE), one ``[head_dim]`` vector per token.
* Block ``b`` = raw keys of tokens ``[b*r, (b+1)*r)``: mean (fp32, cast back to the key dtype)
  -> 1-centred RMSNorm (``k_layernorm``) -> RoPE at position ``b*r``. A block key depends only on
  its own ``r`` raw keys, so it can be computed once when the block completes and cached.
* ``score(q, b) = sum_h relu(q_h . key_b) / sqrt(head_dim)`` (fp32).
* A query at absolute position ``p`` sees tokens ``0..p`` (itself included): the complete blocks
  ``b < (p+1)//r`` and the open tail ``[(p+1)//r*r, p]``. It keeps the top
  ``budget // r`` complete blocks by score (all of them when fewer) plus the whole tail.
  When ``(p+1) % r == 0`` the query's own block is complete and the tail is empty, so the query
  attends to itself only if its block wins.

Tie-breaking: transformers calls ``torch.topk`` on the 1-D score vector of the visible blocks;
on CPU its choice among equal scores is implementation-defined (libstdc++ nth_element /
partial_sort), not index-ordered. Exact ties are common because ReLU maps many scores to 0.
``tie_break="torch"`` reproduces transformers on CPU by making the very same ``torch.topk`` call;
``tie_break="lowest_index"`` is a deterministic rule (earlier block wins) for kernels.
"""

from __future__ import annotations

import math

import torch

from qsaserve.ops import rope
from qsaserve.ops.fused.reference import rms_norm_one_centred

__all__ = [
    "rms_norm_one_centred",
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_partial_rope",
    "indexer_project",
    "pool_block_keys",
    "index_scores",
    "visible_block_count",
    "select_tokens",
    "qsa_select_reference",
    "select_tokens_bruteforce",
    "max_selected_tokens",
]


def rope_inv_freq(head_dim: int, partial_rotary_factor: float = 1.0, rope_theta: float = 10000.0) -> torch.Tensor:
    """Default-RoPE inverse frequencies over ``rotary_dim = int(head_dim * partial_rotary_factor)``
    (`ops.rope.rope_inv_freq` in Qwen4Exp's config terms)."""
    return rope.rope_inv_freq(int(head_dim * partial_rotary_factor), rope_theta)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[..., rotary_dim]`` (frequencies repeated twice, rotate-half layout).

    Text-only Qwen4Exp uses identical t/h/w positions, so its interleaved M-RoPE reduces to this.
    Computed in fp32 then cast to ``dtype`` like transformers (which casts to the hidden dtype).
    """
    freqs = positions.float()[..., None] * inv_freq.float().to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` (rotate-half), pass the rest through.

    ``cos``/``sin`` must broadcast against ``x[..., :rotary_dim]`` (unsqueeze head dims first).
    Arithmetic happens in the common dtype of ``x`` and ``cos`` (transformers: the model dtype).
    """
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def indexer_project(
    hidden: torch.Tensor,
    index_qk_proj_weight: torch.Tensor,
    q_layernorm_weight: torch.Tensor,
    n_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer projection for ``T`` tokens of one request.

    ``hidden`` ``[T, hidden_size]`` (the mixed GatedResidual output fed to attention), ``cos``/``sin``
    ``[T, rotary_dim]`` at the tokens' positions. Returns ``q`` ``[T, n_heads, head_dim]``
    (normed + roped) and the raw keys ``[T, head_dim]`` to append to the indexer key cache.
    """
    qk = hidden @ index_qk_proj_weight.t()
    q = qk[..., : n_heads * head_dim].reshape(*hidden.shape[:-1], n_heads, head_dim)
    raw_keys = qk[..., n_heads * head_dim :]
    if raw_keys.shape[-1] != head_dim:
        raise ValueError(f"index_qk_proj must emit {n_heads}+1 heads of {head_dim}, got {qk.shape[-1]} features")
    q = rms_norm_one_centred(q, q_layernorm_weight, eps)
    q = apply_partial_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
    return q, raw_keys


def pool_block_keys(
    raw_keys: torch.Tensor,
    k_layernorm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    compress_ratio: int,
    eps: float,
    first_block: int = 0,
) -> torch.Tensor:
    """Block keys for the complete blocks of ``raw_keys`` ``[N, head_dim]``.

    ``raw_keys[0]`` is the first token of block ``first_block`` (position ``first_block * r``);
    a trailing incomplete group is ignored. Returns ``[N // r, head_dim]`` in ``raw_keys.dtype``.
    """
    r = compress_ratio
    nb = raw_keys.shape[0] // r
    groups = raw_keys[: nb * r].reshape(nb, r, raw_keys.shape[-1])
    pooled = groups.float().mean(dim=1).to(raw_keys.dtype)
    pooled = rms_norm_one_centred(pooled, k_layernorm_weight, eps)
    starts = (torch.arange(nb, device=raw_keys.device) + first_block) * r
    cos, sin = rope_cos_sin(starts, inv_freq, raw_keys.dtype)
    return apply_partial_rope(pooled, cos, sin)


def index_scores(q: torch.Tensor, block_keys: torch.Tensor) -> torch.Tensor:
    """``[Tq, Nb]`` fp32 scores: ``sum_h relu(q[t, h] . block_keys[b]) / sqrt(head_dim)``."""
    dots = torch.matmul(q.float(), block_keys.float().t())  # [Tq, H, Nb]
    return dots.relu().sum(dim=-2) / math.sqrt(q.shape[-1])


def visible_block_count(position: int, compress_ratio: int) -> int:
    """Complete blocks visible to a query at absolute position ``position`` (sees ``0..position``)."""
    return (position + 1) // compress_ratio


def max_selected_tokens(budget: int, compress_ratio: int) -> int:
    """Width of the selection: ``budget`` block tokens plus at most ``r - 1`` tail tokens."""
    return budget + compress_ratio - 1


def _topk_blocks(row: torch.Tensor, k: int, tie_break: str) -> torch.Tensor:
    if tie_break == "torch":
        # The same 1-D call as transformers: identical choice among ties on the same device.
        return torch.topk(row, k, dim=0).indices
    if tie_break == "lowest_index":
        return torch.sort(row, descending=True, stable=True).indices[:k]
    raise ValueError(f"unknown tie_break {tie_break!r}")


def select_tokens(
    scores: torch.Tensor,
    query_positions: torch.Tensor,
    compress_ratio: int,
    budget: int,
    tie_break: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token selection from block scores for queries of one request.

    ``scores`` ``[Tq, Nb]`` (block ``b`` = tokens ``[b*r, (b+1)*r)``; must cover the blocks visible
    to the last query), ``query_positions`` ``[Tq]`` absolute positions. Returns
    ``indices`` ``[Tq, budget + r - 1]`` int64 token positions, ``-1`` padded, in transformers'
    order (selected blocks in top-k order, each block's tokens ascending, then the tail), and
    ``counts`` ``[Tq]``.
    """
    r = compress_ratio
    block_topk = budget // r
    positions = [int(p) for p in query_positions.tolist()]
    width = max_selected_tokens(budget, r)
    indices = torch.full((len(positions), width), -1, dtype=torch.long)
    counts = torch.zeros(len(positions), dtype=torch.long)
    offsets = torch.arange(r)
    for i, p in enumerate(positions):
        nb = visible_block_count(p, r)
        if nb > scores.shape[1]:
            raise ValueError(f"query at position {p} sees {nb} blocks but only {scores.shape[1]} were scored")
        parts = []
        if nb > 0:
            chosen = _topk_blocks(scores[i, :nb].contiguous(), min(block_topk, nb), tie_break).cpu()
            parts.append((chosen[:, None] * r + offsets).flatten())
        parts.append(torch.arange(nb * r, p + 1))
        sel = torch.cat(parts)
        indices[i, : sel.numel()] = sel
        counts[i] = sel.numel()
    return indices.to(scores.device), counts.to(scores.device)


def qsa_select_reference(
    q: torch.Tensor,
    raw_keys: torch.Tensor,
    query_positions: torch.Tensor,
    k_layernorm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    compress_ratio: int,
    budget: int,
    eps: float,
    tie_break: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole indexer selection for queries of one request.

    ``q`` ``[Tq, n_heads, head_dim]`` from :func:`indexer_project`; ``raw_keys`` ``[N, head_dim]``
    the request's raw key cache (positions ``0..N-1``, already including this chunk's tokens);
    ``query_positions`` ``[Tq]`` (each ``< N``). Returns ``(indices, counts)`` as
    :func:`select_tokens`.
    """
    block_keys = pool_block_keys(raw_keys, k_layernorm_weight, inv_freq, compress_ratio, eps)
    scores = index_scores(q, block_keys)
    return select_tokens(scores, query_positions, compress_ratio, budget, tie_break)


def select_tokens_bruteforce(
    q: torch.Tensor,
    raw_keys: torch.Tensor,
    query_positions: list[int],
    k_layernorm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    compress_ratio: int,
    budget: int,
    eps: float,
) -> list[tuple[list[int], list[float]]]:
    """Independent scalar-loop enumeration (fp64) used to check the vectorised path.

    For every query it scores each visible complete block from scratch, ranks blocks by
    ``(-score, block index)`` (ties: lower index) and returns ``(sorted token positions,
    per-block scores)``.
    """
    r = compress_ratio
    k_blocks = budget // r
    d = raw_keys.shape[-1]
    half = inv_freq.numel()
    w = [1.0 + float(x) for x in k_layernorm_weight.tolist()]
    freqs = [float(x) for x in inv_freq.tolist()]
    keys = raw_keys.double().tolist()
    results = []
    for qi, p in enumerate(query_positions):
        nb = (p + 1) // r
        qh = q[qi].double().tolist()
        block_scores = []
        for b in range(nb):
            mean = [sum(keys[b * r + j][c] for j in range(r)) / r for c in range(d)]
            inv_rms = 1.0 / math.sqrt(sum(x * x for x in mean) / d + eps)
            normed = [mean[c] * inv_rms * w[c] for c in range(d)]
            key = list(normed)
            for i in range(half):
                angle = (b * r) * freqs[i]
                x1, x2 = normed[i], normed[i + half]
                key[i] = x1 * math.cos(angle) - x2 * math.sin(angle)
                key[i + half] = x2 * math.cos(angle) + x1 * math.sin(angle)
            score = sum(max(0.0, sum(a * c for a, c in zip(head, key))) for head in qh) / math.sqrt(d)
            block_scores.append(score)
        ranked = sorted(range(nb), key=lambda b: (-block_scores[b], b))[:k_blocks]
        tokens = [b * r + j for b in ranked for j in range(r)] + list(range(nb * r, p + 1))
        results.append((sorted(tokens), block_scores))
    return results
