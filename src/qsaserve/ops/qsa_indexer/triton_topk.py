"""Top-k of packed selection keys by radix select, one program per row (Triton).

The QSA selection takes the k largest `paged.selection_keys` of a row: (fp32 score bits << 32) +
(2^32 - 1 - group), -1 for groups the row cannot see. torch.topk on those int64 keys runs a
2-bit radix select, 32 passes over the row by one thread block; at 128K context (32K groups) that
is most of a decode step's selection time. Here one program per row:

  1. four passes of 8-bit digits over v = score bits + 1 (0 for hidden groups) find T, the k-th
     largest v, and how many groups lie strictly above it;
  2. one pass keeps every group above T and, of those equal to T, the lowest-numbered ones until
     k are kept (the keys' tie rule: equal scores, lower group first), writing their keys to a
     scratch row;
  3. the k kept keys are sorted descending in registers (bitonic), so the output is exactly
     torch.topk(keys, k).indices wherever keys are distinct, i.e. for every visible group. Where
     fewer than k groups are visible the rest are hidden ones in no particular order, as with
     torch.topk (the selection builder ignores them).

Reference: `torch.topk(keys, k, dim=1).indices` (see tests/ops/test_qsa_triton.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOW_WORD = tl.constexpr(4294967295)  # 2^32 - 1
# Largest k sorted on chip: 4096 int64 keys are 32 KiB. A QSA selection keeps budget / r groups
# (512 for qwen4exp-small); larger k, e.g. k = N in tests, goes to torch.topk (same indices).
MAX_K = 4096
# One program per row (topk_indices_triton): its time grows with N whatever the batch. Each row
# over N / 2048 programs (topk_indices_split): six launches, flat in N at few rows. Where each
# wins was timed by benchmarks/bench_qsa.py (docs/benchmarks.md, "Kernel launch choices"): rows up
# to 4096 groups take one program per row, wider rows the split kernel. Many rows (a prefill
# chunk's queries) keep one program per row: it then fills the GPU, while the split kernel's work
# grows with the rows (atomics on one histogram per row).
RADIX_MAX_GROUPS = 4096
RADIX_MIN_ROWS = 256  # about two programs per SM


@triton.jit
def _digit_value(keys):
    """v = score bits + 1 for visible keys (>= 0), 0 for hidden (-1): order-preserving, >= 0."""
    return tl.where(keys >= 0, (keys >> 32) + 1, 0)


@triton.jit
def _choose_digit(hist, need, bins):
    """From the histogram of the current digit over the groups still in play: the digit of the
    need-th largest, and how many groups have a larger digit (they are surely kept)."""
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # groups in play with digit >= bin
    chosen = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    return chosen, tl.sum(tl.where(bins == chosen, at_or_above - hist, 0), 0)


@triton.jit
def _sort_kept(scratch_row, out_row, K, K_POW2: tl.constexpr):
    """Sorts a row's K kept keys descending and stores their groups (2^32 - 1 - the low word)."""
    j = tl.arange(0, K_POW2)
    kept_keys = tl.load(scratch_row + j, mask=j < K, other=-2)  # -2: padding sorts after hidden (-1)
    kept_keys = tl.sort(kept_keys, descending=True)
    group = tl.where(kept_keys >= 0, _LOW_WORD - (kept_keys & _LOW_WORD), 0)
    tl.store(out_row + j, group, mask=j < K)


