"""Block manager: allocation, prefix hits, ref counts, LRU eviction, cacheability."""
import pytest

from qsaserve.engine.block_manager import NULL_BLOCK, BlockManager
from qsaserve.engine.sequence import Sequence
from qsaserve.sampling_params import SamplingParams

BS = 4


def seq(i, tokens, **params):
    return Sequence(i, str(i), 0, tokens, SamplingParams(**params), None)


def compute(bm, s, n):
    """Allocate n tokens, 'compute' them and publish full blocks, like one engine step."""
    assert bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.cache_computed_blocks(s)


def test_null_block_is_never_allocated():
    bm = BlockManager(5, BS, True)
    s = seq(0, list(range(16)))
    compute(bm, s, 16)
    assert NULL_BLOCK not in s.block_table and len(s.block_table) == 4
    assert bm.num_free_blocks == 0
    assert not bm.allocate(seq(1, [1]), 1)


def test_allocate_failure_changes_nothing():
    bm = BlockManager(3, BS, True)
    s = seq(0, list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = BlockManager(16, BS, True)
    a = seq(0, list(range(10)))
    compute(bm, a, 10)
    b = seq(1, list(range(8)) + [99, 98, 97])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8
    assert [bm.blocks[x].ref_count for x in hits] == [2, 2]
    bm.free_seq(a)
    assert [bm.blocks[x].ref_count for x in hits] == [1, 1]


def test_hit_leaves_last_token_to_compute():
    bm = BlockManager(16, BS, True)
    a = seq(0, list(range(8)))
    compute(bm, a, 8)
    # An identical 8-token prompt may reuse only one block: the last token's logits are needed.
    assert len(bm.find_cached_prefix(seq(1, list(range(8))))) == 1


def test_freed_blocks_stay_cached_until_evicted_lru_tail_first():
    bm = BlockManager(5, BS, True)  # 4 usable
    a = seq(0, list(range(12)))
    compute(bm, a, 12)
    table = list(a.block_table)
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    again = seq(1, list(range(12)) + [5])
    assert bm.find_cached_prefix(again) == table
    # Taking 2 fresh blocks evicts the never-hashed spare block, then a's tail block.
    c = seq(2, [7] * 8)
    assert bm.allocate(c, 8)
    assert bm.find_cached_prefix(again) == table[:2]


def test_chain_hash_distinguishes_position():
    bm = BlockManager(16, BS, True)
    a = seq(0, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    compute(bm, a, 9)
    b = seq(1, [2, 2, 2, 2, 2, 2, 2, 2, 0])  # second block equal, first differs
    assert bm.find_cached_prefix(b) == []


def test_uncacheable_free_drops_hashes():
    bm = BlockManager(16, BS, True)
    a = seq(0, list(range(9)))
    compute(bm, a, 9)
    bm.free_seq(a, cacheable=False)
    assert bm.find_cached_prefix(seq(1, list(range(9)))) == []


def test_prefix_caching_off_and_prompt_logprobs_skip_lookup():
    bm = BlockManager(16, BS, False)
    a = seq(0, list(range(9)))
    compute(bm, a, 9)
    assert bm.find_cached_prefix(seq(1, list(range(9)))) == []
    bm2 = BlockManager(16, BS, True)
    compute(bm2, seq(2, list(range(9))), 9)
    assert bm2.find_cached_prefix(seq(3, list(range(9)), prompt_logprobs=1)) == []


def test_revived_cached_blocks_count_against_free_pool():
    bm = BlockManager(4, BS, True)  # 3 usable
    a = seq(0, list(range(8)))
    compute(bm, a, 8)
    bm.free_seq(a)
    b = seq(1, list(range(8)) + [1, 2, 3, 4, 5])
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    # 2 revived + 2 new > 3 free: must refuse without touching state.
    assert not bm.allocate(b, 5, hits)
    assert bm.num_free_blocks == 3 and b.block_table == []
