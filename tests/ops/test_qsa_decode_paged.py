"""Batched QSA decode helpers (plain torch, device-only) against the per-sequence references.

The decode path keeps each sequence's open group of raw index keys in its state slot and pools
block keys as tokens complete groups, scores one query per sequence over
its pages, selects with the deterministic lowest-index tie rule, and attends through the block
table. Each piece is compared with the reference it replaces: pool_block_keys, index_scores +
select_tokens(tie_break="lowest_index"), and sparse_attention_reference over a gathered context.
"""
import math

import pytest
import torch

from qsaserve.ops.qsa_attention import sparse_attention_paged_reference, sparse_attention_reference
from qsaserve.ops.qsa_indexer import index_scores, pool_block_keys, rope_inv_freq, select_tokens
from qsaserve.ops.qsa_indexer.paged import decode_index_scores, pool_completed_groups, select_decode_tokens
from qsaserve.ops.fp8 import FP8_E4M3, quantize_fp8

EPS = 1e-6


def _paged_layout(lengths, page, extra_cols=2, seed=0):
    """Block tables [B, cols] over shuffled blocks (block 0 = null) for sequences of `lengths`."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lengths]
    ids = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    cols = max(need) + extra_cols
    tables = torch.zeros(len(lengths), cols, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    return tables, 1 + sum(need)


def _slots(table, positions, page):
    return table[positions // page].long() * page + positions % page


@pytest.mark.parametrize("r,page", [(4, 8), (3, 6), (4, 16)])
def test_decode_pooling_scores_and_selection_match_references(r, page):
    gen = torch.Generator().manual_seed(r * 100 + page)
    di, hi, budget = 12, 3, 4 * r + 1
    lengths = [1, r - 1, r, 5 * r + 2, 9 * r]
    tables, num_blocks = _paged_layout(lengths, page)
    raws = [torch.randn(n, di, generator=gen) for n in lengths]
    block_keys = torch.full((num_blocks, page // r, di), float("nan"))
    block_keys[0] = 0.0
    weight = torch.empty(di).uniform_(-0.5, 0.5, generator=gen)
    inv_freq = rope_inv_freq(di, 0.5, 100.0)
    # Raw keys wait in state slots 1..B (slot 0: the scratch slot of padding rows) until pooled.
    tails = torch.full((len(lengths) + 1, r, di), float("nan"))
    # Decode every sequence token by token; all rows step together (shorter ones idle as padding).
    for p in range(max(lengths)):
        valid = torch.tensor([p < n for n in lengths])
        positions = torch.where(valid, torch.full((len(lengths),), p), torch.full((len(lengths),), -1))
        slots = torch.where(valid, torch.arange(1, len(lengths) + 1), 0)
        raw = torch.stack([raws[b][p] if p < n else torch.randn(di, generator=gen) for b, n in enumerate(lengths)])
        pool_completed_groups(tails, slots, raw, block_keys, tables, positions, valid, weight, inv_freq, r, EPS)
    for b, n in enumerate(lengths):  # the open group's raw keys are where the prefill path reads them
        torch.testing.assert_close(tails[b + 1, : n % r], raws[b][n - n % r:])
    for b, n in enumerate(lengths):
        expected = pool_block_keys(raws[b], weight, inv_freq, r, EPS)
        got = block_keys.view(-1, di)[[int(tables[b, g * r // page]) * (page // r) + (g * r % page) // r
                                        for g in range(n // r)]]
        torch.testing.assert_close(got, expected)
    positions = torch.tensor([n - 1 for n in lengths])
    q = torch.randn(len(lengths), hi, di, generator=gen)
    scores = decode_index_scores(q, block_keys, tables, positions, r)
    assert scores.shape == (len(lengths), tables.shape[1] * (page // r))
    got_idx = select_decode_tokens(scores, positions, r, budget)
    for b, n in enumerate(lengths):
        nb = n // r
        keys = pool_block_keys(raws[b], weight, inv_freq, r, EPS)
        ref_scores = index_scores(q[b: b + 1], keys)
        torch.testing.assert_close(scores[b, :nb], ref_scores[0])
        assert torch.isneginf(scores[b, nb:]).all()
        ref_idx, _ = select_tokens(ref_scores, positions[b: b + 1], r, budget, "lowest_index")
        assert got_idx[b].tolist() == ref_idx[0].tolist()


def test_selection_ties_take_lowest_group_and_padding_rows_select_nothing():
    r, budget = 4, 16
    # Many exact ties (ReLU zeros and repeated values): the reference's stable lowest-index rule.
    scores = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.5, 0.0, 1.0, -0.0, 0.0, 0.0],
                           [0.0] * 10,
                           [2.0, 2.0, 3.0] + [float("-inf")] * 7,
                           [float("-inf")] * 10])
    positions = torch.tensor([41, 39, 13, -1])
    got = select_decode_tokens(scores, positions, r, budget)
    assert got.shape == (4, budget + r - 1)
    for b in range(3):
        nb = (int(positions[b]) + 1) // r
        ref, _ = select_tokens(scores[b: b + 1, :nb].clone(), positions[b: b + 1], r, budget, "lowest_index")
        assert got[b].tolist() == ref[0].tolist()
    assert (got[3] == -1).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_sparse_attention_equals_gathered_reference(fp8):
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, page = 6, 2, 16, 8
    lengths = [5, 40, 17]
    tables, num_blocks = _paged_layout(lengths, page, seed=3)
    cache = torch.full((2, num_blocks, page, hkv, d), float("nan"))  # untouched slots are NaN
    k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.03)
    ctx = []
    for b, n in enumerate(lengths):
        k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
        slots = _slots(tables[b], torch.arange(n), page)
        cache[0].view(-1, hkv, d)[slots], cache[1].view(-1, hkv, d)[slots] = k, v
        ctx.append((k, v))
    if fp8:
        q8 = torch.empty(cache.shape, dtype=FP8_E4M3)
        q8[0], q8[1] = quantize_fp8(cache[0], k_scale), quantize_fp8(cache[1], v_scale)
        cache = q8
    # Multi-token rows: rows 0-1 of sequence 1, one of 0, one of 2 with an empty selection.
    seq_ids = torch.tensor([1, 1, 0, 2])
    sel = torch.full((4, 9), -1, dtype=torch.long)
    sel[0, :7] = torch.randperm(40, generator=gen)[:7]
    sel[1, :9] = torch.randperm(40, generator=gen)[:9]
    sel[2, :3] = torch.tensor([4, 0, 2])
    q = torch.randn(4, hq, d, generator=gen)
    out, lse = sparse_attention_paged_reference(q, cache, tables, sel, None, seq_ids,
                                                k_scale if fp8 else None, v_scale if fp8 else None)
    assert torch.isfinite(out).all() and (out[3] == 0).all() and torch.isneginf(lse[3]).all()
    for row in range(3):
        k, v = ctx[int(seq_ids[row])]
        if fp8:
            k = quantize_fp8(k, k_scale).float() * k_scale
            v = quantize_fp8(v, v_scale).float() * v_scale
        ref_out, ref_lse = sparse_attention_reference(q[row: row + 1], k, v, sel[row: row + 1], d ** -0.5)
        torch.testing.assert_close(out[row: row + 1], ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[row: row + 1], ref_lse, atol=1e-5, rtol=1e-5)
    assert math.isfinite(float(lse[:3].min()))