@triton.jit(do_not_specialize=["N", "K", "stride_kb", "stride_sb", "stride_ob"])
def _topk_kernel(
    keys_ptr, scratch_ptr, out_ptr, N, K,
    stride_kb, stride_sb, stride_ob,
    TILE: tl.constexpr, K_POW2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    key_row = keys_ptr + row * stride_kb
    offs = tl.arange(0, TILE)
    bins = tl.arange(0, 256)

    # 1. Radix select over v's four bytes, high to low: `prefix` holds the digits fixed so far.
    prefix = tl.zeros([], tl.int64)
    above = tl.zeros([], tl.int64)  # groups whose v is known to exceed T
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for start in range(0, N, TILE):
            n = start + offs
            v = _digit_value(tl.load(key_row + n, mask=n < N, other=-1))
            match = (n < N) & ((v >> (shift + 8)) == (prefix >> (shift + 8)))
            digit = tl.where(match, (v >> shift) & 255, 0).to(tl.int32)
            hist += tl.histogram(digit, 256)
            hist -= tl.where(bins == 0, tl.sum((~match).to(tl.int32), 0), 0)  # non-matches went to bin 0
        chosen, more = _choose_digit(hist, K - above, bins)
        above += more
        prefix = prefix | (chosen.to(tl.int64) << shift)

    # 2. Keep v > T, and the lowest-numbered of v == T until K are kept.
    ties_needed = K - above
    kept = tl.zeros([], tl.int64)
    ties = tl.zeros([], tl.int64)
    scratch_row = scratch_ptr + row * stride_sb
    for start in range(0, N, TILE):
        n = start + offs
        keys = tl.load(key_row + n, mask=n < N, other=-1)
        v = _digit_value(keys)
        tie = (n < N) & (v == prefix)
        tie_rank = ties + tl.cumsum(tie.to(tl.int64), 0) - 1
        keep = (n < N) & ((v > prefix) | (tie & (tie_rank < ties_needed)))
        slot = kept + tl.cumsum(keep.to(tl.int64), 0) - 1
        tl.store(scratch_row + slot, keys, mask=keep & (slot < K))  # exactly K are kept; never past the row
        kept += tl.sum(keep.to(tl.int64), 0)
        ties += tl.sum(tie.to(tl.int64), 0)
    tl.debug_barrier()  # the scratch row written above is read back by other threads of this program

    # 3. Sort the K kept keys descending.
    _sort_kept(scratch_row, out_ptr + row * stride_ob, K, K_POW2)


# ---- The same select with each row split over several programs (wide rows at small batch) ----
# Four launches, one per digit: every program histograms its slice of the groups still in play
# and adds it into the row's histogram of that digit (256 atomic adds); the next launch reads the
# finished histograms to fix the digits so far. The last digit's per-program histograms are also
# kept, so a program knows how many threshold ties lie in the slices before it (the tie rule keeps
# the lowest-numbered). Then one launch keeps the chosen keys (slots from an atomic counter per
# row; the sort orders them) and one sorts each row.


@triton.jit
def _threshold_so_far(ghist_row, stride_pass, K, PASSES: tl.constexpr, bins):
    """Digits fixed by the first PASSES passes (from their finished row histograms) and the count
    of groups known to be above the threshold."""
    prefix = tl.zeros([], tl.int64)
    above = tl.zeros([], tl.int64)
    for p in tl.static_range(PASSES):
        chosen, more = _choose_digit(tl.load(ghist_row + p * stride_pass + bins), K - above, bins)
        above += more
        prefix = prefix | (chosen.to(tl.int64) << (24 - 8 * p))
    return prefix, above


@triton.jit(do_not_specialize=["N", "K", "S", "stride_kb", "stride_pass"])
def _split_hist_kernel(
    keys_ptr, ghist_ptr, lhist_ptr, N, K, S, stride_kb, stride_pass,
    PASS: tl.constexpr, TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    bins = tl.arange(0, 256)
    ghist_row = ghist_ptr + row * 256
    prefix, above = _threshold_so_far(ghist_row, stride_pass, K, PASS, bins)
    shift = 24 - 8 * PASS
    n = s * TILE + tl.arange(0, TILE)
    v = _digit_value(tl.load(keys_ptr + row * stride_kb + n, mask=n < N, other=-1))
    match = (n < N) & ((v >> (shift + 8)) == (prefix >> (shift + 8)))
    hist = tl.histogram(tl.where(match, (v >> shift) & 255, 0).to(tl.int32), 256)
    hist -= tl.where(bins == 0, tl.sum((~match).to(tl.int32), 0), 0)  # non-matches went to bin 0
    tl.atomic_add(ghist_row + PASS * stride_pass + bins, hist, mask=hist > 0)
    if PASS == 3:
        tl.store(lhist_ptr + (row * S + s) * 256 + bins, hist)


@triton.jit(do_not_specialize=["N", "K", "S", "stride_kb", "stride_pass", "stride_sb"])
def _split_keep_kernel(
    keys_ptr, ghist_ptr, lhist_ptr, count_ptr, scratch_ptr, N, K, S, stride_kb, stride_pass, stride_sb,
    TILE: tl.constexpr, S_POW2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    bins = tl.arange(0, 256)
    threshold, above = _threshold_so_far(ghist_ptr + row * 256, stride_pass, K, 4, bins)
    # Groups equal to the threshold in the slices before this one: their last-digit counts.
    before = tl.arange(0, S_POW2)
    ties_before = tl.sum(tl.load(lhist_ptr + (row * S + before) * 256 + (threshold & 255), mask=before < s, other=0), 0)
    n = s * TILE + tl.arange(0, TILE)
    keys = tl.load(keys_ptr + row * stride_kb + n, mask=n < N, other=-1)
    v = _digit_value(keys)
    tie = (n < N) & (v == threshold)
    tie_rank = ties_before + tl.cumsum(tie.to(tl.int32), 0) - 1
    keep = (n < N) & ((v > threshold) | (tie & (tie_rank < K - above)))
    base = tl.atomic_add(count_ptr + row, tl.sum(keep.to(tl.int32), 0))
    slot = base + tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(scratch_ptr + row * stride_sb + slot, keys, mask=keep & (slot < K))  # exactly K are kept


@triton.jit(do_not_specialize=["K", "stride_sb", "stride_ob"])
def _sort_kernel(scratch_ptr, out_ptr, K, stride_sb, stride_ob, K_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _sort_kept(scratch_ptr + row * stride_sb, out_ptr + row * stride_ob, K, K_POW2)


def topk_indices(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The faster radix top-k for this shape (the same indices as torch.topk)."""
    if keys.shape[-1] <= RADIX_MAX_GROUPS or keys.shape[0] >= RADIX_MIN_ROWS:
        return topk_indices_triton(keys, k)
    return topk_indices_split(keys, k)


def topk_indices_triton(keys: torch.Tensor, k: int, tile: int = 2048) -> torch.Tensor:
    """keys [B, N] int64 (`paged.selection_keys`) -> [B, k] int64 group indices in descending key
    order, as torch.topk(keys, k, dim=1).indices for every visible group. Device tensors only,
    shapes from tensor shapes (CUDA-graph safe). k > MAX_K is torch.topk itself."""
    return _radix_topk(keys, k, tile, _launch_one_program_per_row)


def topk_indices_split(keys: torch.Tensor, k: int, tile: int = 2048) -> torch.Tensor:
    """As topk_indices_triton, with each row split over ceil(N / tile) programs: six launches (and
    one memset) whose time does not grow with N the way one program per row does."""
    return _radix_topk(keys, k, tile, _launch_split_rows)


def _radix_topk(keys: torch.Tensor, k: int, tile: int, launch) -> torch.Tensor:
    early = _without_kernel(keys, k)
    if early is not None:
        return early
    keys, out, scratch, tile = _buffers(keys, k, tile)
    launch(keys, k, out, scratch, tile)
    return out


def _launch_one_program_per_row(keys, k, out, scratch, tile) -> None:
    b, n = keys.shape
    _topk_kernel[(b,)](keys, scratch, out, n, k, keys.stride(0), scratch.stride(0), out.stride(0),
                       TILE=tile, K_POW2=scratch.shape[1], num_warps=8 if tile >= 1024 else 4)


def _launch_split_rows(keys, k, out, scratch, tile) -> None:
    b, n = keys.shape
    k_pow2 = scratch.shape[1]
    splits = triton.cdiv(n, tile)
    # Row histograms of the four digits, then one kept-key counter per row: one zeroed buffer.
    counters = torch.zeros(4 * b * 256 + b, dtype=torch.int32, device=keys.device)
    last_digit = torch.empty(b * splits * 256, dtype=torch.int32, device=keys.device)
    stride_pass = b * 256
    warps = 8 if tile >= 1024 else 4
    for p in range(4):
        _split_hist_kernel[(b, splits)](keys, counters, last_digit, n, k, splits, keys.stride(0), stride_pass,
                                         PASS=p, TILE=tile, num_warps=warps)
    _split_keep_kernel[(b, splits)](keys, counters, last_digit, counters[4 * b * 256:], scratch, n, k, splits,
                                    keys.stride(0), stride_pass, scratch.stride(0), TILE=tile,
                                    S_POW2=triton.next_power_of_2(splits), num_warps=warps)
    _sort_kernel[(b,)](scratch, out, k, scratch.stride(0), out.stride(0), K_POW2=k_pow2,
                       num_warps=8 if k_pow2 >= 1024 else 4)


def _buffers(keys: torch.Tensor, k: int, tile: int):
    """Both kernels' inputs and outputs: contiguous keys, the [B, k] result, the [B, k_pow2]
    scratch the sort reads, and the key tile clamped to the row width."""
    b, n = keys.shape
    out = torch.empty((b, k), dtype=torch.int64, device=keys.device)
    scratch = torch.empty((b, triton.next_power_of_2(k)), dtype=torch.int64, device=keys.device)
    return keys.contiguous(), out, scratch, min(tile, max(16, triton.next_power_of_2(n)))


def _without_kernel(keys: torch.Tensor, k: int) -> torch.Tensor | None:
    """Checks the arguments; the answer where no kernel is needed (or none fits), else None."""
    if keys.dtype != torch.int64 or keys.dim() != 2:
        raise ValueError(f"keys: expected a 2-D int64 tensor, got {keys.dtype} {tuple(keys.shape)}")
    b, n = keys.shape
    if not 0 <= k <= n:
        raise ValueError(f"k: must be in [0, {n}], got {k}")
    if k == 0 or b == 0:  # as torch.topk: nothing to choose (no complete group yet, or budget < r)
        return torch.empty((b, k), dtype=torch.int64, device=keys.device)
    if k > MAX_K:  # the sort holds k keys on chip; past this it would not fit an SM's shared memory
        return torch.topk(keys, k, dim=1).indices
    return None


__all__ = ["MAX_K", "RADIX_MAX_GROUPS", "RADIX_MIN_ROWS", "topk_indices", "topk_indices_split", "topk_indices_triton"]
