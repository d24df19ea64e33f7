"""The host-memory tier of the prefix cache for Llama-family models (--kv-offload-gib): a request
whose cached blocks were evicted to host memory copies them back and gives the same greedy tokens
and top-5 generated logprobs (within 1e-4 + 1e-5 * |logprob|) as caching off, in the model dtype
and with FP8 pages (moved as raw bytes; their scales are per layer); under eviction pressure
outputs equal recompute and nothing is referenced or lost afterwards. Tiny random float32 Llama."""
import pytest
import torch

from qsaserve import LLM, SamplingParams

from prefix_cache_testing import assert_same_generations, one_by_one

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, p.shape[-1] ** -0.5)
        model.lm_head.weight.mul_(10)
    out = tmp_path_factory.mktemp("llama_host")
    model.save_pretrained(out)
    return str(out)


def tokens(n, seed):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(path, **kw):
    return LLM(path, **{**dict(dtype="float32", device="cpu", max_model_len=256, block_size=16,
                               max_num_batched_tokens=48, progress=False), **kw})


def assert_no_leaks(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.host_tier.leaks() == [] and not bm.host_tier.plan


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_host_hit_after_the_gpu_tier_is_dropped(path, kv_dtype):
    system = tokens(90, seed=1)
    prompts = [system + tokens(n, seed=10 + n) for n in (5, 21)]
    ref = one_by_one(engine(path, enable_prefix_caching=False, kv_cache_dtype=kv_dtype), [system] + prompts, PARAMS)
    llm = engine(path, kv_offload_gib=0.01, kv_cache_dtype=kv_dtype)
    bm = llm.engine.block_manager
    got = one_by_one(llm, [system], PARAMS)
    bm.offload_prefix_cache()
    got += one_by_one(llm, prompts, PARAMS)
    assert_same_generations(ref, got)
    assert [o.num_cached_tokens for o in got] == [0, 80, 80]
    assert bm.host_tier.stats.hits == 1 and bm.host_tier.stats.blocks_restored == 5
    assert_no_leaks(llm)


def test_eviction_pressure_equals_recompute_and_leaks_nothing(path):
    """Eight distinct 70-token prefixes through a 24-block GPU pool and a 20-block host tier, twice
    (newest first the second time), concurrently, with async scheduling and preemptions."""
    prefixes = [tokens(70, seed=30 + i) for i in range(8)]
    rounds = [[p + tokens(6, seed=40 + i) for i, p in enumerate(prefixes)],
              [p + tokens(9, seed=50 + i) for i, p in enumerate(prefixes)][::-1]]
    ref_llm = engine(path, enable_prefix_caching=False)
    ref = [ref_llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False) for batch in rounds]
    per_block = engine(path).engine.executor.kv_spec.bytes_per_block
    llm = engine(path, kv_cache_memory=per_block * 25, kv_offload_gib=(per_block * 20 + 64) / 2**30,
                 async_scheduling=True)
    bm = llm.engine.block_manager
    assert bm.num_blocks == 24 and bm.host_tier.kv.num_slots == 20
    got = [llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False) for batch in rounds]
    for r, g in zip(ref, got):
        assert_same_generations(r, g)
    stats = bm.host_tier.stats
    assert stats.hits > 0 and stats.blocks_restored > 0 and stats.blocks_offloaded > 20
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_startup_log_names_the_host_tier(path, caplog):
    with caplog.at_level("INFO", logger="qsaserve"):
        llm = engine(path, kv_offload_gib=0.01)
    tier = llm.engine.block_manager.host_tier
    assert tier.kv.num_slots == int(0.01 * 2**30) // llm.engine.executor.kv_spec.bytes_per_block
    assert any(r.getMessage().startswith(f"host KV tier: {tier.kv.num_slots} blocks") for r in caplog.records)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_on_cuda_a_host_hit_reads_the_same_bits_as_a_gpu_hit(path, kv_dtype):
    """On the GPU (side-stream copies into pinned memory, async scheduling, CUDA-graph decode) a
    host hit restores what the GPU tier held: its tokens and logprobs equal a GPU hit's on the
    same prompt, and its greedy tokens equal caching off."""
    system = tokens(90, seed=1)
    prompt = system + tokens(21, seed=2)
    kw = dict(device="cuda", kv_cache_dtype=kv_dtype, async_scheduling=True, kv_cache_memory=64 << 20)
    ref = one_by_one(engine(path, enable_prefix_caching=False, **kw), [prompt], PARAMS)[0]
    llm = engine(path, kv_offload_gib=0.01, **kw)
    bm = llm.engine.block_manager
    one_by_one(llm, [system], PARAMS)
    gpu_hit = one_by_one(llm, [prompt], PARAMS)[0]
    bm.reset_gpu_tier()
    one_by_one(llm, [system], PARAMS)  # cached again on the GPU tier, then moved to the host
    bm.offload_prefix_cache()
    host_hit = one_by_one(llm, [prompt], PARAMS)[0]
    assert gpu_hit.num_cached_tokens == host_hit.num_cached_tokens == 80
    assert bm.host_tier.stats.blocks_restored >= 5
    assert host_hit.outputs[0].token_ids == gpu_hit.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_same_generations([gpu_hit], [host_hit])
    assert_no_leaks(llm)
