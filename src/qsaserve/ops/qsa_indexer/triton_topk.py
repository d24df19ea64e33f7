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

Given the rows' positions (the model's calls), a row's scan stops at its visible groups,
(position + 1) // ratio (every later key is hidden, -1): the hidden keys past it are counted into
the first digits' histograms without being read, and any of the k slots the visible groups do
not fill is a hidden key (group 0, as a hidden key's sort maps): the same output as the full
scan, in a time that follows the context rather than the keys' width (a CUDA graph's keys are
max_model_len / ratio wide at every context).

Few rows of few groups (a decode step's selection: 1-2 K groups a row at 4-8K context) take a
third form, topk_indices_rank: a visible key's place in the descending order is the count of
keys above it (keys of visible groups are distinct), so programs over (row, 64 groups) count
ranks against the row's visible keys and store each kept group at its rank: one launch, no
sort, the row spread over N / 64 programs (in a qwen4exp-small batch-1 step at 8K context: 13 us
a layer, where one program per row took 37). Its work grows with N^2 a row, so it serves rows x
N^2 <= RANK_MAX_COMPARES up to RANK_MAX_GROUPS groups.

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
# rows x N^2 key comparisons the rank form takes, and its widest rows (bench_qsa.py --topk-only on
# an H200, bench_topk_h200_2026-12-06_829651f.json: at 2,250 groups ranks took 12.3 / 15.5 / 29.4 us
# at 1 / 8 / 16 rows against the radix select's 18.3; at 4,096 groups 21.8 / 53.4 us at 2 / 8 rows
# against 29.3; at 8,192 groups 41 us at 1 row, the split rows 31.7)
RANK_MAX_COMPARES = 40 << 20
RANK_MAX_GROUPS = 4096
RANK_TILE = 64  # groups a rank program places
RANK_SCAN = 256  # keys it compares them with at a time


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
def _visible_groups(pos_ptr, row, ratio, N, HAS_POS: tl.constexpr):
    """The row's groups that can hold visible keys: (position + 1) // ratio of them, clamped to
    [0, N] (selection_keys' rule: every later group is hidden, -1), or all N without positions."""
    if HAS_POS:
        pos = tl.load(pos_ptr + row).to(tl.int64)
        return tl.minimum(tl.maximum((pos + 1) // ratio, 0), N)
    return N + tl.zeros([], tl.int64)


@triton.jit
def _hidden_in_bin0(bins, prefix, shift, hidden):
    """The hidden keys past the scan (v = 0: every digit 0) as the histogram of the current digit
    would count them: in bin 0 while the digits fixed so far are all 0."""
    return tl.where((bins == 0) & ((prefix >> (shift + 8)) == 0), hidden, 0).to(tl.int32)


@triton.jit
def _sort_kept(scratch_row, out_row, K, kept, K_POW2: tl.constexpr):
    """Sorts a row's K kept keys descending and stores their groups (2^32 - 1 - the low word).
    kept < K: the scan stopped at the visible groups, so the rest are hidden keys (-1: group 0,
    as a hidden group's key maps)."""
    j = tl.arange(0, K_POW2)
    kept_keys = tl.load(scratch_row + j, mask=j < tl.minimum(kept, K), other=-1)
    kept_keys = tl.where(j < K, kept_keys, -2)  # -2: padding sorts after hidden (-1)
    kept_keys = tl.sort(kept_keys, descending=True)
    group = tl.where(kept_keys >= 0, _LOW_WORD - (kept_keys & _LOW_WORD), 0)
    tl.store(out_row + j, group, mask=j < K)


# pos_ptr: the rows' positions, often a view at any offset (one build whatever its alignment)
@triton.jit(do_not_specialize=["N", "K", "stride_kb", "stride_sb", "stride_ob", "ratio"],
            do_not_specialize_on_alignment=["pos_ptr"])
def _topk_kernel(
    keys_ptr, scratch_ptr, out_ptr, N, K,
    stride_kb, stride_sb, stride_ob, pos_ptr, ratio,
    TILE: tl.constexpr, K_POW2: tl.constexpr, HAS_POS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    key_row = keys_ptr + row * stride_kb
    offs = tl.arange(0, TILE)
    bins = tl.arange(0, 256)
    nv = _visible_groups(pos_ptr, row, ratio, N, HAS_POS)  # groups past nv are hidden: not read

    # 1. Radix select over v's four bytes, high to low: `prefix` holds the digits fixed so far.
    prefix = tl.zeros([], tl.int64)
    above = tl.zeros([], tl.int64)  # groups whose v is known to exceed T
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = _hidden_in_bin0(bins, prefix, shift, N - nv)
        for start in range(0, nv, TILE):
            n = start + offs
            v = _digit_value(tl.load(key_row + n, mask=n < nv, other=-1))
            match = (n < nv) & ((v >> (shift + 8)) == (prefix >> (shift + 8)))
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
    for start in range(0, nv, TILE):
        n = start + offs
        keys = tl.load(key_row + n, mask=n < nv, other=-1)
        v = _digit_value(keys)
        tie = (n < nv) & (v == prefix)
        tie_rank = ties + tl.cumsum(tie.to(tl.int64), 0) - 1
        keep = (n < nv) & ((v > prefix) | (tie & (tie_rank < ties_needed)))
        slot = kept + tl.cumsum(keep.to(tl.int64), 0) - 1
        tl.store(scratch_row + slot, keys, mask=keep & (slot < K))  # exactly K are kept; never past the row
        kept += tl.sum(keep.to(tl.int64), 0)
        ties += tl.sum(tie.to(tl.int64), 0)
    tl.debug_barrier()  # the scratch row written above is read back by other threads of this program

    # 3. Sort the K kept keys descending (hidden ones after them where the scan kept fewer).
    _sort_kept(scratch_row, out_ptr + row * stride_ob, K, kept, K_POW2)


@triton.jit(do_not_specialize=["N", "K", "stride_kb", "stride_ob", "ratio"], do_not_specialize_on_alignment=["pos_ptr"])
def _rank_kernel(keys_ptr, out_ptr, N, K, stride_kb, stride_ob, pos_ptr, ratio,
                 TILE: tl.constexpr, SCAN: tl.constexpr, HAS_POS: tl.constexpr):
    """Program (row, t): the groups t * TILE + [0, TILE) of the row. Each visible key's rank is
    the number of visible keys above it (they are distinct: the low word is the group); a rank
    below K is its output slot. Slots from the row's visible count up to K get group 0 (a hidden
    key's group, as _sort_kept maps it), each from the program whose tile holds that slot."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * TILE + tl.arange(0, TILE)
    nv = _visible_groups(pos_ptr, row, ratio, N, HAS_POS)
    key_row = keys_ptr + row * stride_kb
    out_row = out_ptr + row * stride_ob
    if tl.program_id(1) * TILE < tl.maximum(nv, K):  # else no group to place and no slot to fill
        ki = tl.load(key_row + i, mask=i < nv, other=-1)
        rank = tl.zeros([TILE], dtype=tl.int32)
        visible = tl.zeros([], dtype=tl.int32)
        j = tl.arange(0, SCAN)
        for j0 in range(0, nv, SCAN):
            kj = tl.load(key_row + j0 + j, mask=j0 + j < nv, other=-1)
            rank += tl.sum((kj[None, :] > ki[:, None]).to(tl.int32), 1)
            visible += tl.sum((kj >= 0).to(tl.int32), 0)
        group = _LOW_WORD - (ki & _LOW_WORD)
        tl.store(out_row + rank, group, mask=(ki >= 0) & (rank < K))
        tl.store(out_row + i, tl.zeros([TILE], dtype=tl.int64), mask=(i >= visible) & (i < K))


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


@triton.jit(do_not_specialize=["N", "K", "S", "stride_kb", "stride_pass", "ratio"], do_not_specialize_on_alignment=["pos_ptr"])
def _split_hist_kernel(
    keys_ptr, ghist_ptr, lhist_ptr, N, K, S, stride_kb, stride_pass, pos_ptr, ratio,
    PASS: tl.constexpr, TILE: tl.constexpr, HAS_POS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    bins = tl.arange(0, 256)
    ghist_row = ghist_ptr + row * 256
    prefix, above = _threshold_so_far(ghist_row, stride_pass, K, PASS, bins)
    shift = 24 - 8 * PASS
    nv = _visible_groups(pos_ptr, row, ratio, N, HAS_POS)  # slices past nv read nothing
    n = s * TILE + tl.arange(0, TILE)
    v = _digit_value(tl.load(keys_ptr + row * stride_kb + n, mask=n < nv, other=-1))
    match = (n < nv) & ((v >> (shift + 8)) == (prefix >> (shift + 8)))
    hist = tl.histogram(tl.where(match, (v >> shift) & 255, 0).to(tl.int32), 256)
    hist -= tl.where(bins == 0, tl.sum((~match).to(tl.int32), 0), 0)  # non-matches went to bin 0
    # the hidden groups past nv, counted once a row (slice 0); the ties' per-slice counts leave them out
    counted = hist + tl.where(s == 0, _hidden_in_bin0(bins, prefix, shift, N - nv), 0)
    tl.atomic_add(ghist_row + PASS * stride_pass + bins, counted, mask=counted > 0)
    if PASS == 3:
        tl.store(lhist_ptr + (row * S + s) * 256 + bins, hist)


@triton.jit(do_not_specialize=["N", "K", "S", "stride_kb", "stride_pass", "stride_sb", "ratio"],
            do_not_specialize_on_alignment=["pos_ptr"])
def _split_keep_kernel(
    keys_ptr, ghist_ptr, lhist_ptr, count_ptr, scratch_ptr, N, K, S, stride_kb, stride_pass, stride_sb,
    pos_ptr, ratio, TILE: tl.constexpr, S_POW2: tl.constexpr, HAS_POS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    bins = tl.arange(0, 256)
    threshold, above = _threshold_so_far(ghist_ptr + row * 256, stride_pass, K, 4, bins)
    # Groups equal to the threshold in the slices before this one: their last-digit counts.
    before = tl.arange(0, S_POW2)
    ties_before = tl.sum(tl.load(lhist_ptr + (row * S + before) * 256 + (threshold & 255), mask=before < s, other=0), 0)
    nv = _visible_groups(pos_ptr, row, ratio, N, HAS_POS)
    n = s * TILE + tl.arange(0, TILE)
    keys = tl.load(keys_ptr + row * stride_kb + n, mask=n < nv, other=-1)
    v = _digit_value(keys)
    tie = (n < nv) & (v == threshold)
    tie_rank = ties_before + tl.cumsum(tie.to(tl.int32), 0) - 1
    keep = (n < nv) & ((v > threshold) | (tie & (tie_rank < K - above)))
    base = tl.atomic_add(count_ptr + row, tl.sum(keep.to(tl.int32), 0))
    slot = base + tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(scratch_ptr + row * stride_sb + slot, keys, mask=keep & (slot < K))  # at most K are kept


@triton.jit(do_not_specialize=["K", "stride_sb", "stride_ob"])
def _sort_kernel(scratch_ptr, count_ptr, out_ptr, K, stride_sb, stride_ob, K_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _sort_kept(scratch_ptr + row * stride_sb, out_ptr + row * stride_ob, K, tl.load(count_ptr + row), K_POW2)


def rank_takes(rows: int, groups: int) -> bool:
    """Whether topk_indices gives rows x groups keys to the rank form."""
    return groups <= RANK_MAX_GROUPS and rows * groups * groups <= RANK_MAX_COMPARES


def topk_forms(groups: int) -> list:
    """The forms topk_indices may pick for rows of this width at some row count (what a warm-up
    builds): ranks where one row takes them, one program a row (prefill chunks' many rows), and
    the split rows past RADIX_MAX_GROUPS."""
    forms = [topk_indices_rank] if rank_takes(1, groups) else []
    forms.append(topk_indices_triton)
    if groups > RADIX_MAX_GROUPS:
        forms.append(topk_indices_split)
    return forms


def topk_indices(keys: torch.Tensor, k: int, positions: torch.Tensor | None = None, ratio: int = 1) -> torch.Tensor:
    """The fastest top-k form for this shape (the same indices as torch.topk): ranks for few
    rows of few groups, else the radix select (one program a row, or rows split)."""
    if keys.dim() == 2 and rank_takes(keys.shape[0], keys.shape[1]):
        return topk_indices_rank(keys, k, positions=positions, ratio=ratio)
    if keys.shape[-1] <= RADIX_MAX_GROUPS or keys.shape[0] >= RADIX_MIN_ROWS:
        return topk_indices_triton(keys, k, positions=positions, ratio=ratio)
    return topk_indices_split(keys, k, positions=positions, ratio=ratio)


def topk_indices_triton(keys: torch.Tensor, k: int, tile: int = 2048, positions: torch.Tensor | None = None,
                        ratio: int = 1) -> torch.Tensor:
    """keys [B, N] int64 (`paged.selection_keys`) -> [B, k] int64 group indices in descending key
    order, as torch.topk(keys, k, dim=1).indices for every visible group. Device tensors only,
    shapes from tensor shapes (CUDA-graph safe). k > MAX_K is torch.topk itself.
    positions [B] (with the keys' ratio): each row's keys past group (position + 1) // ratio are
    hidden (selection_keys' rule), so the scan stops there and its time follows the context, not
    N (a CUDA graph's keys are max_model_len / ratio wide); the result is the same."""
    return _radix_topk(keys, k, tile, _launch_one_program_per_row, positions, ratio)


def topk_indices_split(keys: torch.Tensor, k: int, tile: int = 2048, positions: torch.Tensor | None = None,
                       ratio: int = 1) -> torch.Tensor:
    """As topk_indices_triton, with each row split over ceil(N / tile) programs: six launches (and
    one memset) whose time does not grow with N the way one program per row does (slices past a
    row's visible groups read nothing)."""
    return _radix_topk(keys, k, tile, _launch_split_rows, positions, ratio)


def topk_indices_rank(keys: torch.Tensor, k: int, positions: torch.Tensor | None = None,
                      ratio: int = 1) -> torch.Tensor:
    """As topk_indices_triton, each row's groups placed by rank over ceil(N / RANK_TILE) programs
    (one launch; its work is rows x N^2 comparisons, for few rows of few groups)."""
    early = _without_kernel(keys, k)
    if early is not None:
        return early
    keys = keys.contiguous()
    positions = _checked_positions(keys, positions, ratio)
    b, n = keys.shape
    out = torch.empty((b, k), dtype=torch.int64, device=keys.device)
    _rank_kernel[(b, triton.cdiv(n, RANK_TILE))](
        keys, out, n, k, keys.stride(0), out.stride(0), keys if positions is None else positions, ratio,
        TILE=RANK_TILE, SCAN=RANK_SCAN, HAS_POS=positions is not None, num_warps=4)
    return out


def _checked_positions(keys: torch.Tensor, positions: torch.Tensor | None, ratio: int) -> torch.Tensor | None:
    if positions is None:
        return None
    if positions.shape != keys.shape[:1] or ratio < 1:
        raise ValueError(f"positions: one per row of keys {tuple(keys.shape)} with ratio >= 1, got "
                         f"{tuple(positions.shape)}, ratio {ratio}")
    return positions.contiguous()


def _radix_topk(keys: torch.Tensor, k: int, tile: int, launch, positions: torch.Tensor | None,
                ratio: int) -> torch.Tensor:
    early = _without_kernel(keys, k)
    if early is not None:
        return early
    keys, out, scratch, tile = _buffers(keys, k, tile)
    positions = _checked_positions(keys, positions, ratio)
    launch(keys, k, out, scratch, tile, positions, ratio)
    return out


def _launch_one_program_per_row(keys, k, out, scratch, tile, positions, ratio) -> None:
    b, n = keys.shape
    _topk_kernel[(b,)](keys, scratch, out, n, k, keys.stride(0), scratch.stride(0), out.stride(0),
                       keys if positions is None else positions, ratio, TILE=tile, K_POW2=scratch.shape[1],
                       HAS_POS=positions is not None, num_warps=8 if tile >= 1024 else 4)


def _launch_split_rows(keys, k, out, scratch, tile, positions, ratio) -> None:
    b, n = keys.shape
    k_pow2 = scratch.shape[1]
    splits = triton.cdiv(n, tile)
    # Row histograms of the four digits, then one kept-key counter per row: one zeroed buffer.
    counters = torch.zeros(4 * b * 256 + b, dtype=torch.int32, device=keys.device)
    last_digit = torch.empty(b * splits * 256, dtype=torch.int32, device=keys.device)
    stride_pass = b * 256
    warps = 8 if tile >= 1024 else 4
    pos = keys if positions is None else positions
    for p in range(4):
        _split_hist_kernel[(b, splits)](keys, counters, last_digit, n, k, splits, keys.stride(0), stride_pass, pos,
                                         ratio, PASS=p, TILE=tile, HAS_POS=positions is not None, num_warps=warps)
    count = counters[4 * b * 256:]
    _split_keep_kernel[(b, splits)](keys, counters, last_digit, count, scratch, n, k, splits,
                                    keys.stride(0), stride_pass, scratch.stride(0), pos, ratio, TILE=tile,
                                    S_POW2=triton.next_power_of_2(splits), HAS_POS=positions is not None,
                                    num_warps=warps)
    _sort_kernel[(b,)](scratch, count, out, k, scratch.stride(0), out.stride(0), K_POW2=k_pow2,
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


__all__ = ["MAX_K", "RADIX_MAX_GROUPS", "RADIX_MIN_ROWS", "RANK_MAX_COMPARES", "RANK_MAX_GROUPS", "rank_takes", "topk_forms", "topk_indices",
           "topk_indices_rank", "topk_indices_split", "topk_indices_triton"]
