"""The host-memory tier of the hybrid prefix cache (--kv-offload-gib): a Qwen4Exp request whose
cached KV blocks and recurrent-state snapshot were evicted to host memory copies them back and
gives the same greedy tokens, and the same top-5 logprobs at every generated position (within
1e-4 + 1e-5 * |logprob|), as the same request with caching off; under eviction pressure (many
distinct long prefixes, a GPU pool that holds two of them, a host tier that holds a few) outputs
still equal recompute, and afterwards no block, snapshot row or host slot is referenced or lost.

Tiny float32 models with PLE on two layers, QSA compress ratios 4 (16-token pages, a snapshot
every block) and 3 (the engine's 48-token pages and interval), EOS inside every prompt. Requests
with prompt_logprobs bypass the prefix cache, so the logprobs compared are the generated ones.
"""
import pytest

from qsaserve import SamplingParams

from prefix_cache_testing import assert_same_generations, one_by_one
from qwen4exp_testing import build_random_model, cached_engine, cpu_engine, make_config, prompt_tokens

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module", params=[4, 3], ids=["ratio4", "ratio3"])
def checkpoint(request, tmp_path_factory):
    ratio = request.param
    model = build_random_model(make_config(budget=12, compress_ratio=ratio, ple_layer_ids=(1, 4)), seed=ratio)
    path = tmp_path_factory.mktemp(f"host_r{ratio}")
    model.save_pretrained(path)
    return ratio, str(path)


def per_block_bytes(ratio, path, **kw):
    """What one KV block costs in a budget, its share of a state snapshot included (split_cache_budget)."""
    ex = cached_engine(ratio, path, **kw).engine.executor
    return ex.kv_spec.bytes_per_block + ex.state_snapshot_bytes * ex.block_size / ex.state_interval


def gib_for(blocks, per_block):
    return (per_block * blocks + 64) / 2**30


def assert_no_leaks(llm):
    """Every block free, no snapshot row or host slot referenced, none lost."""
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    cache = bm.state_cache
    assert not cache.refs and len(cache.free) + len(cache.lru) == cache.num_rows
    assert bm.host_tier.leaks() == []
    assert not bm.host_tier.plan  # every planned copy was launched


