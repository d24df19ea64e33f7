"""Speculative decoding with n-gram drafts on a Llama-family model, and its parts: the config's
validation, the prompt-lookup drafter, the rejection sampler's distribution (chi-square), the
block manager's rollback. Greedy tokens with drafts must equal transformers' and the engine's
without drafts (float32 CPU, a tiny random HF Llama whose prompts repeat themselves, so n-gram
drafts are both accepted and rejected)."""
import pytest
import torch
from scipy.stats import chisquare

from qsaserve import LLM, SamplingParams
from qsaserve.config import EngineConfig
from qsaserve.engine.ngram_proposer import propose_ngram
from qsaserve.engine.rejection_sampler import verify_drafts
from qsaserve.engine.sequence import Sequence
from qsaserve.errors import InvalidRequestError
from qsaserve.speculative_config import SpeculativeConfig, parse_speculative_config

VOCAB = 250
NEW = 24


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, p.shape[-1] ** -0.5)
        model.lm_head.weight.mul_(10)
    path = tmp_path_factory.mktemp("spec_llama")
    model.save_pretrained(path)
    return model, str(path)


def repetitive_prompts():
    g = torch.Generator().manual_seed(1)
    out = []
    for n in (7, 11, 5, 13):
        unit = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append(unit * 3 + unit[: n // 2])
    return out


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def generate(llm, ps, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]


def engine(path, spec=None, **kw):
    """With a spec dict the timing-driven fallback is off unless asked for (test_draft_policy.py
    drives it with an injected clock): on this machine's real clock it would make the counts of
    drafts the tests assert depend on its speed."""
    if isinstance(spec, dict):
        spec = {"disable_when_slower": False, **spec}
    args = dict(dtype="float32", device="cpu", max_model_len=256, max_num_batched_tokens=24, block_size=16,
                progress=False, speculative_config=spec)
    return LLM(path, **{**args, **kw})


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_ngram_equals_transformers_and_no_drafts(hf_llama, k):
    model, path = hf_llama
    ps = repetitive_prompts()
    want = [hf_greedy(model, p, NEW) for p in ps]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert generate(engine(path), ps, params) == want
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    for kw in ({}, {"async_scheduling": True}, {"kv_cache_memory": 9 * 16 * 512, "max_model_len": 96}):
        llm = engine(path, spec, **kw)
        assert generate(llm, ps, params) == want, kw
        st = llm.engine.spec.stats
        assert 0 < st.accepted < st.drafted, st  # both outcomes happened
        assert st.acceptance_length == 1 + st.accepted / st.verifies
        assert sum(st.accepted_per_position) == st.accepted
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # rolled-back blocks all came back
        if "kv_cache_memory" in kw:
            assert llm.engine.scheduler.num_preemptions > 0


def test_max_tokens_and_stop_tokens_cut_accepted_drafts(hf_llama):
    """A verify that accepts past max_tokens or a stop token emits nothing after it."""
    model, path = hf_llama
    ps = repetitive_prompts()
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    for n in (1, 2, 5):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        assert generate(engine(path, spec), ps, params) == generate(engine(path), ps, params)
    stop = hf_greedy(model, ps[0], NEW)[6]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[stop])
    got = generate(engine(path, spec), ps, params)
    assert got == generate(engine(path), ps, params)
    assert got[0][-1] == stop and len(got[0]) <= 7


def test_sampled_requests_draft_and_seeded_ones_repeat(hf_llama):
    """temperature > 0: tokens stay in the vocabulary, a seeded request repeats itself exactly."""
    _, path = hf_llama
    ps = repetitive_prompts()
    params = SamplingParams(temperature=0.8, max_tokens=NEW, ignore_eos=True, seed=5)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    a, b = generate(engine(path, spec), ps, params), generate(engine(path, spec), ps, params)
    assert a == b and all(len(t) == NEW and all(0 <= x < VOCAB for x in t) for t in a)


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size(hf_llama):
    """disable_by_batch_size=1: drafts only once a single request is left (the longest one)."""
    model, path = hf_llama
    ps = repetitive_prompts()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 8, 10, NEW)]
    want = [hf_greedy(model, p, q.max_tokens) for p, q in zip(ps, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    free, limited = engine(path, spec), engine(path, {**spec, "disable_by_batch_size": 1})
    assert generate(free, ps, params) == want == generate(limited, ps, params)
    assert 0 < limited.engine.spec.stats.verifies < free.engine.spec.stats.verifies


def test_a_steps_drafts_are_topped_up_to_one_length(hf_llama):
    """A repetitive prompt (its lookups match) beside one of distinct ids (its lookups find
    nothing at first): after each step the short sequences' drafts are topped up to the longest,
    so every step where all sequences decode verifies the same number of drafts for each (one
    verify graph's shape on a GPU); tokens equal transformers'. Without drafts anywhere nothing
    is added (no verify step at all for the distinct prompt alone)."""
    model, path = hf_llama
    distinct = list(range(3, 33))
    ps = [repetitive_prompts()[0], distinct]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    llm = engine(path, spec)
    assert not llm.engine.spec.align  # no verify graphs on this machine: drafts are left as found
    llm.engine.spec.align = True  # as an engine whose runner captured verify graphs sets it
    steps, schedule = [], llm.engine.scheduler.schedule

    def recorded():
        out = schedule()
        # steps of decoding sequences each with room for k drafts (a request's last tokens cap its own)
        if out.chunks and all(c.num_new_tokens == c.num_drafts + 1 and NEW - c.seq.num_output_tokens > 3
                              for c in out.chunks):
            steps.append([c.num_drafts for c in out.chunks])
        return out

    llm.engine.scheduler.schedule = recorded
    assert generate(llm, ps, params) == [hf_greedy(model, p, NEW) for p in ps]
    mixed = [d for d in steps if len(d) == 2 and any(d)]
    assert mixed and all(d[0] == d[1] for d in mixed), steps
    st = llm.engine.spec.stats
    assert st.accepted > 0 and 0 < st.topped_up < st.drafted
    alone = engine(path, spec)
    alone.engine.spec.align = True
    assert generate(alone, [distinct], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) == \
        [hf_greedy(model, distinct, 4)]


# ---- the rejection sampler ----

def _seqs(n, temperature):
    return [Sequence(i, str(i), 0, [1], SamplingParams(temperature=temperature), None) for i in range(n)]


def expected(probs, total):
    probs = probs.double()
    return probs / probs.sum() * total


def test_rejection_sampling_reproduces_the_target_distribution():
    """Many draws of one verify (k = 2, a one-hot draft each position): the first emitted token is
    distributed as softmax(row 0), and the second, given the first draft was accepted, as
    softmax(row 1) (chi-square, p > 1e-3), whatever the draft. A draft of high and one of low
    target probability are both checked."""
    torch.manual_seed(0)
    vocab, n = 6, 40_000
    logits = torch.randn(3, vocab) * 1.5
    p = logits.softmax(-1)
    for drafts in ([int(p[0].argmax()), int(p[1].argmin())], [int(p[0].argmin()), int(p[1].argmax())]):
        gen = torch.Generator().manual_seed(1)
        emitted, finite = verify_drafts(logits[None].expand(n, 3, vocab).contiguous(), [list(drafts)] * n,
                                        _seqs(n, 1.0), gen)
        assert all(finite)
        first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=vocab).double()
        assert chisquare(first, expected(p[0], n)).pvalue > 1e-3
        second = [e[1] for e in emitted if len(e) > 1]
        counts = torch.bincount(torch.tensor(second), minlength=vocab).double()
        assert chisquare(counts, expected(p[1], len(second))).pvalue > 1e-3
        # Acceptance of draft 0 happens with probability p0(d0).
        accepted = sum(1 for e in emitted if len(e) > 1) / n
        assert abs(accepted - float(p[0, drafts[0]])) < 4 * (float(p[0, drafts[0]]) * (1 - float(p[0, drafts[0]])) / n) ** 0.5 + 1e-3


def test_greedy_verify_accepts_the_longest_matching_prefix():
    logits = torch.full((1, 4, 10), -5.0)
    for row, tok in enumerate([3, 4, 5, 6]):
        logits[0, row, tok] = 5.0
    cases = {(3, 4, 5): [3, 4, 5, 6], (3, 9, 5): [3, 4], (1, 4, 5): [3], (3, 4): [3, 4, 5]}
    for drafts, want in cases.items():
        emitted, _ = verify_drafts(logits, [list(drafts)], _seqs(1, 0.0), torch.Generator())
        assert emitted == [want]


# ---- the drafter and the config ----

def test_ngram_proposer():
    seq = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert propose_ngram(seq, 3, 4, 1) == [3, 4, 1]  # suffix [3, 4, 1, 2] recurs at 2; three tokens follow it
    # none is followed by 8: the earliest (the most follow), its copy going on over the draft
    assert propose_ngram(seq, 8, 4, 1) == [3, 4, 1, 2, 3, 4, 1, 2]
    assert propose_ngram([7, 1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]  # period 2 repeats on
    assert propose_ngram([9, 1, 2, 7, 1, 2, 8, 1, 2], 1, 2, 1) == [8]  # the most recent occurrence
    assert propose_ngram([5, 6, 7, 8], 3, 4, 1) == []  # nothing recurs
    assert propose_ngram([5, 6, 7, 5], 2, 4, 2) == []  # only a 1-token suffix recurs, below lookup_min
    assert propose_ngram([5, 6, 7, 5], 2, 4, 1) == [6, 7]
    assert propose_ngram([5, 6, 7, 5], 4, 4, 1) == [6, 7, 5, 6]


def test_ngram_proposer_against_its_definition():
    """Random short sequences over small vocabularies against a brute-force reading of the rule:
    for n from max down to min, every earlier window equal to the last n tokens; the most recent
    one that k tokens follow, else the earliest, copied k tokens on as an overlapping copy."""
    import random

    def brute(ids, k, hi, lo):
        for n in range(min(hi, len(ids) - 1), lo - 1, -1):
            starts = [i for i in range(len(ids) - n) if ids[i : i + n] == ids[-n:]]
            if starts:
                full = [i for i in starts if i + n + k <= len(ids)]
                s = (full[-1] if full else starts[0]) + n
                out = list(ids)
                for i in range(k):  # an overlapping copy: it reads what it has written
                    out.append(out[s + i])
                return out[len(ids):]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(1, 30))]
        hi = rng.randint(1, 6)
        lo, k = rng.randint(1, hi), rng.randint(1, 5)
        assert propose_ngram(ids, k, hi, lo) == brute(ids, k, hi, lo), (ids, k, hi, lo)


