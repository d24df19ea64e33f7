"""The host KV tier's parts: the host rows round-trip any dtype bit for bit (FP8 pages, index pages,
state pools; on CUDA through the side stream, ordered against the compute stream), the host
store's LRU and references, and the block manager's plans: an evicted cached block is copied out
before its slot is reused, a prefix found on the host is copied back into fresh blocks, and held
host entries survive the offloads of the same step. The end-to-end checks against caching off are
tests/models/test_llama_host_tier.py and tests/models/qwen4exp/test_qwen4exp_host_tier.py."""
import pytest
import torch

from qsaserve.cache.host_pool import HostPool, TransferStream, row_bytes, slab_rows
from qsaserve.engine.block_manager import ON_HOST, BlockManager
from qsaserve.engine.host_kv_tier import HostKVTier, HostStore
from qsaserve.engine.sequence import Sequence
from qsaserve.sampling_params import SamplingParams


def pages(device, blocks=7):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, blocks, 4, 2, 8, generator=g).to(torch.float8_e4m3fn).to(device)
    keys = torch.randn(blocks, 2, 6, generator=g).to(device)
    return [(kv, 1), (keys, 0)]


def round_trip(device):
    src, dst = pages(device), [(torch.zeros_like(t), d) for t, d in pages(device)]
    pool = HostPool(5, row_bytes(src), device)
    stream = TransferStream(device)
    with stream.ordered():
        pool.offload(src, [3, 4, 1], [0, 1, 4])  # a run (3, 4 -> 0, 1) and a single row
    with stream.ordered():
        pool.load(dst, [4, 0, 1], [6, 2, 3])
    for (a, d), (b, _) in zip(src, dst):
        for s, t in ((1, 6), (3, 2), (4, 3)):
            assert torch.equal(a.select(d, s).view(torch.uint8).cpu(), b.select(d, t).view(torch.uint8).cpu())
        assert not b.select(d, 0).float().abs().sum()  # untouched rows stay as they were


def test_host_rows_round_trip_fp8_pages_and_index_pages_bit_for_bit():
    round_trip(torch.device("cpu"))


def test_host_rows_round_trip_through_a_staging_buffer_of_one_row_and_small_slabs(monkeypatch):
    import qsaserve.cache.host_pool as host_pool

    monkeypatch.setattr(host_pool, "STAGING_BYTES", 1)
    round_trip(torch.device("cpu"))
    row = row_bytes(pages(torch.device("cpu")))  # 176 bytes
    monkeypatch.setattr(host_pool, "SLAB_BYTES", row)  # one row per slab: the run (3, 4 -> 0, 1) spans two
    monkeypatch.setattr(host_pool, "STAGING_BYTES", 64 << 20)
    round_trip(torch.device("cpu"))


def test_slabs_stay_just_under_powers_of_two():
    """torch's pinned allocator rounds each allocation up to a power of two: every slab but a
    one-row slab wastes less than one row."""
    for rows, nbytes in ((10_000, 135_168), (3, 25_899_008), (1, 5 << 30), (70_000, 16_896)):
        sizes = slab_rows(rows, nbytes)
        assert sum(sizes) == rows
        for n in sizes:
            size = n * nbytes
            pow2 = 1 << (size - 1).bit_length()
            assert n == 1 or pow2 - size < nbytes, (rows, nbytes, n)
            assert size <= 1 << 30 or n == 1


@pytest.mark.gpu
def test_host_rows_round_trip_on_cuda_through_the_side_stream():
    round_trip(torch.device("cuda"))


@pytest.mark.gpu
def test_a_copy_out_is_ordered_after_the_write_before_it_and_before_the_write_after_it():
    """Queue a long kernel on the compute stream that writes a block, then copy the block out and
    overwrite it: the host gets the first write's values, not the old or the new ones."""
    dev = torch.device("cuda")
    kv = torch.zeros(2, 4, 1024, 8, 64, device=dev)
    pool, stream = HostPool(2, row_bytes([(kv, 1)]), dev), TransferStream(dev)
    big = torch.randn(4096, 4096, device=dev)
    for _ in range(20):  # keeps the compute stream busy
        big = big @ big / 64
    kv[:, 1].fill_(1.0)
    with stream.ordered():
        pool.offload([(kv, 1)], [1], [0])
    kv[:, 1].fill_(2.0)
    out = torch.zeros_like(kv)
    with stream.ordered():
        pool.load([(out, 1)], [0], [3])
    torch.cuda.synchronize()
    assert torch.all(out[:, 3] == 1.0)


