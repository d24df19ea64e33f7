"""QSA prefill over paged caches (plain torch) against the per-sequence references.

Prefill pools the groups a chunk completes from the raw keys of the open group (kept in a state
slot, never in pages) plus the chunk's own, then selects each query's tokens in row blocks with a
batched top-k. Pieces are compared with what they replace: pool_block_keys over the whole
sequence, and index_scores + select_tokens (per query; "lowest_index" for the batched top-k,
"torch" for the CPU path that reproduces transformers). The cache spec no longer pages raw keys.
"""
import pytest
import torch

from qsaserve.cache.kv_cache import KVCacheSpec, allocate_kv_cache
from qsaserve.models.presets import preset_config
from qsaserve.ops.qsa_indexer import index_scores, pool_block_keys, rope_inv_freq, select_tokens
from qsaserve.ops.qsa_indexer.paged import (pool_chunk_groups, pool_completed_groups, prefill_index_scores,
                                           prefill_rows_per_block, select_prefill_tokens)
from qsaserve.parallel.dcp import DcpGeometry

EPS = 1e-6


def _table(num_groups, gpp, gen, extra=2):
    """A shuffled block table for `num_groups` groups (block 0 = null) and a NaN-filled key cache."""
    blocks = -(-num_groups // gpp) + extra
    table = (torch.randperm(blocks, generator=gen) + 1).to(torch.int32)
    return table, blocks + 1


def _scatter_keys(keys, table, gpp, num_blocks):
    cache = torch.full((num_blocks, gpp, keys.shape[-1]), float("nan"))
    g = torch.arange(keys.shape[0])
    cache.view(-1, keys.shape[-1])[table.long()[g // gpp] * gpp + g % gpp] = keys
    return cache


@pytest.mark.parametrize("r,page,chunks", [(4, 16, [5, 3, 8, 1, 19]), (3, 6, [2, 1, 1, 13, 4]), (4, 8, [4, 12])])
def test_chunked_pooling_from_state_tail_equals_whole_sequence(r, page, chunks):
    gen = torch.Generator().manual_seed(r + page)
    di, n = 10, sum(chunks) + 3  # the last 3 tokens decode one at a time
    raw = torch.randn(n, di, generator=gen)
    weight = torch.empty(di).uniform_(-0.5, 0.5, generator=gen)
    inv_freq = rope_inv_freq(di, 0.5, 100.0)
    gpp = page // r
    table, num_blocks = _table(n // r, gpp, gen)
    block_keys = torch.full((num_blocks, gpp, di), float("nan"))
    tails = torch.full((2, r, di), float("nan"))  # slot 1 is the sequence's
    start = 0
    for c in chunks:
        pool_chunk_groups(tails[1], raw[start:start + c], start, block_keys, table, weight, inv_freq, r, EPS)
        start += c
        torch.testing.assert_close(tails[1, : start % r], raw[start - start % r: start])
    for p in range(start, n):  # decode continues from the state the chunks left
        pool_completed_groups(tails, torch.tensor([1]), raw[p:p + 1], block_keys, table[None], torch.tensor([p]),
                              torch.tensor([True]), weight, inv_freq, r, EPS)
    expected = pool_block_keys(raw, weight, inv_freq, r, EPS)
    g = torch.arange(n // r)
    got = block_keys.view(-1, di)[table.long()[g // gpp] * gpp + g % gpp]
    torch.testing.assert_close(got, expected)
    assert torch.isnan(tails[0]).all()  # another slot is never touched


def _case(seed, ties, hi=3, di=8, r=4, gpp=2):
    gen = torch.Generator().manual_seed(seed)
    num_groups = 40
    keys = torch.randn(num_groups, di, generator=gen)
    if ties:  # exact ties: repeated keys (equal scores) and zero keys (ReLU zeros)
        keys = keys[torch.randint(0, 4, (num_groups,), generator=gen)]
        keys[torch.rand(num_groups, generator=gen) < 0.3] = 0.0
    table, num_blocks = _table(num_groups, gpp, gen)
    return gen, keys, _scatter_keys(keys, table, gpp, num_blocks), table, r, hi, di


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("start,length,budget", [(0, 163, 24), (97, 60, 24), (150, 3, 24), (0, 2, 8), (20, 60, 400)])
def test_vectorized_selection_equals_per_query_reference(ties, start, length, budget):
    gen, keys, cache, table, r, hi, di = _case(start + length + budget, ties)
    end = start + length
    num_groups = end // r
    q = torch.randn(length, hi, di, generator=gen)
    positions = torch.arange(start, end)
    ref_scores = index_scores(q, keys[:max(num_groups, 1)])
    for rule in ("lowest_index", "torch"):
        ref, _ = select_tokens(ref_scores, positions, r, budget, rule)
        # max_bytes so small that every row block holds a handful of rows.
        got = select_prefill_tokens(q, cache, table, positions, r, budget, num_groups, rule, max_bytes=4096)
        assert got.shape == (length, budget + r - 1)
        assert torch.equal(got, ref), rule


def test_prefill_scores_mask_invisible_groups_and_bound_row_blocks():
    gen, keys, cache, table, r, hi, di = _case(1, False)
    positions = torch.arange(100, 140)
    q = torch.randn(40, hi, di, generator=gen)
    got = prefill_index_scores(q, cache, table, positions, r, 35)
    ref = index_scores(q, keys[:35])
    visible = torch.arange(35)[None, :] < ((positions + 1) // r)[:, None]
    torch.testing.assert_close(got[visible], ref[visible])
    assert torch.isneginf(got[~visible]).all()
    # qwen4exp-small at 128K: 32768 groups, 16 heads; the row blocks keep temporaries <= 512 MiB.
    for torch_scores, per in ((True, 40 + 64), (False, 40)):
        rows = prefill_rows_per_block(32768, 16, torch_scores)
        assert rows * 32768 * per <= 512 << 20 < (rows + 1) * 32768 * per


def test_selection_rejects_unknown_tie_rule():
    gen, keys, cache, table, r, hi, di = _case(2, False)
    with pytest.raises(ValueError, match="tie_break"):
        select_prefill_tokens(torch.randn(2, hi, di), cache, table, torch.arange(2), r, 8, 0, "random")


def test_cache_pages_hold_no_raw_index_keys():
    """qwen4exp-small's QSA layers with one KV head per rank: K/V + pooled block keys per token."""
    cfg = preset_config("qwen4exp-small")
    layers = sum((i + 1) % 4 == 0 for i in range(cfg["num_hidden_layers"]))
    di, ratio, d = cfg["indexer_head_dim"], cfg["indexer_compress_ratio"], cfg["head_dim"]
    spec = KVCacheSpec(layers, 1, d, torch.bfloat16, 16, index_head_dim=di, index_ratio=ratio)
    assert spec.bytes_per_token == layers * (1024 + 64)  # was 1024 + 256 (raw keys) + 64
    dcp2 = DcpGeometry(2, 0, 1, 16)
    assert dcp2.scale_spec(spec).bytes_per_token == layers * (512 + 64)  # was 512 + 256 + 64
    ours, dcp1 = dcp2.capacity(spec, 40 << 30, 131072)
    assert ours.tokens / dcp1.tokens == pytest.approx(1088 / 576, rel=1e-3)  # 1.89x (1.62x with raw pages)
    cache = allocate_kv_cache(dcp2.scale_spec(spec), 3, "cpu")[0]
    assert cache.block_keys.shape == (3, 32 // ratio, di) and not hasattr(cache, "index_keys")