@pytest.mark.parametrize("value, param", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 9}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_min"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "speculative_config.draft_model"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
    ("{not json", "speculative_config"),
    ([1, 2], "speculative_config"),
])
def test_config_errors_name_the_field(value, param):
    with pytest.raises(InvalidRequestError) as err:
        EngineConfig(speculative_config=value)
    assert err.value.param == param


def test_config_from_json_and_cli():
    import argparse

    from qsaserve.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'])
    cfg = engine_config_from_args(args).speculative_config
    assert cfg == SpeculativeConfig("ngram", 3, 4, 2)
    assert parse_speculative_config(cfg.to_dict()) == cfg
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_max == 4


def test_mtp_on_a_model_without_an_mtp_head_is_refused(hf_llama):
    with pytest.raises(InvalidRequestError) as err:
        engine(hf_llama[1], {"method": "mtp", "num_speculative_tokens": 2})
    assert err.value.param == "speculative_config.method" and "MTP" in str(err.value)


def test_metrics_report_the_spec_counters(hf_llama):
    """The /metrics collector's spec families carry the engine's counters."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from qsaserve.engine.async_engine import EngineSnapshot, _spec_counters
    from qsaserve.server.metrics import _EngineCollector

    llm = engine(hf_llama[1], {"method": "ngram", "num_speculative_tokens": 3, "disable_when_slower": True})
    generate(llm, repetitive_prompts(), SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    st = llm.engine.spec.stats

    class Stub:
        snapshot = EngineSnapshot(**_spec_counters(llm.engine.spec))

        @staticmethod
        def is_healthy():
            return True

    registry = CollectorRegistry()
    registry.register(_EngineCollector(Stub(), "m"))
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert samples[("qsaserve:spec_decode_num_draft_tokens_total", None)] == st.drafted > 0
    assert samples[("qsaserve:spec_decode_num_accepted_tokens_total", None)] == st.accepted > 0
    assert samples[("qsaserve:spec_decode_num_drafts_total", None)] == st.verifies
    assert samples[("qsaserve:spec_decode_mean_acceptance_length", None)] == pytest.approx(st.acceptance_length)
    for pos in range(3):
        assert samples[("qsaserve:spec_decode_num_accepted_tokens_per_pos_total", str(pos))] == st.accepted_per_position[pos]
    assert samples[("qsaserve:spec_decode_drafting_steps_total", None)] == st.drafting_steps > 0
    assert samples[("qsaserve:spec_decode_fallback_steps_total", None)] == st.fallback_steps
    assert samples[("qsaserve:spec_decode_retired_sequences_total", None)] == st.retired


def plant_reference_drafts(eng, reference: dict, rng) -> None:
    """Every drafting sequence carries min(3, room) drafts: the reference continuation up to a
    random position, wrong tokens after it (so some are accepted and some rejected)."""
    def planted(seq, *running):
        room = max(0, min(3, NEW - seq.num_output_tokens - 1))
        good = reference[tuple(seq.token_ids[: seq.num_prompt_tokens])][seq.num_output_tokens:][:room]
        cut = rng.randint(0, len(good))
        seq.draft_token_ids = good[:cut] + [(t + 1) % 100 for t in good[cut:]]

    eng.spec.propose = planted


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen4exp-tiny"])
def test_planted_drafts_equal_plain_decoding_on_gpu(model):
    """On a GPU (float32, CUDA graphs for the plain decode steps): drafts correct up to a random
    position, planted from the run without drafts, give its tokens; the plain decode steps between
