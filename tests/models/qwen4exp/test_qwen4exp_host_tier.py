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
import torch

from qsaserve import LLM, SamplingParams

from qwen4exp_testing import EOS, build_random_model, make_config

TOL = 1e-4
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)


def tokens(n, seed):
    ids = torch.randint(4, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    ids[n // 3] = EOS
    return ids


@pytest.fixture(scope="module", params=[4, 3], ids=["ratio4", "ratio3"])
def checkpoint(request, tmp_path_factory):
    ratio = request.param
    model = build_random_model(make_config(budget=12, compress_ratio=ratio, ple_layer_ids=(1, 4)), seed=ratio)
    path = tmp_path_factory.mktemp(f"host_r{ratio}")
    model.save_pretrained(path)
    return ratio, str(path)


def engine(path, **kw):
    return LLM(path, **{**dict(dtype="float32", device="cpu", max_model_len=320, progress=False), **kw})


def cached_engine(ratio, path, **kw):
    sizes = dict(block_size=16, prefix_state_interval=16) if ratio == 4 else {}
    return engine(path, enable_prefix_caching=True, max_num_batched_tokens=40, **{**sizes, **kw})


def per_block_bytes(ratio, path, **kw):
    """What one KV block costs in a budget, its share of a state snapshot included (split_cache_budget)."""
    ex = cached_engine(ratio, path, **kw).engine.executor
    return ex.kv_spec.bytes_per_block + ex.state_snapshot_bytes * ex.block_size / ex.state_interval


def gib_for(blocks, per_block):
    return (per_block * blocks + 64) / 2**30


def run_one_by_one(llm, prompts):
    return [llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0] for p in prompts]


def assert_same(ref, got):
    for r, g in zip(ref, got, strict=True):
        a, b = r.outputs[0], g.outputs[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) <= TOL + 1e-5 * abs(x[t].logprob)


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
    system = tokens(110, seed=1)
    prompts = [system + tokens(n, seed=10 + n) for n in (9, 30)]
    ref = run_one_by_one(engine(path), [system] + prompts)
    llm = cached_engine(ratio, path, kv_offload_gib=0.05)
    bm = llm.engine.block_manager
    got = run_one_by_one(llm, [system])
    bm.offload_prefix_cache()
    assert not bm.hash_to_block and bm.state_cache.num_cached == 0  # nothing left on the GPU tier
    got += run_one_by_one(llm, prompts[:1])
    tier = bm.host_tier
    assert tier.stats.hits == 1 and tier.stats.blocks_restored > 0 and tier.stats.snapshots_restored == 1
    got += run_one_by_one(llm, prompts[1:])  # a GPU hit on the restored blocks
    assert_same(ref, got)
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
    prefixes = [tokens(100, seed=30 + i) for i in range(6)]
    first = [p + tokens(7, seed=40 + i) for i, p in enumerate(prefixes)]
    second = [p + tokens(12, seed=50 + i) for i, p in enumerate(prefixes)][::-1]
    max_len = 144 if ratio == 4 else 192
    ref_llm = engine(path, max_model_len=max_len)
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
        assert_same(r, g)
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
    system = tokens(100, seed=11)
    first, second = system + tokens(7, seed=12), system + tokens(12, seed=13)
    outs = []
    for via_host in (False, True):
        llm = cached_engine(ratio, path, kv_offload_gib=0.01, async_scheduling=True)
        run_one_by_one(llm, [first])
        if via_host:
            llm.engine.block_manager.offload_prefix_cache()
        outs.append(run_one_by_one(llm, [second])[0])
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
    system = tokens(70, seed=7)
    prompt = system + tokens(20, seed=8)
    ref = run_one_by_one(engine(path, kv_cache_dtype="fp8_e4m3"), [prompt])
    llm = cached_engine(4, path, kv_cache_dtype="fp8_e4m3", kv_offload_gib=0.05)
    run_one_by_one(llm, [system])
    llm.engine.block_manager.offload_prefix_cache()
    got = run_one_by_one(llm, [prompt])
    assert_same(ref, got)
    assert got[0].num_cached_tokens == 64 and llm.engine.block_manager.host_tier.stats.blocks_restored == 4
    assert_no_leaks(llm)


def test_host_tier_needs_prefix_caching(checkpoint):
    ratio, path = checkpoint
    with pytest.raises(ValueError, match="kv_offload_gib"):
        engine(path, kv_offload_gib=0.01)
