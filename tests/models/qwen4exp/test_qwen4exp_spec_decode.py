"""Speculative decoding on Qwen4Exp (GDN + PLE + QSA state): greedy tokens with drafts equal
transformers' qwen4_exp and the engine without drafts, for k = 1, 2, 3, through chunked prefill,
preemption, mixed batches, async scheduling, FP8 KV pages and prefix-cache hits.

Random weights do not repeat themselves, so besides real n-gram drafts the tests plant drafts
from the reference continuation (transformers' greedy tokens): all correct (every draft accepted),
all wrong (every draft rejected), or wrong from a random position on (each per-position state
row is restored in turn). The states after the run are compared with a run without drafts.
float32 CPU, tiny random models whose QSA budget (12 blocks) is below the number of groups, so the
index keys and the restored index tail decide the selection."""
import random

import pytest
import torch

from qsaserve import LLM, SamplingParams

from qwen4exp_testing import EOS, build_random_model, make_config

NEW = 14
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(4, 120, (lengths[i % len(lengths)],), generator=g)
        ids[len(ids) // 3] = EOS
        out.append(ids.tolist())
    return out


def hf_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The model, its path, three prompts, transformers' greedy continuations, and the state slot
    after each prompt run alone on the engine without drafts."""
    model = build_random_model(make_config(budget=12, ple_layer_ids=(1, 4)), seed=7)
    path = str(tmp_path_factory.mktemp("spec_qwen4exp"))
    model.save_pretrained(path)
    return checkpoint_runs(model, path)


def checkpoint_runs(model, path):
    """The checkpoint fixture's tuple for the model saved at path (its plain runs without drafts)."""
    ps = prompts(3, [45, 61, 38])
    plain = engine(path)
    plain_states = []
    for p in ps:
        generate(plain, [p])
        plain_states.append(states(plain))
    return model, path, ps, [hf_greedy(model, p, NEW) for p in ps], plain_states


def engine(path, k=None, method="ngram", **kw):
    # The timing-driven fallback off: on the real clock it would make the draft counts the tests
    # assert (and the restores they exercise) depend on the machine's speed.
    spec = {"method": method, "num_speculative_tokens": k, "disable_when_slower": False} if k else None
    args = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=20,
                block_size=8, progress=False, speculative_config=spec)
    return LLM(path, **{**args, **kw})


def plant(llm, reference, mode, seed=0):
    """Replaces the n-gram drafts with drafts made from the reference continuation: 'accept' (the
    reference's next tokens), 'reject' (each one off by one), 'mixed' (correct up to a random
    position, wrong from there)."""
    spec, rng = llm.engine.spec, random.Random(seed)
    propose = spec.propose

    def planted(seq, *running):
        propose(seq, *running)  # the room left (max_tokens, max_model_len)
        ref = reference[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        done = seq.num_output_tokens
        room = min(spec.k, len(ref) - done - 1)
        if room <= 0:
            seq.draft_token_ids = []
            return
        good = ref[done : done + room]
        cut = {"accept": room, "reject": 0, "mixed": rng.randint(0, room)}[mode]
        seq.draft_token_ids = good[:cut] + [(t + 1) % 120 for t in good[cut:]]

    spec.propose = planted


def generate(llm, ps, params=PARAMS):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]


def assert_preempted_and_freed(llm, small_pool: bool) -> None:
    """A run on a small KV pool preempted some sequence; every run gave all its blocks back."""
    if small_pool:
        assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def states(llm):
    return [t.clone() for s in llm.engine.executor.runner.model.slot_states() for t in s.tensors()]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("mode", ["accept", "reject", "mixed"])
def test_planted_drafts_equal_transformers_and_leave_the_states_of_a_plain_run(checkpoint, k, mode):
    model, path, ps, want, plain_states = checkpoint
    llm = engine(path, k)
    plant(llm, {tuple(q): w for q, w in zip(ps, want)}, mode, seed=k)
    for p, w, plain in zip(ps, want, plain_states):  # one at a time, each in state slot 1
        assert generate(llm, [p]) == [w]
        # Its last step fed its last token without drafts (nothing was left to draft), so the slot
        # holds the state after all but the last sampled token in both runs.
        for a, b in zip(plain, states(llm), strict=True):
            torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-5)
    st = llm.engine.spec.stats
    assert st.verifies > 0
    if mode == "accept":
        assert st.accepted == st.drafted > 0
    elif mode == "reject":
        assert st.accepted == 0 < st.drafted
    else:
        assert 0 < st.accepted < st.drafted


@pytest.mark.parametrize("k", [1, 3])
def test_batched_mixed_drafting_chunked_async_and_preempted(checkpoint, k):
    """Three requests at once with 20-token steps (prefill chunks beside verify rows), one of them
    sampling with a penalty (never drafts: a plain decode row in the same batch); async
    scheduling, a KV pool small enough to preempt, FP8 KV pages."""
    model, path, ps, want, _ = checkpoint
    params = [PARAMS, PARAMS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, repetition_penalty=1.0001)]
    runner = engine(path).engine.executor.runner
    # 18 blocks of 8 tokens: one request of max_model_len fits, the three (25 blocks) do not.
    small = 18 * runner.kv_spec.bytes_per_block + 9 * k * runner.model.state_snapshot_bytes()
    for kw in (dict(async_scheduling=True), dict(kv_cache_memory=small, max_model_len=128),
               dict(kv_cache_dtype="fp8_e4m3")):
        plain = engine(path, **kw)
        base = generate(plain, ps, params)
        llm = engine(path, k, **kw)
        plant(llm, {tuple(q): w for q, w in zip(ps, base)}, "mixed", seed=k)
        assert generate(llm, ps, params) == base
        if "kv_cache_dtype" not in kw:  # FP8 pages (unit scales) round K/V: equal to FP8 without drafts only
            assert base[:2] == want[:2]
        assert llm.engine.spec.stats.verifies > 0
        assert_preempted_and_freed(llm, "kv_cache_memory" in kw)


def test_ngram_drafts_and_prefix_cache_hits(checkpoint):
    """Real n-gram drafts on prompts that repeat themselves, with the hybrid prefix cache: the
    second round hits the snapshots the first left, and every token equals transformers'."""
    model, path, _, _, _ = checkpoint
    base = prompts(2, [18, 23], seed=3)
    ps = [b * 3 for b in base]
    want = [hf_greedy(model, p, NEW) for p in ps]
    llm = engine(path, 3, enable_prefix_caching=True, block_size=16, prefix_state_interval=16)
    for _ in range(2):
        assert [generate(llm, [p])[0] for p in ps] == want
    assert llm.engine.block_manager.state_cache.stats.hits > 0
    assert llm.engine.spec.stats.verifies > 0