them still replay their graphs."""
    import random

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none on this machine)")
    kw = dict(model=model, load_format="dummy", device="cuda", dtype="float32", max_model_len=256,
              kv_cache_memory=64 << 20, ple_placement="gpu", max_num_seqs=8)
    ps = [p[:40] for p in repetitive_prompts()]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    from qsaserve.engine.llm_engine import LLMEngine

    def run(spec):
        eng = LLMEngine(EngineConfig(speculative_config=spec, **kw), progress=False)
        for i, p in enumerate(ps):
            eng.add_request(str(i), {"prompt_token_ids": p}, params)
        return eng

    def drain(eng):
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step(outputs="finished"):
                done[o.request_id] = o.outputs[0].token_ids
        return [done[str(i)] for i in range(len(ps))]

    plain = run(None)
    want = drain(plain)
    eng = run({"method": "ngram", "num_speculative_tokens": 3})
    plant_reference_drafts(eng, {tuple(p): w for p, w in zip(ps, want)}, random.Random(0))
    assert drain(eng) == want
    st = eng.spec.stats
    assert 0 < st.accepted < st.drafted
    assert sum(eng.executor.runner.graphs.replays.values()) > 0
    eng.shutdown()
    plain.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen4exp-tiny"])
def test_verify_steps_replay_graphs_and_equal_plain_decoding_on_gpu(model):
    """On a GPU (float32): every sequence carries exactly k = 3 drafts while its budget allows,
    correct up to a random position (planted from the run without drafts), so the verify steps
    replay their verify graphs (Qwen4Exp: its decode rows, the per-position states into the
    snapshot rows and the rejected ones restored from them); the tokens are those of the run
    without drafts, and a prompt's tail chunk of 4 tokens never replays a verify graph."""
    import random

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none on this machine)")
    from qsaserve.engine.llm_engine import LLMEngine

    kw = dict(model=model, load_format="dummy", device="cuda", dtype="float32", max_model_len=256,
              kv_cache_memory=64 << 20, ple_placement="gpu", max_num_seqs=8, max_num_batched_tokens=64)
    ps = [p[:40] for p in repetitive_prompts()] + [list(range(3, 3 + 68))]  # 68 = 64 + a 4-token tail chunk
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

    def drain(eng):
        for i, p in enumerate(ps):
            eng.add_request(str(i), {"prompt_token_ids": p}, params)
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step(outputs="finished"):
                done[o.request_id] = o.outputs[0].token_ids
        return [done[str(i)] for i in range(len(ps))]

    plain = LLMEngine(EngineConfig(**kw), progress=False)
    want = drain(plain)
    plain.shutdown()
    eng = LLMEngine(EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "disable_when_slower": False}, **kw), progress=False)
    graphs = eng.executor.runner.graphs
    assert graphs is not None and 4 in graphs.verify_sizes
    tails, replay = [], graphs.replay

    def watched(batch, key, feed=None):
        if batch.verify_rows == 0 and key[1] > 1:
            tails.append(batch)
        return replay(batch, key, feed)

    graphs.replay = watched
    plant_reference_drafts(eng, {tuple(p): w for p, w in zip(ps, want)}, random.Random(0))
    assert drain(eng) == want
    st = eng.spec.stats
    assert 0 < st.accepted < st.drafted
    assert sum(graphs.verify_replays.values()) > 0 and not tails
    eng.shutdown()


def test_block_manager_rollback_frees_the_blocks_past_the_next_token():
    from qsaserve.engine.block_manager import BlockManager

    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
    seq = Sequence(0, "0", 0, list(range(10, 19)), SamplingParams(), None)  # 9 tokens, 8 computed
    assert bm.allocate(seq, 8)
    seq.num_computed_tokens = 8
    assert bm.allocate(seq, 1 + 7)  # a verify chunk: the last token and 7 drafts, positions 8..15
    assert len(seq.block_table) == 4
    free_before, table = bm.num_free_blocks, list(seq.block_table)
    seq.num_computed_tokens = 16
    bm.rollback(seq, 9)  # no draft accepted: the next token (the target's) goes to position 9, block 2
    assert seq.num_computed_tokens == 9 and seq.block_table == table[:3]
    assert bm.num_free_blocks == free_before + 1
    assert bm.tables.array[seq.table_row, :4].tolist() == table[:3] + [0]
    bm.free_seq(seq)
    assert bm.num_free_blocks == bm.num_blocks
