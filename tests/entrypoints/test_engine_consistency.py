"""Engine mechanics must not change outputs: prefix-cache hits vs misses, chunked prefill at
several budgets, preemption by recompute on a tiny KV pool, and 1 vs 16 concurrent requests all
give the same greedy tokens and (within float32 summation noise) the same logprobs."""
import pytest

from qsaserve import LLM, SamplingParams

# Long enough to span several 16-token blocks and several chunks.
BASE = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring, then by punched cards, then by assembly language, and finally by high-level "
    "languages that let people describe what they want rather than how to do it. "
)
PROMPTS = [BASE + tail for tail in [
    "In the next decade,", "The most important idea was", "Compilers made it possible to",
    "Operating systems", "Networking changed everything because", "Today, most programmers",
    "A simple example is", "The key insight of Unix was", "Databases store", "Python became popular since",
    "Memory hierarchies", "Parallel computing", "Open source software", "The web browser",
    "Version control systems", "Testing software",
]]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
TOL = 1e-3


def run(llm, prompts=PROMPTS, params=PARAMS):
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same(a, b):
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < TOL


@pytest.fixture(scope="module")
def reference():
    # One request at a time: no batching, no caching, whole prompts in one chunk.
    llm = LLM(dtype="float32", max_model_len=512, enable_prefix_caching=False, max_num_seqs=1, progress=False)
    return run(llm)


def test_concurrent_16_equals_one_at_a_time(reference):
    llm = LLM(dtype="float32", max_model_len=512, enable_prefix_caching=False, progress=False)
    assert_same(run(llm), reference)


def test_prefix_cache_hits_give_same_outputs(reference):
    llm = LLM(dtype="float32", max_model_len=512, enable_prefix_caching=True, progress=False)
    first = run(llm, PROMPTS[:1])
    stats = llm.engine.block_manager.stats
    hits_before = stats.hits
    rest = run(llm, PROMPTS[1:])
    assert stats.hits > hits_before  # the shared BASE prefix was served from cache
    assert_same(first + rest, reference)
    again = run(llm)  # every prompt now fully cached except its last block
    assert_same(again, reference)


@pytest.mark.parametrize("budget", [13, 64])
def test_chunked_prefill_budgets(reference, budget):
    llm = LLM(dtype="float32", max_model_len=512, max_num_batched_tokens=budget, enable_prefix_caching=False, progress=False)
    assert_same(run(llm), reference)


def test_preemption_on_tiny_pool_keeps_outputs(reference):
    # 16 blocks x 16 tokens: fits one max-length request, far from all 16 at once.
    llm = LLM(dtype="float32", max_model_len=256, block_size=16, progress=False,
              kv_cache_memory=17 * 16 * 30 * 2 * 3 * 64 * 4)
    outs = run(llm)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same(outs, reference)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_seeded_sampling_is_batch_independent():
    llm = LLM(dtype="float32", max_model_len=512, progress=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    alone = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(PROMPTS[:8], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched


def test_simple_sampler_and_decode_fast_path_match_reference(reference):
    """Greedy without logprobs takes the batched sampler path, and once every prompt is in, the
    all-decode batch builder; a small budget mixes prefill chunks into decode steps first. The
    tokens equal the one-at-a-time reference (general sampler, no batching)."""
    llm = LLM(dtype="float32", max_model_len=512, enable_prefix_caching=False, max_num_batched_tokens=96,
              progress=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in reference]


def test_finished_only_steps_equal_streamed_steps():
    """step(outputs="finished") returns the same final outputs as the streaming step("all"), whose
    per-step outputs grow by one token at a time and never change text already sent."""
    from qsaserve.engine.llm_engine import LLMEngine
    from qsaserve.config import EngineConfig

    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(4)]
    params.append(SamplingParams(temperature=0.9, seed=7, max_tokens=8, n=2))

    def run_engine(mode):
        engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=512, max_num_batched_tokens=64), progress=False)
        for i, p in enumerate(params):
            engine.add_request(str(i), PROMPTS[i], p)
        steps = []
        while engine.has_unfinished_requests():
            steps.append(engine.step(outputs=mode))
        return steps

    streamed, finished_only = run_engine("all"), run_engine("finished")
    final = {o.request_id: o for outs in streamed for o in outs if o.finished}
    got = {o.request_id: o for outs in finished_only for o in outs}
    assert all(o.finished for outs in finished_only for o in outs)
    assert final.keys() == got.keys() == {str(i) for i in range(len(params))}
    for rid, out in final.items():
        assert [(c.token_ids, c.text, c.finish_reason) for c in out.outputs] == \
            [(c.token_ids, c.text, c.finish_reason) for c in got[rid].outputs]
    seen: dict[tuple[str, int], tuple[list[int], str]] = {}
    for outs in streamed:
        for o in outs:
            for c in o.outputs:
                ids, text = seen.get((o.request_id, c.index), ([], ""))
                assert c.token_ids[: len(ids)] == ids and len(c.token_ids) <= len(ids) + 1
                assert c.text.startswith(text)
                seen[(o.request_id, c.index)] = (c.token_ids, c.text)
