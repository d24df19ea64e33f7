"""QSA Triton kernels (indexer scoring for decode and prefill, sparse paged attention) against their torch references.

The same checks run twice: on CPU under the Triton interpreter (a subprocess with
TRITON_INTERPRET=1, which must be set before triton is imported; small shapes) and on a CUDA GPU
(marked gpu; bf16 plus the real qwen4exp-small head shapes). Tolerances: fp32 operands use IEEE
dots (1e-4); bf16 operands with fp32 accumulation compare by relative Frobenius error < 1.5e-2.
"""
from __future__ import annotations


import pytest
import torch

from qsaserve.ops.dcp_merge.reference import pack_partials as reference_pack_partials
from qsaserve.ops.qsa_attention import merge_attention_partials, sparse_attention_paged_reference
from qsaserve.ops.qsa_indexer.paged import decode_index_scores, select_decode_tokens
from qsaserve.ops.fp8 import FP8_E4M3, quantize_fp8
from triton_interpreter import run_under_interpreter


def _layout(lengths, page, gen, extra_cols=2):
    need = [-(-n // page) for n in lengths]
    ids = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    tables = torch.zeros(len(lengths), max(need) + extra_cols, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    return tables, 1 + sum(need)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def check_scores(device, dtype, hi=3, di=12, r=4, page=16, lengths=(1, 3, 4, 37, 150), block_g=16):
    from qsaserve.ops.qsa_indexer.triton_score import decode_index_scores_triton

    gen = torch.Generator().manual_seed(hi * di + r)
    tables, num_blocks = _layout(list(lengths), page, gen)
    keys = torch.randn(num_blocks, page // r, di, generator=gen)
    keys[0] = float("nan")  # null block: never read
    q = torch.randn(len(lengths), hi, di, generator=gen)
    positions = torch.tensor([n - 1 for n in lengths] + [-1])  # a padding row sees nothing
    tables = torch.cat([tables, torch.zeros(1, tables.shape[1], dtype=torch.int32)])
    q = torch.cat([q, torch.randn(1, hi, di, generator=gen)])
    keys, q = keys.to(dtype), q.to(dtype)
    ref = decode_index_scores(q, keys, tables, positions, r)
    got = decode_index_scores_triton(q.to(device), keys.to(device), tables.to(device), positions.to(device), r,
                                     block_g=block_g).cpu()
    assert got.shape == ref.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    if dtype == torch.float32:
        torch.testing.assert_close(got[fin], ref[fin], atol=1e-4, rtol=1e-4)
    else:
        assert _rel(got[fin], ref[fin]) < 1.5e-2
    # Selection on the kernel's scores keeps the reference's order and tail layout.
    sel = select_decode_tokens(got.to(device), positions.to(device), r, 8).cpu()
    assert sel.shape == (len(positions), 8 + r - 1) and (sel[-1] == -1).all()


def check_prefill_scores(device, dtype, hi=3, di=12, r=4, page=16, start=50, length=37, block_g=16, splits=None):
    """One sequence's chunk of queries (positions start..start+length-1) against its groups."""
    from qsaserve.ops.qsa_indexer import select_tokens
    from qsaserve.ops.qsa_indexer.paged import prefill_index_scores, select_prefill_tokens
    from qsaserve.ops.qsa_indexer.triton_score import prefill_index_scores_triton

    gen = torch.Generator().manual_seed(hi * di + start + length)
    end = start + length
    tables, num_blocks = _layout([end], page, gen)
    keys = torch.randn(num_blocks, page // r, di, generator=gen)
    keys[0] = float("nan")  # null block: never read
    q = torch.randn(length, hi, di, generator=gen)
    keys, q, table, positions = keys.to(dtype), q.to(dtype), tables[0], torch.arange(start, end)
    n = end // r
    ref = prefill_index_scores(q, keys, table, positions, r, n)
    dev = [x.to(device) for x in (q, keys, table, positions)]
    got = prefill_index_scores_triton(*dev, r, n, block_g=block_g, splits=splits).cpu()
    assert got.shape == ref.shape == (length, n)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    if dtype == torch.float32:
        torch.testing.assert_close(got[fin], ref[fin], atol=1e-4, rtol=1e-4)
    else:
        assert _rel(got[fin], ref[fin]) < 1.5e-2
    # Device top-k on the kernel's scores (one row block) equals the per-query reference on them.
    sel = select_prefill_tokens(*dev, r, 8, n, "lowest_index", score_fn=lambda *a, **k: got.to(device)).cpu()
    assert torch.equal(sel, select_tokens(got, positions, r, 8, "lowest_index")[0])


def _sparse_case(gen, lengths, hq, hkv, d, page, m, fp8, rows_per_seq=1):
    tables, num_blocks = _layout(lengths, page, gen)
    cache = torch.full((2, num_blocks, page, hkv, d), float("nan"))
    for b, n in enumerate(lengths):
        p = torch.arange(n)
        slots = tables[b][p // page].long() * page + p % page
        cache[0].view(-1, hkv, d)[slots] = torch.randn(n, hkv, d, generator=gen)
        cache[1].view(-1, hkv, d)[slots] = torch.randn(n, hkv, d, generator=gen)
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.015)
        q8 = torch.empty(cache.shape, dtype=FP8_E4M3)
        q8[0], q8[1] = quantize_fp8(cache[0], k_scale), quantize_fp8(cache[1], v_scale)
        q8.view(torch.uint8)[:, 0] = 0x7F  # E4M3 NaN bytes in the null block
        cache = q8
    seq_ids = torch.arange(len(lengths)).repeat_interleave(rows_per_seq)
    sel = torch.full((len(seq_ids), m), -1, dtype=torch.long)
    for t, s in enumerate(seq_ids.tolist()):
        n = lengths[s]
        k = int(torch.randint(0, min(n, m) + 1, (1,), generator=gen)) if t % 3 else min(n, m)
        sel[t, torch.randperm(m, generator=gen)[:k]] = torch.randperm(n, generator=gen)[:k]  # holes anywhere
    sel[-1] = -1  # one row with nothing selected
    q = torch.randn(len(seq_ids), hq, d, generator=gen)
    return q, cache, tables, sel, seq_ids, k_scale, v_scale


def check_sparse(device, dtype, fp8=False, hq=4, hkv=2, d=16, page=8, m=45, lengths=(9, 70, 33), rows_per_seq=2,
                 splits=None, block_n=None):
    from qsaserve.ops.qsa_attention.triton_sparse import SparseConfig, sparse_attention_paged_triton

    gen = torch.Generator().manual_seed(d + m + int(fp8))
    q, cache, tables, sel, seq_ids, ks, vs = _sparse_case(gen, list(lengths), hq, hkv, d, page, m, fp8, rows_per_seq)
    q = q.to(dtype)
    if not fp8:
        cache = cache.to(dtype)
    ref_out, ref_lse = sparse_attention_paged_reference(q, cache, tables, sel, None, seq_ids, ks, vs)
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    cfg = SparseConfig(block_n=block_n, num_warps=4) if block_n else None
    out, lse = sparse_attention_paged_triton(dev(q), dev(cache), dev(tables), dev(sel), None, dev(seq_ids), dev(ks),
                                             dev(vs), splits=splits, config=cfg)
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[-1] == 0).all() and torch.isneginf(lse[-1]).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)
    else:
        assert _rel(out, ref_out) < 1.5e-2
        assert (lse[fin] - ref_lse[fin]).abs().max() < 0.05
    # pack=D (DCP's all-to-all merge): the same result, laid out as dcp_merge.pack_partials does,
    # written by the split merge (or packed after the one-split kernel).
    for dcp in (2, hq):
        packed, none = sparse_attention_paged_triton(dev(q), dev(cache), dev(tables), dev(sel), None, dev(seq_ids),
                                                     dev(ks), dev(vs), splits=splits, config=cfg, pack=dcp)
        assert none is None and packed.shape == (dcp, q.shape[0], hq // dcp, d + 1)
        assert torch.equal(packed.cpu(), reference_pack_partials(out, lse, dcp))
    # Partials over two halves of the selection merge to the whole (mergeable LSE).
    half = m // 2
    a = torch.where(torch.arange(m) < half, sel, -1)
    b = torch.where(torch.arange(m) >= half, sel, -1)
    parts = [sparse_attention_paged_triton(dev(q), dev(cache), dev(tables), dev(x), None, dev(seq_ids), dev(ks), dev(vs))
             for x in (a, b)]
    merged, merged_lse = merge_attention_partials([p[0].cpu() for p in parts], [p[1].cpu() for p in parts])
    torch.testing.assert_close(merged, out, atol=2e-3 if dtype != torch.float32 else 1e-4, rtol=1e-3)
    torch.testing.assert_close(merged_lse[fin], lse[fin], atol=2e-3, rtol=1e-4)


def _qsa_layout_selection(gen, lengths, rows_per_seq, r, budget):
    """Selections laid out as the QSA indexer makes them: whole groups of r positions at aligned
    columns (random groups, random order), then the open tail's prefix; some rows see fewer groups
    than the budget (whole -1 runs)."""
    width = budget + r - 1
    rows = []
    for n in lengths:
        for j in range(rows_per_seq):
            p = int(torch.randint(0, n, (1,), generator=gen)) if j else n - 1
            nv = (p + 1) // r
            k = min(budget // r, nv)
            groups = torch.randperm(nv, generator=gen)[:k]
            sel = torch.cat([(groups[:, None] * r + torch.arange(r)).flatten(), torch.arange(nv * r, p + 1)])
            rows.append(torch.cat([sel, torch.full((width - sel.numel(),), -1)]))
    return torch.stack(rows)


def check_sparse_runs(device, dtype, hq=4, hkv=2, d=16, page=8, r=4, budget=24, lengths=(9, 70, 33, 3), rows_per_seq=2,
                      block_n=16, splits=None, prefetch=False):
    """run=r (one block-table read per group) on QSA-layout selections equals the reference and run=1
    (with prefetch, both runs look up the next tile's slots ahead)."""
    from qsaserve.ops.qsa_attention.triton_sparse import SparseConfig, sparse_attention_paged_triton

    gen = torch.Generator().manual_seed(d + budget)
    q, cache, tables, _, seq_ids, _, _ = _sparse_case(gen, list(lengths), hq, hkv, d, page, 4, False, rows_per_seq)
    sel = _qsa_layout_selection(gen, list(lengths), rows_per_seq, r, budget)
    q, cache = q.to(dtype), cache.to(dtype)
    ref_out, ref_lse = sparse_attention_paged_reference(q, cache, tables, sel, None, seq_ids)
    dev = lambda x: x.to(device)  # noqa: E731
    cfg = SparseConfig(block_n=block_n, num_warps=4, prefetch=prefetch)
    got = [sparse_attention_paged_triton(dev(q), dev(cache), dev(tables), dev(sel), None, dev(seq_ids), splits=splits,
                                         run=run, config=cfg) for run in (r, 1)]
    (out, lse), (out1, lse1) = [(o.cpu(), x.cpu()) for o, x in got]
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(out, out1, atol=0, rtol=0)  # same tokens, same order: bit-identical
    torch.testing.assert_close(lse, lse1, atol=0, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)
    else:
        assert _rel(out, ref_out) < 1.5e-2


def check_fused_selection(device, dtype, hi=3, di=12, r=4, page=16, budget=12, lengths=(1, 3, 4, 37, 150), block_g=16):
    """Packed keys = selection_keys(scores); keys -> topk -> build kernel = select_decode_tokens
    (decode, padding row included) and the prefill row-block select = select_prefill_tokens'."""
    from qsaserve.ops.qsa_indexer.paged import (build_selection, prefill_index_scores, select_prefill_tokens,
                                                selection_keys)
    from qsaserve.ops.qsa_indexer.triton_score import (build_selection_triton, decode_index_scores_triton,
                                                       prefill_index_scores_triton, select_decode_tokens_triton,
                                                       select_prefill_rows_triton)

    gen = torch.Generator().manual_seed(7 + budget)
    tables, num_blocks = _layout(list(lengths), page, gen)
    keys = torch.randn(num_blocks, page // r, di, generator=gen)
    n = keys[1:, 1::3].shape[1]
    keys[1:, 0:3 * n:3] = keys[1:, 1::3]  # repeated keys: exact score ties
    keys[0] = float("nan")
    q = torch.randn(len(lengths) + 1, hi, di, generator=gen)
    positions = torch.tensor([n - 1 for n in lengths] + [-1])
    tables = torch.cat([tables, torch.zeros(1, tables.shape[1], dtype=torch.int32)])
    keys, q = keys.to(dtype), q.to(dtype)
    dev = [x.to(device) for x in (q, keys, tables, positions)]
    scores = decode_index_scores_triton(*dev, r, block_g=block_g)
    packed = decode_index_scores_triton(*dev, r, block_g=block_g, pack=True).cpu()
    assert torch.equal(packed, selection_keys(scores.cpu(), positions, r))
    want = select_decode_tokens(scores, dev[3], r, budget).cpu()
    assert torch.equal(select_decode_tokens_triton(*dev, r, budget, block_g=block_g).cpu(), want)
    k = min(budget // r, packed.shape[1])
    chosen = torch.topk(packed, k, dim=1).indices
    assert torch.equal(build_selection_triton(chosen.to(device), dev[3], r, budget).cpu(),
                       build_selection(chosen, positions, r, budget))
    # Under DCP the build writes this rank's local rows: DcpGeometry.localize of the selection.
    from qsaserve.parallel.dcp import DcpGeometry

    for size, rank, interleave in ((2, 0, 1), (2, 1, 1), (4, 3, 2), (3, 1, 4)):
        geo = DcpGeometry(size=size, rank=rank, interleave=interleave, block_size=page)
        got = select_decode_tokens_triton(*dev, r, budget, block_g=block_g, dcp=geo).cpu()
        assert torch.equal(got, geo.localize(want)), (size, rank, interleave)
    # Prefill: one sequence's chunk (positions 40..149), small row blocks.
    seq = len(lengths) - 1
    qp = torch.randn(110, hi, di, generator=gen).to(dtype)
    pos = torch.arange(40, 150)
    args = [x.to(device) for x in (qp, keys, tables[seq], pos)]
    want = select_prefill_tokens(*args, r, budget, 150 // r, score_fn=prefill_index_scores_triton, max_bytes=37 * 40 * 37)
    got = select_prefill_tokens(*args, r, budget, 150 // r, select_fn=select_prefill_rows_triton, max_bytes=37 * 40 * 37)
    assert torch.equal(got.cpu(), want.cpu())
    ref = select_prefill_tokens(qp, keys, tables[seq], pos, r, budget, 150 // r, score_fn=prefill_index_scores)
    if dtype == torch.float32:  # the same scores up to summation order: the same choice barring near-ties
        assert (got.cpu().sort(1).values != ref.sort(1).values).any(1).float().mean() <= 0.02


def check_topk(device, n=300, k=24, rows=5, tile=64, seed=3, split=False, rank=False):
    """Radix top-k of packed selection keys = torch.topk's indices for every visible group: score
    ties (lower group first, also across the slices of a split row), hidden groups (-1), rows with
    fewer visible groups than k, a row with none, N not a multiple of the tile, and k = N; given
    the rows' positions (the scan bounded by their visible groups) exactly the same output. split:
    the version that spreads each row over N / tile programs; rank: the rank form (no tile)."""
    from qsaserve.ops.qsa_indexer.paged import selection_keys
    from qsaserve.ops.qsa_indexer.triton_topk import topk_indices_rank, topk_indices_split
    from qsaserve.ops.qsa_indexer.triton_topk import topk_indices_triton as single

    topk_indices_triton = topk_indices_split if split else single
    if rank:
        def topk_indices_triton(keys, k, tile=None, **kw):
            return topk_indices_rank(keys, k, **kw)

    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, n, generator=gen) * 4
    scores[:, ::5] = scores[:, 1::5][:, : scores[:, ::5].shape[1]]  # exact ties across groups
    scores[1, : n // 2] = 2.0  # a long run of equal scores straddling the threshold
    scores[2] = 0.0  # every visible score equal (and +0.0)
    r = 4
    positions = torch.tensor([n * r - 1, n * r - 1, n * r - 1, 7 * r + 2, -1][:rows])  # row 3: 7 visible; row 4: none
    keys = selection_keys(scores, positions, r)
    assert topk_indices_triton(keys.to(device), 0).shape == (rows, 0)  # as torch.topk(keys, 0)
    for kk in (k, 1, min(n, 33), n):
        got = topk_indices_triton(keys.to(device), kk, tile=tile).cpu()
        # with the rows' positions the scan stops at their visible groups: the same output, hidden slots included
        bounded = topk_indices_triton(keys.to(device), kk, tile=tile, positions=positions.to(device), ratio=r).cpu()
        assert torch.equal(bounded, got), (kk, bounded, got)
        want = torch.topk(keys, kk, dim=1).indices
        visible = ((positions + 1) // r).clamp(max=n).clamp(min=0)
        for i in range(rows):
            real = min(int(visible[i]), kk)
            assert torch.equal(got[i, :real], want[i, :real]), (kk, i, got[i, :real], want[i, :real])
            assert ((got[i] >= 0) & (got[i] < n)).all()


def test_topk_dispatch_by_row_width(monkeypatch):
    """topk_indices: ranks while rows x N^2 <= RANK_MAX_COMPARES (N <= RANK_MAX_GROUPS), else one program per row up to
    RADIX_MAX_GROUPS groups or from RADIX_MIN_ROWS rows, the split kernel for few wider rows (see
    triton_topk.py); all give torch.topk's indices."""
    from qsaserve.ops.qsa_indexer import triton_topk as tt

    calls = []
    monkeypatch.setattr(tt, "topk_indices_rank", lambda keys, k, **kw: calls.append(("rank", keys.shape)) or torch.topk(keys, k).indices)
    few = torch.arange(2 * 2048).view(2, 2048)
    assert torch.equal(tt.topk_indices(few, 5), torch.topk(few, 5).indices)
    assert calls == [("rank", few.shape)] and tt.rank_takes(8, 2250) and not tt.rank_takes(16, 2250)
    assert tt.rank_takes(2, 4096) and not tt.rank_takes(1, 4097)
    calls.clear()
    monkeypatch.setattr(tt, "RANK_MAX_COMPARES", 0)
    monkeypatch.setattr(tt, "topk_indices_triton", lambda keys, k, **kw: calls.append(("one", keys.shape)) or torch.topk(keys, k).indices)
    monkeypatch.setattr(tt, "topk_indices_split", lambda keys, k, **kw: calls.append(("split", keys.shape)) or torch.topk(keys, k).indices)
    narrow, wide = torch.arange(2 * 64).view(2, 64), torch.arange(2 * (tt.RADIX_MAX_GROUPS + 1)).view(2, -1)
    many = torch.arange(tt.RADIX_MIN_ROWS * (tt.RADIX_MAX_GROUPS + 1)).view(tt.RADIX_MIN_ROWS, -1)
    assert torch.equal(tt.topk_indices(narrow, 5), torch.topk(narrow, 5).indices)
    assert torch.equal(tt.topk_indices(wide, 5), torch.topk(wide, 5).indices)
    tt.topk_indices(many, 5)  # many wide rows (a prefill chunk): one program per row
    assert calls == [("one", narrow.shape), ("split", wide.shape), ("one", many.shape)]


INTERPRETER_CHECKS = [
    ("topk", lambda: check_topk("cpu")),
    ("topk_one_tile_pow2_k", lambda: check_topk("cpu", n=64, k=16, tile=2048)),
    ("topk_split", lambda: check_topk("cpu", split=True)),
    ("topk_split_one_slice", lambda: check_topk("cpu", n=64, k=16, tile=2048, split=True)),
    ("topk_rank", lambda: check_topk("cpu", rank=True)),
    ("topk_rank_one_tile", lambda: check_topk("cpu", n=40, k=16, rank=True)),
    ("scores_fp32", lambda: check_scores("cpu", torch.float32)),
    ("scores_pow2_many_tiles", lambda: check_scores("cpu", torch.float32, hi=16, di=32, page=8, block_g=8)),
    ("prefill_scores_fp32", lambda: check_prefill_scores("cpu", torch.float32)),
    ("prefill_scores_splits_16_heads", lambda: check_prefill_scores("cpu", torch.float32, hi=16, di=32, page=8,
                                                                    start=0, length=21, block_g=8, splits=3)),
    ("prefill_scores_no_groups_yet", lambda: check_prefill_scores("cpu", torch.float32, start=0, length=9, block_g=16)),
    ("sparse_fp32", lambda: check_sparse("cpu", torch.float32)),
    ("sparse_fp32_one_split", lambda: check_sparse("cpu", torch.float32, splits=1)),
    ("sparse_fp32_three_splits", lambda: check_sparse("cpu", torch.float32, splits=3, block_n=16)),
    ("sparse_fp8", lambda: check_sparse("cpu", torch.float32, fp8=True, hq=6, hkv=3)),
    ("sparse_head_dim_256", lambda: check_sparse("cpu", torch.float32, hq=4, hkv=1, d=256, m=20, lengths=(30, 12),
                                                 rows_per_seq=1)),
    # the merge over head-dim blocks (256 = 4 x 64) of 3 splits
    ("sparse_head_dim_256_splits", lambda: check_sparse("cpu", torch.float32, hq=4, hkv=1, d=256, m=40,
                                                        lengths=(50, 12), rows_per_seq=1, splits=3, block_n=16)),
    ("sparse_runs_fp32", lambda: check_sparse_runs("cpu", torch.float32)),
    ("sparse_runs_fp16_splits", lambda: check_sparse_runs("cpu", torch.float16, r=2, budget=16, splits=2)),
    ("sparse_runs_prefetch", lambda: check_sparse_runs("cpu", torch.float32, splits=2, prefetch=True)),
    ("fused_selection_fp32", lambda: check_fused_selection("cpu", torch.float32)),
    # A compress ratio that is not a power of two, on the page the engine picks for it (48 tokens):
    # scoring, prefill scoring and the fused selection take any ratio, the sparse kernel any page.
    ("scores_ratio3_page48", lambda: check_scores("cpu", torch.float32, r=3, page=48)),
    ("prefill_scores_ratio3_page48", lambda: check_prefill_scores("cpu", torch.float32, r=3, page=48)),
    ("fused_selection_ratio3_page48", lambda: check_fused_selection("cpu", torch.float32, r=3, page=48, budget=12)),
    ("sparse_fp32_page48", lambda: check_sparse("cpu", torch.float32, page=48)),
]


def run_interpreter_checks() -> None:
    from triton_interpreter import interpreter_numpy_shim

    interpreter_numpy_shim()
    for name, fn in INTERPRETER_CHECKS:
        fn()
        print("ok", name, flush=True)


def test_kernels_match_references_under_triton_interpreter():
    out = run_under_interpreter(__file__, "t.run_interpreter_checks()")
    assert out.count("ok ") == len(INTERPRETER_CHECKS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scores_on_gpu(dtype):
    check_scores("cuda", dtype)
    # qwen4exp-small indexer: 16 heads x 128, r 4, 4K context over 64-token pages.
    check_scores("cuda", dtype, hi=16, di=128, r=4, page=64, lengths=(4096, 1000, 3, 4), block_g=64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_scores_on_gpu(dtype):
    check_prefill_scores("cuda", dtype)
    # qwen4exp-small indexer (16 heads x 128, r 4): a 1024-row chunk at 8K context, 64-token pages.
    check_prefill_scores("cuda", dtype, hi=16, di=128, r=4, page=64, start=7168, length=1024, block_g=64)
    check_prefill_scores("cuda", dtype, hi=16, di=128, r=4, page=16, start=0, length=600, block_g=64)


@pytest.mark.gpu
def test_topk_on_gpu():
    check_topk("cuda")
    check_topk("cuda", n=32768, k=512, rows=5, tile=2048)  # qwen4exp-small at 128K context
    check_topk("cuda", n=65536 + 37, k=500, rows=5, tile=1024)
    check_topk("cuda", n=8192, k=4096, rows=3, tile=2048)  # the largest k sorted on chip (MAX_K)
    # The row-split version: one, several and 33 slices per row.
    check_topk("cuda", split=True)
    check_topk("cuda", n=32768, k=512, rows=5, tile=2048, split=True)
    check_topk("cuda", n=65536 + 37, k=500, rows=5, tile=2048, split=True)
    check_topk("cuda", n=8192, k=4096, rows=3, tile=1024, split=True)
    # The rank form: qwen4exp-small's decode selection at 8K (a 9,000-token graph: 2,250 groups).
    check_topk("cuda", rank=True)
    check_topk("cuda", n=2250, k=512, rows=5, rank=True)
    check_topk("cuda", n=4097, k=4096, rows=2, rank=True)  # the largest k (MAX_K)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_selection_on_gpu(dtype):
    check_fused_selection("cuda", dtype)
    check_fused_selection("cuda", dtype, hi=16, di=128, page=64, budget=2048, lengths=(9000, 4096, 3), block_g=64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_runs_on_gpu(dtype):
    check_sparse_runs("cuda", dtype)
    check_sparse_runs("cuda", dtype, hq=16, hkv=2, d=256, page=16, budget=2048, lengths=(9000, 3000, 5), block_n=32)
    check_sparse_runs("cuda", dtype, hq=16, hkv=2, d=256, page=16, budget=2048, lengths=(9000, 3000, 5), block_n=32,
                      prefetch=True)


def test_sparse_kernel_sm90_code():
    """The sm_90 code of the bf16 head_dim-256 run-gather kernel reads K/V with 16-byte vector
    accesses (async copies when pipelined, else v4 loads), not element by element."""
    triton = pytest.importorskip("triton")
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qsaserve.ops.qsa_attention import triton_sparse as ts

    if "nvidia" not in backends:
        pytest.skip("Triton has no NVIDIA backend here")
    fn, cfg = ts._sparse_kernel, ts.default_config(256)
    types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "idx_ptr": "*i64", "seq_ids_ptr": "*i64",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
             "qk_scale": "fp32"}
    for run, prefetch in ((4, False), (1, False), (4, True)):
        consts = dict(G=8, BLOCK_M=16, BLOCK_N=cfg.block_n, TILES=4, RUN=run, ALIGN=16, D=256, D_POW2=256, PAGE=16,
                      HAS_SEQ_IDS=False, FP8=False, IEEE=False, PREFETCH=prefetch)
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                   if n.startswith("stride_") or n.endswith("_ptr")}
        ptx = triton.compile(ASTSource(fn, sig, consts, attrs=aligned), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}).asm["ptx"]
        wide = ptx.count("cp.async.cg.shared.global") + ptx.count("ld.global.v4")
        narrow = ptx.count("ld.global.b16") + ptx.count("ld.global.u16")
        assert wide > 0 and narrow == 0, (run, prefetch, wide, narrow)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sparse_attention_on_gpu(dtype, fp8):
    check_sparse("cuda", dtype, fp8=fp8)
    # qwen4exp-small attention: 16 q heads, 2 KV heads, head_dim 256, budget 2048 + r - 1 over 64-token pages.
    check_sparse("cuda", dtype, fp8=fp8, hq=16, hkv=2, d=256, page=64, m=2051, lengths=(5000, 2100, 300), rows_per_seq=3)
