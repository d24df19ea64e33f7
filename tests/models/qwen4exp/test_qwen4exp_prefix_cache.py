"""The hybrid prefix cache: a Qwen4Exp request that hits it (KV blocks plus a recurrent-state
snapshot restored into its slot) gives the same greedy tokens, and the same logprobs (top-5 at
every generated position, within 1e-4 + 1e-5 * |logprob|), as the same request with caching off.

Tiny float32 models with PLE on two layers, QSA compress ratios 4 and 3 (the latter on the
default 48-token page), EOS inside every prompt. Requests run one after the other, so a request
finds what the previous ones left. Requests with prompt_logprobs bypass the cache (their prefix
positions would have no logits), so the logprobs compared are those of the generated tokens: the
first is computed from the last prompt position after the restored state and the suffix's prefill.
"""
import pytest

from qsaserve import SamplingParams

from prefix_cache_testing import assert_same_generations, one_by_one
from qwen4exp_testing import build_random_model, cached_engine, cpu_engine, make_config, prompt_tokens

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


def save_checkpoint(ratio, tmp_path_factory):
    model = build_random_model(make_config(budget=12, compress_ratio=ratio, ple_layer_ids=(1, 4)), seed=ratio)
    path = tmp_path_factory.mktemp(f"prefix_r{ratio}")
    model.save_pretrained(path)
    return ratio, str(path)


@pytest.fixture(scope="module", params=[4, 3], ids=["ratio4", "ratio3"])
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def ratio4(tmp_path_factory):
    return save_checkpoint(4, tmp_path_factory)


def state_hits(llm):
    return llm.engine.block_manager.state_cache.stats.hits


def assert_no_leaks(llm):
    """Once every request is done: no block or snapshot row is referenced, none is lost."""
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    cache = bm.state_cache
    assert not cache.refs
    assert len(cache.free) + len(cache.lru) == cache.num_rows == len(cache.free) + cache.num_cached


def test_shared_system_prompt_with_different_suffixes(checkpoint):
    ratio, path = checkpoint
    system = prompt_tokens(110, seed=1)
    prompts = [system + prompt_tokens(n, seed=10 + n) for n in (9, 30, 55)]
    ref = one_by_one(cpu_engine(path), prompts, PARAMS)
    llm = cached_engine(ratio, path)
    got = one_by_one(llm, prompts, PARAMS)
    assert_same_generations(ref, got)
    block = llm.engine.block_manager.block_size
    assert got[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 110 // block * block for o in got[1:])  # the deepest boundary inside
    assert state_hits(llm) == 2
    assert_no_leaks(llm)


def test_multi_turn_follow_up_reuses_prompt_and_answer(checkpoint):
    """Turn 2's prompt is turn 1's prompt + answer + new text: its hit ends at a boundary that
    turn 1 reached while decoding, so the snapshot used was taken by a decode step."""
    ratio, path = checkpoint
    first = prompt_tokens(40 if ratio == 4 else 90, seed=2)
    ref_llm = cpu_engine(path)
    answer = one_by_one(ref_llm, [first], PARAMS)[0].outputs[0].token_ids
    second = first + answer + prompt_tokens(15, seed=3)
    ref = [one_by_one(ref_llm, [first], PARAMS)[0], one_by_one(ref_llm, [second], PARAMS)[0]]
    llm = cached_engine(ratio, path)
    got = one_by_one(llm, [first, second], PARAMS)
    assert_same_generations(ref, got)
    block = llm.engine.block_manager.block_size
    boundary = len(first + answer) // block * block
    assert boundary > len(first)  # inside the answer: a decode-time snapshot
    assert got[1].num_cached_tokens == boundary and state_hits(llm) == 1
    assert_no_leaks(llm)


def test_hit_in_the_middle_of_a_chunked_prefill_with_async_scheduling(checkpoint):
    """Two requests in one batch behind a cached prefix: the hit restores a snapshot taken inside
    a chunk, the rest of each prompt is prefilled in chunks shared with the other's decodes, and
    the host runs a step ahead (async scheduling)."""
    ratio, path = checkpoint
    system = prompt_tokens(100, seed=4)
    prompts = [system + prompt_tokens(70, seed=5), system + prompt_tokens(85, seed=6)]
    ref = cpu_engine(path).generate([{"prompt_token_ids": p} for p in [system] + prompts], PARAMS, use_tqdm=False)
    llm = cached_engine(ratio, path, async_scheduling=True)
    got = one_by_one(llm, [system], PARAMS) + llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                                                           use_tqdm=False)
    assert_same_generations(ref, got)
    assert state_hits(llm) == 2 and all(o.num_cached_tokens > 40 for o in got[1:])
    assert_no_leaks(llm)


def test_hits_after_preemption(checkpoint):
    """Two requests in a KV pool too small for both: the newer is preempted while decoding, the
    older takes one of its freed blocks and finishes, and the recompute restores from the
    preempted request's own published blocks and snapshot."""
    ratio, path = checkpoint
    lengths, max_tokens, blocks, max_len = ((64, 70), 40, 12, 144) if ratio == 4 else ((100, 110), 60, 6, 192)
    prompts = [prompt_tokens(n, seed=20 + n) for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    ref = cpu_engine(path).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ex = cached_engine(ratio, path, max_model_len=max_len).engine.executor
    spec = ex.kv_spec
    per_block = spec.bytes_per_block + ex.state_snapshot_bytes * ex.block_size / ex.state_interval  # split_cache_budget
    llm = cached_engine(ratio, path, max_model_len=max_len, kv_cache_memory=int(per_block * (blocks + 1)) + 1)
    assert llm.engine.block_manager.num_blocks == blocks
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_same_generations(ref, got)
    assert llm.engine.scheduler.num_preemptions > 0 and state_hits(llm) > 0
    assert_no_leaks(llm)


def test_fp8_kv_pages_hit_like_recompute(ratio4):
    ratio, path = ratio4
    system = prompt_tokens(70, seed=7)
    prompts = [system + prompt_tokens(20, seed=8), system + prompt_tokens(33, seed=9)]
    ref = one_by_one(cpu_engine(path, kv_cache_dtype="fp8_e4m3"), prompts, PARAMS)
    llm = cached_engine(ratio, path, kv_cache_dtype="fp8_e4m3")
    got = one_by_one(llm, prompts, PARAMS)
    # A hit's new rows attend over pages written by another step's chunk (sums in another order):
    # E4M3 pages dequantized through their scale carry that as ~2e-4 on logprobs (CPU-dependent).
    assert_same_generations(ref, got, tol=1e-3)
    assert state_hits(llm) == 1


def test_snapshot_pool_is_reported_and_caching_stays_off_by_default(ratio4, caplog):
    ratio, path = ratio4
    assert cpu_engine(path).engine.block_manager.state_cache is None
    with caplog.at_level("INFO", logger="qsaserve"):
        llm = cached_engine(ratio, path)
    cache = llm.engine.block_manager.state_cache
    assert cache.interval == 16 and cache.num_rows > 0
    assert any("recurrent-state snapshots every 16 tokens" in r.getMessage() for r in caplog.records)
    kv_tokens = llm.engine.block_manager.num_blocks * 16
    assert cache.num_rows == (kv_tokens + 16) // 16  # one snapshot per interval of KV (the null block counted)
