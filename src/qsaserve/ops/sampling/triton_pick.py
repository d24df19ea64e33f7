"""The greedy pick in two short launches instead of torch's three (argmax, isfinite().all() and the
stack of their results; the argmax alone took 27 us on one 128,256-wide row of an H200, one SM
streaming the row):

1. grid (rows, chunks of CHUNK values): each program reads its chunk once and writes the chunk's
   largest value, the first index holding it (tl.argmax's left tie-break) and whether all its
   values are finite;
2. grid (rows,): the largest of a row's chunk maxima, the first chunk holding it (chunks in index
   order, so its index is the row's first occurrence, as torch.argmax), and the row's finiteness,
   to tokens [B] and packed [B, 2].

Deterministic (no atomics); a row with NaN / inf gets some token that its caller must not use."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # values a first-pass program reads: 32 programs for a 128,256-wide row


@triton.jit(do_not_specialize=["V", "stride_x", "n_chunks"])
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, fin_ptr, V, stride_x, n_chunks, CHUNK_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    idx = c * CHUNK_ + tl.arange(0, CHUNK_)
    ok = idx < V
    x = tl.load(x_ptr + row * stride_x + idx, mask=ok, other=0.0).to(tl.float32)
    finite = tl.min(tl.where(ok, ((x - x) == 0.0).to(tl.int32), 1), 0)  # NaN and +-inf give NaN
    x = tl.where(ok, x, float("-inf"))
    top = tl.max(x, 0)
    first = tl.min(tl.where(x == top, idx, V), 0)  # no lane equals a NaN top: V, later mapped to 0
    out = row * n_chunks + c
    tl.store(val_ptr + out, top)
    tl.store(idx_ptr + out, first)
    tl.store(fin_ptr + out, finite)


@triton.jit(do_not_specialize=["V", "n_chunks"])
def _row_pick_kernel(val_ptr, idx_ptr, fin_ptr, tok_ptr, packed_ptr, V, n_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    ok = c < n_chunks
    val = tl.load(val_ptr + row * n_chunks + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * n_chunks + c, mask=ok, other=V)
    finite = tl.min(tl.load(fin_ptr + row * n_chunks + c, mask=ok, other=1), 0)
    top = tl.max(val, 0)
    token = tl.min(tl.where(val == top, idx, V), 0)  # the first chunk holding the maximum
    token = tl.where(token >= V, 0, token).to(tl.int64)
    tl.store(tok_ptr + row, token)
    tl.store(packed_ptr + row * 2, token)
    tl.store(packed_ptr + row * 2 + 1, finite.to(tl.int64))


def greedy_pick_triton(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (unit last stride) -> (tokens [B] int64, packed [B, 2] int64), as
    reference.greedy_pick_reference."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"greedy_pick: logits must be [B, V] with a unit last stride, got {tuple(logits.shape)}")
    b, v = logits.shape
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    packed = torch.empty(b, 2, dtype=torch.int64, device=logits.device)
    if not b:
        return tokens, packed
    if not v:
        raise ValueError("greedy_pick: logits rows must not be empty")
    chunk = min(CHUNK, triton.next_power_of_2(v))
    n_chunks = triton.cdiv(v, chunk)
    vals = torch.empty(b, n_chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(b, n_chunks, dtype=torch.int32, device=logits.device)
    fins = torch.empty(b, n_chunks, dtype=torch.int32, device=logits.device)
    _chunk_max_kernel[(b, n_chunks)](logits, vals, idxs, fins, v, logits.stride(0), n_chunks, CHUNK_=chunk,
                                     num_warps=4 if chunk >= 1024 else 1)
    # chunks padded to a power of two, at least 64: one build for every vocabulary up to 256K
    _row_pick_kernel[(b,)](vals, idxs, fins, tokens, packed, v, n_chunks,
                           CHUNKS=max(64, triton.next_power_of_2(n_chunks)), num_warps=1)
    return tokens, packed


__all__ = ["CHUNK", "greedy_pick_triton"]