def test_host_hit_after_the_gpu_tier_is_dropped(checkpoint):
    """The system prompt's blocks and snapshot are moved to the host (the GPU tier forgets them);
    the next requests copy them back instead of recomputing."""
    ratio, path = checkpoint
    system = prompt_tokens(110, seed=1)
    prompts = [system + prompt_tokens(n, seed=10 + n) for n in (9, 30)]
    ref = one_by_one(cpu_engine(path), [system] + prompts, PARAMS)
    llm = cached_engine(ratio, path, kv_offload_gib=0.05)
    bm = llm.engine.block_manager
    got = one_by_one(llm, [system], PARAMS)
    bm.offload_prefix_cache()
    assert not bm.hash_to_block and bm.state_cache.num_cached == 0  # nothing left on the GPU tier
    got += one_by_one(llm, prompts[:1], PARAMS)
    tier = bm.host_tier
    assert tier.stats.hits == 1 and tier.stats.blocks_restored > 0 and tier.stats.snapshots_restored == 1
    got += one_by_one(llm, prompts[1:], PARAMS)  # a GPU hit on the restored blocks
    assert_same_generations(ref, got)
    block = bm.block_size
    assert [o.num_cached_tokens for o in got] == [0] + [110 // block * block] * 2
    assert tier.stats.hits == 1 and bm.state_cache.stats.hits == 2
    assert_no_leaks(llm)


def test_eviction_pressure_equals_recompute_and_leaks_nothing(checkpoint):
    """Six distinct 100-token prefixes through a GPU pool of two requests' worth of blocks, twice
    (the second round with new suffixes, newest prefix first, concurrently, with preemptions):
    the GPU tier evicts to the host tier, the host tier evicts its least recently used entries,
    hits come from both."""
    ratio, path = checkpoint
    prefixes = [prompt_tokens(100, seed=30 + i) for i in range(6)]
    first = [p + prompt_tokens(7, seed=40 + i) for i, p in enumerate(prefixes)]
    second = [p + prompt_tokens(12, seed=50 + i) for i, p in enumerate(prefixes)][::-1]
    max_len = 144 if ratio == 4 else 192
    ref_llm = cpu_engine(path, max_model_len=max_len)
    ref = [ref_llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False)
           for batch in (first, second)]
    per_block = per_block_bytes(ratio, path, max_model_len=max_len)
    gpu_blocks = 20 if ratio == 4 else 8
    host_blocks = 24 if ratio == 4 else 11 # a few prefixes' worth, fewer than six
    llm = cached_engine(ratio, path, max_model_len=max_len, kv_cache_memory=int(per_block * (gpu_blocks + 1)) + 1,
                        kv_offload_gib=gib_for(host_blocks, per_block))
    bm = llm.engine.block_manager
    assert bm.num_blocks == gpu_blocks and bm.host_tier.kv.num_slots == host_blocks
    got = [llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False) for batch in (first, second)]
    for r, g in zip(ref, got):
        assert_same_generations(r, g)
    stats = bm.host_tier.stats
    assert stats.hits > 0 and stats.blocks_restored > 0 and stats.snapshots_restored > 0
    assert stats.blocks_offloaded > host_blocks  # the host tier itself evicted
    assert sum(o.num_cached_tokens for o in got[1]) > 0 and llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_a_host_hit_is_bit_identical_to_a_gpu_hit_with_async_scheduling(checkpoint):
    """The same request after the same first request, once hitting the GPU tier and once after
    the GPU tier was moved to the host: same tokens, same logprobs to the last bit (the blocks and
    the snapshot come back exactly; the schedules are the same, so nothing else differs)."""
    ratio, path = checkpoint
    system = prompt_tokens(100, seed=11)
    first, second = system + prompt_tokens(7, seed=12), system + prompt_tokens(12, seed=13)
    outs = []
    for via_host in (False, True):
        llm = cached_engine(ratio, path, kv_offload_gib=0.01, async_scheduling=True)
        one_by_one(llm, [first], PARAMS)
        if via_host:
            llm.engine.block_manager.offload_prefix_cache()
        outs.append(one_by_one(llm, [second], PARAMS)[0])
        assert_no_leaks(llm)
    gpu, host = outs
    assert host.num_cached_tokens == gpu.num_cached_tokens == 100 // llm.engine.block_manager.block_size * \
        llm.engine.block_manager.block_size
    assert llm.engine.block_manager.host_tier.stats.snapshots_restored == 1
    assert host.outputs[0].token_ids == gpu.outputs[0].token_ids
    assert [{k: v.logprob for k, v in d.items()} for d in host.outputs[0].logprobs] == \
        [{k: v.logprob for k, v in d.items()} for d in gpu.outputs[0].logprobs]


def test_fp8_pages_restored_from_the_host_like_recompute(tmp_path):
    """FP8 K/V pages (and the QSA index pages beside them) come back from the host bit for bit."""
    model = build_random_model(make_config(budget=12, compress_ratio=4, ple_layer_ids=(1, 4)), seed=4)
    model.save_pretrained(tmp_path)
    path = str(tmp_path)
    system = prompt_tokens(70, seed=7)
    prompt = system + prompt_tokens(20, seed=8)
    ref = one_by_one(cpu_engine(path, kv_cache_dtype="fp8_e4m3"), [prompt], PARAMS)
    llm = cached_engine(4, path, kv_cache_dtype="fp8_e4m3", kv_offload_gib=0.05)
    one_by_one(llm, [system], PARAMS)
    llm.engine.block_manager.offload_prefix_cache()
    got = one_by_one(llm, [prompt], PARAMS)
    assert_same_generations(ref, got)
    assert got[0].num_cached_tokens == 64 and llm.engine.block_manager.host_tier.stats.blocks_restored == 4
    assert_no_leaks(llm)


def test_host_tier_needs_prefix_caching(checkpoint):
    ratio, path = checkpoint
    with pytest.raises(ValueError, match="kv_offload_gib"):
        cpu_engine(path, kv_offload_gib=0.01)
