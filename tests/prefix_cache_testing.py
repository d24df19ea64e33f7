"""Shared by the prefix-cache and host-tier tests (tests/ is on sys.path via its conftest): running
prompts one after the other, and comparing an engine's generations with a reference engine's."""


def one_by_one(llm, prompts, params):
    """One RequestOutput per prompt, each generated alone and in order, so that each request finds
    what the previous ones left in the cache."""
    return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]


def assert_same_generations(ref, got, tol=1e-4):
    """Same generated tokens, and the same top-N logprobs at every generated position within
    tol + 1e-5 * |logprob| (the relative part: float32 rounding of reordered sums on logprobs
    around -30)."""
    for r, g in zip(ref, got, strict=True):
        a, b = r.outputs[0], g.outputs[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) <= tol + 1e-5 * abs(x[t].logprob)
