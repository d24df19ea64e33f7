"""The hybrid prefix cache's state half: snapshot rows planned per step, published with their
blocks, found at the deepest boundary inside the KV chain, referenced while restored, evicted least
recently used first, dropped when their sequence stops first."""
from qsaserve.engine.block_manager import BlockManager, CachedPrefix
from qsaserve.engine.scheduler import ScheduledChunk
from qsaserve.engine.sequence import Sequence
from qsaserve.engine.state_cache import StateSnapshotCache
from qsaserve.sampling_params import SamplingParams

BS = 4


def seq(i, tokens):
    return Sequence(i, str(i), 0, tokens, SamplingParams(), None)


def manager(rows, interval=BS, blocks=64):
    return BlockManager(blocks, BS, True, 8, StateSnapshotCache(rows, interval, row_bytes=100))


def step(bm, s, n, cached=()):
    """One engine step of n tokens for s: allocate, plan, 'compute', publish."""
    assert bm.allocate(s, n, cached)
    plan = bm.plan_state_snapshots([ScheduledChunk(s, n)])
    bm.release_launched_restores()
    s.num_computed_tokens += n
    bm.cache_computed_blocks(s)
    return plan


def test_plan_puts_boundaries_inside_a_chunk_and_at_its_end():
    bm = manager(rows=8, interval=2 * BS)
    s = seq(0, list(range(30)))
    plan = step(bm, s, 17)  # boundaries 8 and 16 inside the chunk
    assert plan.interior_offsets == [[8, 16]] and len(plan.interior_rows) == 2 and not plan.save_rows
    plan = step(bm, s, 7)  # 17..24: ends on the boundary 24
    assert plan.interior_offsets == [[]] and plan.save_slots == [s.state_slot] and len(plan.save_rows) == 1
    assert bm.state_cache.num_cached == 3 and not s.pending_state_saves
    assert step(bm, s, 1) is None  # 24..25: nothing to copy


def test_hit_is_the_deepest_snapshot_inside_the_kv_chain_and_is_restored_once():
    bm = manager(rows=8, interval=2 * BS)
    a = seq(0, list(range(20)))
    step(bm, a, 20)  # blocks 0..4 cached, snapshots at 8 and 16
    bm.free_seq(a)
    b = seq(1, list(range(18)) + [99, 98, 97])
    hit = bm.find_cached_prefix(b)
    assert isinstance(hit, CachedPrefix) and len(hit) == 4 and hit.state_row is not None  # 16 tokens, not 18
    plan = step(bm, b, b.num_tokens - 16, hit)
    assert plan.restore_rows == [hit.state_row] and plan.restore_slots == [b.state_slot]
    assert bm.state_cache.stats.hits == 1 and not bm.state_cache.refs
    # A chain with KV but no snapshot at any of its boundaries is no hit at all.
    bm.state_cache.reset()
    c = seq(2, list(range(20)))
    assert bm.find_cached_prefix(c) == [] and bm.find_cached_prefix(c).state_row is None


def test_rows_are_referenced_while_restored_and_evicted_lru():
    cache = StateSnapshotCache(2, BS, 10)
    r0, r1 = cache.reserve(), cache.reserve()
    cache.publish(r0, 100)
    cache.publish(r1, 101)
    cache.acquire(r0)  # a restore of r0 is being launched
    assert cache.reserve() == r1 and cache.find(101) is None  # r0 is not evictable, r1 is
    assert cache.reserve() is None  # every row referenced or reserved
    cache.release(r0)
    assert cache.reserve() == r0 and cache.stats.evicted == 2


def test_duplicates_and_stopped_sequences_give_their_rows_back():
    cache = StateSnapshotCache(3, BS, 10)
    r0, r1 = cache.reserve(), cache.reserve()
    cache.publish(r0, 7)
    cache.publish(r1, 7)  # the same prefix saved twice: the older row stays
    assert cache.find(7) == r0 and len(cache.free) == 2
    bm = BlockManager(64, BS, True, 8, StateSnapshotCache(4, BS, 10))
    s = seq(0, list(range(12)))
    assert bm.allocate(s, 12)
    bm.plan_state_snapshots([ScheduledChunk(s, 12)])  # launched, then the sequence is preempted
    assert len(s.pending_state_saves) == 3
    bm.free_seq(s)
    assert not s.pending_state_saves and len(bm.state_cache.free) == 4 and not bm.state_cache.refs
