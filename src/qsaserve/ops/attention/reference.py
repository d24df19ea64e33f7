"""Plain-torch paged attention: the reference every attention kernel is tested against.

One entry point covers prefill, chunked prefill over a cached prefix, and decode: each
sequence's new queries attend causally over its whole context, read from pages through its
block table. Math in float32. An FP8 E4M3 cache is quantized on write and dequantized on read
with the layer's per-tensor k_scale / v_scale (ops/fp8.py).

A layer may also carry a K offset m ([Hkv, D], calibrated per channel): keys are stored as
k - m. Softmax over keys does not see it (q.(k - m) = q.k - q.m, one constant per query and
head), so attention is exact while the stored keys lose their per-channel bias and quantize with
far less error. Readers need not add m back; an LSE comes out shifted by q.m * scale, the same
constant on every shard of a sequence, so split-K / DCP merges stay exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qsaserve.ops.fp8 import is_fp8, load_rows, store_rows


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                       k_offset: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; slot_mapping: [T].
    Scales are required (and only used) for an FP8 cache; k_offset ([Hkv, D] float32, or None)
    is subtracted from every key before it is stored."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    if k_offset is not None:
        if k_offset.shape != k.shape[1:]:
            raise ValueError(f"k_offset: shape {tuple(k_offset.shape)} does not match the keys' [Hkv, D] {tuple(k.shape[1:])}")
        k = k.float() - k_offset
    store_rows(flat[0], slot_mapping, k, k_scale)
    store_rows(flat[1], slot_mapping, v, v_scale)


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` tokens of one sequence's K and V: [length, Hkv, D] each (float32,
    dequantized, when the cache is FP8; else the cache dtype)."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-length // block_size)].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:length]
    v = kv_cache[1, blocks].flatten(0, 1)[:length]
    if is_fp8(kv_cache.dtype):
        k, v = load_rows(k, k_scale), load_rows(v, v_scale)
    return k, v


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] (sequences concatenated); seq_lens[i] counts sequence i's context
    including its query_lens[i] new tokens, which are its last ones. Returns [T, Hq, D].

    All sequences go through one padded SDPA call. Key rows past a sequence's length are
    zeroed, not just masked: a page's stale or padding bytes may decode to NaN, and a masked
    NaN still poisons P@V (0 * NaN = NaN). Under FP8 this covers the null block and free pages,
    whose bytes may be E4M3 NaN (0x7F / 0xFF): they are dequantized, then replaced by zeros."""
    dev = q.device
    num_seqs, n_max, l_max = len(query_lens), max(query_lens), max(seq_lens)
    block_size = kv_cache.shape[2]
    q_lens = torch.tensor(query_lens, device=dev)
    s_lens = torch.tensor(seq_lens, device=dev)
    tables = block_tables[:, : -(-l_max // block_size)].long()
    k = load_rows(kv_cache[0][tables].flatten(1, 2)[:, :l_max], k_scale)  # [B, L, Hkv, D] fp32
    v = load_rows(kv_cache[1][tables].flatten(1, 2)[:, :l_max], v_scale)
    key_pos = torch.arange(l_max, device=dev)
    valid = key_pos[None, :] < s_lens[:, None]  # [B, L]
    k = torch.where(valid[:, :, None, None], k, 0.0)
    v = torch.where(valid[:, :, None, None], v, 0.0)

    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=dev), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    row_of_token = torch.arange(q.shape[0], device=dev) - starts[seq_of_token]
    q_pad = q.new_zeros((num_seqs, n_max) + q.shape[1:], dtype=torch.float32)
    q_pad[seq_of_token, row_of_token] = q.float()
    # Query row j of sequence i sits at position seq_len - query_len + j.
    q_pos = (s_lens - q_lens)[:, None] + torch.arange(n_max, device=dev)[None, :]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [B, n, L]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )  # [B, Hq, n, D]
    return out.transpose(1, 2)[seq_of_token, row_of_token].to(q.dtype)
