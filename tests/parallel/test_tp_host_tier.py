"""The host KV tier under tensor and decode-context parallelism (CPU, gloo): TP2 with DCP2 (one
KV head, token-sharded pages; each rank copies its own pages and state shards out and back by the
one plan rank 0 makes) gives the same greedy tokens and generated logprobs as one rank with
caching off, for a prefix whose blocks and snapshot were moved to the host and then hit."""
import torch

from qsaserve import LLM, SamplingParams

from parallel_helpers import assert_same_outputs, tiny_qwen4exp

TOL = 1e-4
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
ENGINE = dict(max_model_len=160, kv_cache_memory=1 << 21, block_size=8, max_num_batched_tokens=24,
              distributed_timeout_s=120)


def test_tp2_dcp2_host_hits_match_one_rank_without_caching(tmp_path):
    path = tiny_qwen4exp(tmp_path / "q4", kv_heads=1, seed=7)
    g = torch.Generator().manual_seed(2)
    system = torch.randint(4, 120, (45,), generator=g).tolist()
    system[10] = 3  # EOS inside the prompt
    prompts = [system + [5], system + torch.randint(4, 120, (19,), generator=g).tolist()]

    one = LLM(path, dtype="float32", progress=False, **ENGINE)
    ref = [one.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0] for p in prompts]
    llm = LLM(path, dtype="float32", progress=False, tensor_parallel_size=2, decode_context_parallel_size=2,
              enable_prefix_caching=True, prefix_state_interval=16, kv_offload_gib=0.01, **ENGINE)
    try:
        bm = llm.engine.block_manager
        got = [llm.generate([{"prompt_token_ids": prompts[0]}], PARAMS, use_tqdm=False)[0]]
        bm.offload_prefix_cache()
        got.append(llm.generate([{"prompt_token_ids": prompts[1]}], PARAMS, use_tqdm=False)[0])
        assert [o.num_cached_tokens for o in got] == [0, 32]
        stats = bm.host_tier.stats
        assert stats.hits == 1 and stats.blocks_restored == 2 and stats.snapshots_restored == 1
        assert bm.host_tier.leaks() == []
    finally:
        llm.engine.shutdown()
    assert_same_outputs(ref, got, TOL)
