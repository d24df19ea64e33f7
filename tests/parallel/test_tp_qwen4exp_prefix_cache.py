"""The hybrid prefix cache under tensor and decode-context parallelism (CPU, gloo): TP2 with DCP2
(one KV head, token-sharded pages; every rank restores and saves its own state shards by the same
plan) gives the same greedy tokens and generated logprobs as one rank with caching off, for a
shared prefix with different suffixes (a snapshot taken inside a prefill chunk) and a multi-turn
follow-up (one taken by a decode step), with hits on both."""
import torch

from qsaserve import LLM, SamplingParams

from parallel_helpers import assert_same_outputs, tiny_qwen4exp

TOL = 1e-4
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
ENGINE = dict(max_model_len=160, kv_cache_memory=1 << 21, block_size=8, max_num_batched_tokens=24,
              distributed_timeout_s=120)


def test_tp2_dcp2_prefix_hits_match_one_rank_without_caching(tmp_path):
    path = tiny_qwen4exp(tmp_path / "q4", kv_heads=1, seed=7)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(4, 120, (45,), generator=g).tolist()
    system[10] = 3  # EOS inside the prompt
    first, second = system + [5], system + torch.randint(4, 120, (19,), generator=g).tolist()

    def serve(llm):
        outs = [llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0] for p in (first, second)]
        follow_up = first + outs[0].outputs[0].token_ids + [9, 10, 11]
        return outs + [llm.generate([{"prompt_token_ids": follow_up}], PARAMS, use_tqdm=False)[0]]

    one = LLM(path, dtype="float32", progress=False, **ENGINE)
    ref = serve(one)
    llm = LLM(path, dtype="float32", progress=False, tensor_parallel_size=2, decode_context_parallel_size=2,
              enable_prefix_caching=True, prefix_state_interval=16, **ENGINE)
    try:
        bm = llm.engine.block_manager
        assert bm.block_size == 16 and bm.state_cache.interval == 16  # 8-token pages on each of 2 ranks
        got = serve(llm)
        assert [o.num_cached_tokens for o in got] == [0, 32, 48]
        assert bm.state_cache.stats.hits == 2
    finally:
        llm.engine.shutdown()
    assert_same_outputs(ref, got, TOL)