def test_host_store_evicts_least_recently_used_and_never_a_held_entry():
    store = HostStore(2, 100)
    a, b = store.insert(10), store.insert(11)
    store.acquire(a)  # held: a restore from it is planned
    c = store.insert(12)  # evicts b, the only unreferenced entry
    assert c == b and store.find(11) is None and store.find(10) == a
    store.acquire(c)
    assert store.insert(13) is None  # every slot held: no room, nothing evicted
    store.release(a)
    store.release(c)
    assert store.insert(13) == a and store.find(10) is None  # a was used longer ago than c
    assert store.bytes_used == 200 and not store.refs


def seq(seq_id, tokens):
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(max_tokens=4), None)


def finish(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    bm.free_seq(s)


def test_eviction_copies_out_and_a_host_hit_copies_back():
    tier = HostKVTier(num_blocks=8, block_bytes=64)
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=True, host_tier=tier)  # 4 usable
    first = seq(0, range(100, 113))  # 3 full blocks + 1 token
    assert bm.allocate(first, first.num_tokens)
    old_blocks = list(first.block_table)
    finish(bm, first)
    other = seq(1, range(200, 216))  # takes every block: the cached ones are evicted
    assert bm.allocate(other, other.num_tokens)
    plan = bm.take_host_transfers()
    assert sorted(plan.kv_out_blocks) == sorted(old_blocks[:3]) and len(set(plan.kv_out_slots)) == 3
    assert tier.stats.blocks_offloaded == 3
    bm.release_launched_host_transfers()
    finish(bm, other)
    again = seq(2, list(range(100, 112)) + [7, 8])
    prefix = bm.find_cached_prefix(again)
    assert list(prefix) == [ON_HOST] * 3 and len(prefix.host_slots) == 3
    assert bm.allocate(again, 2, prefix)
    plan = bm.take_host_transfers()
    out_slots = plan.kv_out_slots  # other's blocks, evicted for the restore, go out first
    assert set(out_slots).isdisjoint(plan.kv_in_slots)  # the restored entries are held, never overwritten
    assert plan.kv_in_blocks == again.block_table[:3] and tier.stats.blocks_restored == 3 and tier.stats.hits == 1
    assert again.num_computed_tokens == 12
    assert tier.kv.refs  # held until the step is launched
    bm.release_launched_host_transfers()
    assert not tier.kv.refs
    bm.free_seq(again)
    # The restored blocks are GPU-cached again: the next lookup needs no host copy.
    assert ON_HOST not in bm.find_cached_prefix(seq(3, list(range(100, 112)) + [9]))
    assert tier.leaks() == []


def test_metrics_report_the_host_tier():
    from prometheus_client.core import CollectorRegistry
    from prometheus_client import generate_latest

    from qsaserve.engine.async_engine import EngineSnapshot
    from qsaserve.server.metrics import _EngineCollector

    class Engine:
        snapshot = EngineSnapshot(host_tier_hits=3, host_tier_blocks_restored=40, host_tier_bytes_used=1 << 20,
                                  host_tier_bytes=1 << 30)

        def is_healthy(self):
            return True

    registry = CollectorRegistry()
    registry.register(_EngineCollector(Engine(), "m"))
    text = generate_latest(registry).decode()
    assert 'qsaserve:host_tier_hits_total{model_name="m"} 3.0' in text
    assert 'qsaserve:host_tier_blocks_restored_total{model_name="m"} 40.0' in text
    assert 'qsaserve:host_tier_bytes{model_name="m"} 1.073741824e+09' in text
