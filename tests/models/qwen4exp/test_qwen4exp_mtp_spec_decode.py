"""Speculative decoding with Qwen4Exp's own MTP head (speculative_config.method "mtp",
engine/mtp_drafter.py): greedy tokens equal transformers' qwen4_exp and the engine without drafts
for k = 1, 2, 3, and the target's states after each request equal a plain run's, with the random
head of the tiny checkpoint (its drafts are mostly rejected) and with its drafts replaced by the
reference continuation after the head ran (every draft accepted); through batched chunked
prefill and preemption. float32 CPU; the fixture of test_qwen4exp_spec_decode.py."""
import dataclasses
import types

import pytest
import torch

from qsaserve import LLM, InvalidRequestError, SamplingParams
from qsaserve.engine.batch import PLACEHOLDER_TOKEN
from qsaserve.engine.mtp_drafter import DeferredDrafts
from qsaserve.engine.rejection_sampler import VerifiedDrafts
from qsaserve.engine.sampler import DeferredTokens

from qwen4exp_testing import build_random_model, make_config, plant_reference_drafts, prompt_tokens, save_with_mtp
from test_qwen4exp_spec_decode import (NEW, PARAMS, assert_preempted_and_freed, checkpoint_runs, generate, prompts,
                                       states)
from test_qwen4exp_spec_decode import engine as ngram_or_mtp_engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = build_random_model(make_config(budget=12, ple_layer_ids=(1, 4)), seed=7)
    path = save_with_mtp(model, str(tmp_path_factory.mktemp("mtp_qwen4exp")), seed=11)
    return checkpoint_runs(model, path)  # the plain engine is the same whatever the drafter


def engine(path, k=None, **kw):
    return ngram_or_mtp_engine(path, k, method="mtp", **kw)


def accept_all(llm, reference):
    calls = []
    plant_reference_drafts(llm, reference, calls)
    return calls


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("mode", ["head", "accept"])
def test_mtp_drafts_equal_transformers_and_leave_the_states_of_a_plain_run(checkpoint, k, mode):
    model, path, ps, want, plain_states = checkpoint
    llm = engine(path, k)
    calls = accept_all(llm, {tuple(q): w for q, w in zip(ps, want)}) if mode == "accept" else None
    for p, w, plain in zip(ps, want, plain_states):  # one at a time, each in state slot 1
        assert generate(llm, [p]) == [w]
        for a, b in zip(plain, states(llm), strict=True):
            torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-5)
    st = llm.engine.spec.stats
    assert st.verifies > 0 and st.drafted > 0
    if mode == "accept":
        assert st.accepted == st.drafted and sum(calls) > 0  # the head's own drafts were made
    else:
        assert st.accepted < st.drafted  # a random head: mostly rejected


@pytest.mark.parametrize("k", [1, 3])
def test_batched_chunked_and_preempted(checkpoint, k):
    """Three requests at once with 20-token steps (prefill chunks beside verify rows), one with a
    penalty (never drafts: a plain row in the same batch); with async scheduling (the penalty
    request's steps alone overlap); then a KV pool small enough to preempt."""
    model, path, ps, want, _ = checkpoint
    params = [PARAMS, PARAMS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, repetition_penalty=1.0001)]
    runner = engine(path, k).engine.executor.runner
    # 18 blocks of 8 tokens (the head's pages: one more QSA layer's share of each): one request of
    # max_model_len fits, the three (25 blocks) do not.
    spec = runner.kv_spec
    per_block = spec.bytes_per_block + dataclasses.replace(spec, num_layers=1, kv_dtype=None).bytes_per_block
    small = 18 * per_block + 9 * k * runner.model.state_snapshot_bytes()
    for kw in ({}, dict(async_scheduling=True), dict(kv_cache_memory=small, max_model_len=128)):
        base = generate(engine(path, **kw), ps, params)
        llm = engine(path, k, **kw)
        accept_all(llm, {tuple(q): w for q, w in zip(ps, base)})
        assert generate(llm, ps, params) == base
        assert base[:2] == want[:2]
        assert llm.engine.spec.stats.accepted > 0
        assert_preempted_and_freed(llm, "kv_cache_memory" in kw)


def test_prefix_cache_hits_and_fp8_pages(checkpoint):
    """A prompt served twice (the second hits the prefix cache: the head's state is not among the
    snapshots, its pages are those of the blocks) and FP8 K/V pages: tokens of the plain engine."""
    model, path, ps, want, _ = checkpoint
    for kw in (dict(enable_prefix_caching=True), dict(kv_cache_dtype="fp8_e4m3")):
        base = generate(engine(path, **kw), [ps[1]])
        llm = engine(path, 2, **kw)
        assert generate(llm, [ps[1]]) == base
        again = llm.generate([{"prompt_token_ids": ps[1]}], PARAMS, use_tqdm=False)[0]
        assert [again.outputs[0].token_ids] == base
        if "kv_cache_dtype" not in kw:  # FP8 pages (unit scales) round K/V: equal to FP8 without drafts only
            assert base == [want[1]] and again.num_cached_tokens > 0


def draft_log(llm):
    """Every step's drafts of the head from now on (a list the engine's executor appends to)."""
    log, defer = [], llm.engine.spec.defer_drafts

    def logged(chunks, drafts):
        log.append(drafts.result())
        defer(chunks, drafts)

    llm.engine.spec.defer_drafts = logged
    return log


def test_prefix_cache_hit_on_the_blocks_of_a_request_that_never_drafted(checkpoint):
    """A request with a penalty (it never drafts) computes a prompt's blocks; a greedy request
    of the same prompt hits them. With prefix caching the head runs on every sequence's rows, so
    the hit blocks hold its pages: its drafts equal those of the request run alone without the
    prefix cache, and so do its tokens (steps of 64 tokens: each prompt is one chunk, so both runs
    draft first after the prompt's last row)."""
    model, path, ps, want, _ = checkpoint
    penalty = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, repetition_penalty=1.0001)

    fresh = engine(path, 2, max_num_batched_tokens=64)
    alone = draft_log(fresh)
    assert generate(fresh, [ps[1]]) == [want[1]]
    cached = engine(path, 2, enable_prefix_caching=True, max_num_batched_tokens=64)
    generate(cached, [ps[1]], penalty)
    assert cached.engine.spec.stats.drafted == 0
    after_hit = draft_log(cached)
    out = cached.generate([{"prompt_token_ids": ps[1]}], PARAMS, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0 and out.outputs[0].token_ids == want[1]
    assert [d for d in after_hit if any(d)] == [d for d in alone if any(d)]


def test_prefix_cache_hit_on_the_blocks_a_request_filled_in_its_last_step(checkpoint):
    """A request (a penalty: it never drafts) fills its last block in the step it finishes in:
    the head's catch-up rows of that step run before its blocks go to the prefix cache. A greedy
    request whose prompt is that request's text and a few more tokens hits every block (8-token
    snapshots); its drafts and tokens equal those of the same request in an engine without the
    prefix cache (the head computes every prompt row there). The head's pages of those blocks
    (K/V and index block keys) equal those of a run that went one token further (position 63 was
    not its last step's row)."""
    model, path, ps, _, _ = checkpoint
    kw = dict(enable_prefix_caching=True, max_num_batched_tokens=64, prefix_state_interval=8)

    def head_pages(llm, max_tokens):  # the first request's text and its head pages of blocks 0..7
        bm, tables = llm.engine.block_manager, []
        free_seq = bm.free_seq
        bm.free_seq = lambda seq, *a, **k: tables.append(list(seq.block_table)) or free_seq(seq, *a, **k)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, repetition_penalty=1.0001)
        text = ps[1] + generate(llm, [ps[1]], params)[0]
        bm.free_seq = free_seq
        cache, blocks = llm.engine.executor.runner.model.mtp.attention_layer.cache, tables[0][:8]
        return text, cache.kv[:, blocks].clone(), cache.block_keys[blocks].clone()

    # 61 prompt tokens + 4 sampled: the last step computes position 63, the end of block 7.
    cached = engine(path, 2, **kw)
    text, kv, keys = head_pages(cached, 4)
    assert len(text) == 65 and cached.engine.spec.stats.drafted == 0
    longer, want_kv, want_keys = head_pages(engine(path, 2, **kw), 5)
    assert longer[:65] == text
    torch.testing.assert_close(kv, want_kv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, want_keys, rtol=1e-5, atol=1e-5)
    prompt = text + prompt_tokens(9, seed=5)
    fresh = engine(path, 2, max_num_batched_tokens=64)
    alone = draft_log(fresh)
    want = generate(fresh, [prompt])
    after_hit = draft_log(cached)
    out = cached.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and [out.outputs[0].token_ids] == want
    assert [d for d in after_hit if any(d)] == [d for d in alone if any(d)]
    assert cached.engine.block_manager.num_free_blocks == cached.engine.block_manager.num_blocks


def test_host_tier_carries_the_heads_pages(checkpoint):
    """--kv-offload-gib with MTP: a prompt's cached blocks are evicted to the host tier by a
    longer request through a small GPU pool, and a greedy request of the prompt copies them back
    (into blocks the longer request's pages last held). The head's pages travel with the
    target's, so the drafts after the host hit equal those after a GPU hit in a pool that never
    evicted, and so do the tokens (steps of 64 tokens: the uncached suffix is one chunk in both)."""
    model, path, ps, want, _ = checkpoint
    penalty = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, repetition_penalty=1.0001)
    other = prompt_tokens(118, seed=3)
    runs = []
    for pool in ({}, dict(kv_cache_memory=420_000)):
        llm = engine(path, 2, enable_prefix_caching=True, max_num_batched_tokens=64, max_model_len=128,
                     kv_offload_gib=0.01, **pool)
        generate(llm, [ps[1]], penalty)
        generate(llm, [other], penalty)
        log = draft_log(llm)
        out = llm.generate([{"prompt_token_ids": ps[1]}], PARAMS, use_tqdm=False)[0]
        assert out.num_cached_tokens > 0 and out.outputs[0].token_ids == want[1]
        stats, ex = llm.engine.block_manager.host_tier.stats, llm.engine.executor
        assert stats.blocks_restored > 0 if pool else stats.hits == 0
        head = dataclasses.replace(ex.kv_spec, num_layers=1, kv_dtype=None).bytes_per_block  # one QSA layer's pages
        assert ex.host_kv_block_bytes == ex.kv_spec.bytes_per_block + head
        runs.append([d for d in log if any(d)])
    assert runs[0] and runs[1] == runs[0]


def test_mtp_on_a_checkpoint_without_the_head_is_refused(tmp_path):
    model = build_random_model(make_config(), seed=1)
    model.save_pretrained(str(tmp_path))
    with pytest.raises(InvalidRequestError) as err:
        engine(str(tmp_path), 2)
    assert err.value.param == "speculative_config.method" and "MTP" in str(err.value)


def test_draft_graph_inputs_give_the_uniform_drafts(checkpoint, monkeypatch):
    """The staged, bucket-padded inputs of the head's draft graphs (engine/mtp_graphs.py; run
    eagerly here, no CUDA on this machine) give the drafts the engine made for the same steps:
    verifies of 3 sequences in a bucket of 4, the padding sequence dead, drafts cut per sequence."""
    import qsaserve.engine.model_runner as runner_module
    from qsaserve.engine.mtp_drafter import apply_device_tokens, mtp_uniform_drafts, uniform_rows
    from qsaserve.engine.mtp_graphs import MtpDraftGraphs

    model, path, ps, want, _ = checkpoint
    llm = engine(path, 3)
    runner = llm.engine.executor.runner
    real, checked = runner_module.run_mtp_drafts, []

    def compare(m, batch, hidden, request, block_size, dcp, graphs=None, fed=None):
        out = real(m, batch, hidden, request, block_size, dcp, graphs, fed)
        n, b = uniform_rows(batch, request, dcp), len(batch.query_lens)
        if n and b == 3:
            g = MtpDraftGraphs(m, [4], [1, 2, 3, 4], 3, runner.kv_spec.blocks_for(runner.max_model_len + 4),
                               block_size, hidden.shape[1], hidden.dtype, hidden.device)
            assert g.fits(batch, request, n)
            g._stage(4, n, batch, request)
            if fed is not None:  # the step's tokens from the device (the head right after them)
                inp = g._inputs(4, n)
                apply_device_tokens(inp.next_ids, inp.slots, inp.last, n, *fed)
            g.hidden[: b * n].copy_(hidden[: b * n])
            # the padding sequence's rows: zeros (on CPU the reference KV write puts a dead row's K/V
            # in the null block's slot 0, which a draft row past its blocks reads; a GPU writes none)
            g.hidden[b * n :] = 0.0
            drafted = mtp_uniform_drafts(m, g.hidden[: 4 * n], g._inputs(4, n), block_size)[:b].tolist()
            made = out.result()
            assert [d[: len(o)] for d, o in zip(drafted, made)] == made
            checked.append(n)
        return out

    monkeypatch.setattr(runner_module, "run_mtp_drafts", compare)
    assert generate(llm, ps[:3]) == want[:3]
    assert len(checked) >= 3 and max(checked) > 1


@pytest.mark.gpu
def test_mtp_drafts_equal_plain_decoding_on_gpu():
    """On a GPU (float32, dummy weights with a random head; both engines replay their decode
    graphs, the MTP engine also its verify graphs and the head's drafting graphs, which read the
    replayed hidden rows): the tokens of the plain run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none on this machine)")
    kw = dict(load_format="dummy", device="cuda", dtype="float32", max_model_len=256, kv_cache_memory=64 << 20,
              ple_placement="gpu", max_num_seqs=8, progress=False)
    ps = prompts(3, [45, 61, 38])
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = generate(LLM("qwen4exp-tiny-mtp", **kw), ps, params)
    llm = LLM("qwen4exp-tiny-mtp", speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **kw)
    assert generate(llm, ps, params) == want
    assert llm.engine.spec.stats.drafted > 0
    assert sum(llm.engine.executor.runner.graphs.verify_replays.values()) > 0
    assert llm.engine.executor.runner.draft_graphs.replays > 0  # the head's drafting replayed too
    # Every other step without drafts (the fallback's plain steps): their catch-up graphs replay.
    llm = LLM("qwen4exp-tiny-mtp", speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **kw)
    spec, steps = llm.engine.spec, [0]
    room, end_step = spec.room, spec.end_step
    spec.room = lambda seq, running: room(seq, running) if steps[0] % 2 == 0 else 0
    spec.end_step = lambda: (steps.__setitem__(0, steps[0] + 1), end_step())[1]
    assert generate(llm, ps, params) == want
    assert llm.engine.executor.runner.draft_graphs.catch_up_replays > 0


def test_engine_drafts_are_the_reference_heads(checkpoint, monkeypatch):
    """Every draft the engine's head makes for one request equals the plain-torch head's
    (mtp_reference.py) over the same target hidden rows: catch-up rows chained over the steps
    (chunked prompt, verifies), then draft rows from the head's own output, up to the first draft
    position past the sequence's blocks (not stored there, so later drafts see less); in decode
    and verify steps the head runs right after the step, fed its tokens on the device."""
    import itertools

    import qsaserve.engine.model_runner as runner_module
    from qsaserve.models.qwen4exp.mtp_reference import mtp_draft_reference
    from qsaserve.ops.qsa_indexer import rope_inv_freq

    from qwen4exp_testing import random_mtp_tensors

    model, path, ps, want, _ = checkpoint
    llm = engine(path, 3)
    block = llm.engine.executor.block_size
    log, real, paths = [], runner_module.run_mtp_drafts, []

    def spy(m, batch, hidden, request, block_size, *rest):
        out = real(m, batch, hidden, request, block_size, *rest)
        made = out.result()
        fed = rest[2] if len(rest) > 2 else None
        paths.append(fed is not None)
        rows, next_ids = request.rows, request.next_ids
        if fed is not None:  # the head ran right after the step, fed its tokens on the device
            tokens, counts = fed[0].cpu().reshape(len(rows), -1), fed[1].cpu()
            rows = counts.tolist()
            next_ids = [tokens[i, :c].tolist() for i, c in enumerate(rows)]
        starts = list(itertools.accumulate(batch.query_lens[:-1], initial=0))
        for i, n in enumerate(rows):
            if n:
                a = starts[i]
                log.append((batch.positions[a], hidden[a:a + n].clone(), next_ids[i], made[i],
                            len(request.tables[i]) * block))
        return out

    monkeypatch.setattr(runner_module, "run_mtp_drafts", spy)
    assert generate(llm, [ps[0]]) == [want[0]]
    # the prompt's chunks: the head from host lists; decode and verify steps: right after them,
    # fed their tokens on the device
    assert not paths[0] and any(paths)
    cfg = model.config
    p = {k.removeprefix("mtp."): v for k, v in random_mtp_tensors(cfg, seed=11).items()}
    rot = int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    inv = rope_inv_freq(cfg.head_dim, rot / cfg.head_dim, cfg.rope_parameters["rope_theta"])
    embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    caches, checked = None, 0
    for start, hid, nxt, drafts, stored in log:
        n = len(nxt)
        logits, out, caches = mtp_draft_reference(hid, torch.tensor(nxt), torch.arange(start, start + n), p, embed,
                                                  lm_head, cfg, inv, caches)
        if not drafts:
            continue
        assert int(logits[-1].argmax()) == drafts[0]
        checked += 1
        h, c, pos = out[-1:], caches, start + n
        for prev, d in zip(drafts, drafts[1:]):
            if pos >= stored:
                break
            lg, h, c = mtp_draft_reference(h, torch.tensor([prev]), torch.tensor([pos]), p, embed, lm_head, cfg, inv, c)
            assert int(lg[-1].argmax()) == d
            checked += 1
            pos += 1
    assert checked > NEW // 2


def test_sampled_requests_with_mtp_drafts_repeat_themselves(checkpoint):
    """temperature > 0: the head's one-hot drafts go through rejection sampling; a seeded request
    gives the same tokens in two engines (the distribution itself: the rejection sampler's test)."""
    path, ps = checkpoint[1], checkpoint[2]
    params = SamplingParams(temperature=0.8, max_tokens=NEW, ignore_eos=True, seed=5)
    runs = []
    for _ in range(2):
        llm = engine(path, 3)
        runs.append(generate(llm, ps[:2], params))
        assert llm.engine.spec.stats.drafted > 0
    assert runs[0] == runs[1] and all(len(t) == NEW for t in runs[0])


def test_steps_without_drafts_run_the_catch_up_rows_uniformly(checkpoint, monkeypatch):
    """Every other step no sequence may draft (as when the automatic fallback keeps a step
    plain): the head's catch-up rows of those steps run on the uniform path (the one its CUDA
    graphs replay; steps 0: no draft rows, no logits) and leave what the row-list path leaves:
    the same drafts in the drafting steps, the tokens of transformers."""
    import qsaserve.engine.mtp_drafter as drafter
    import qsaserve.engine.spec_decode as spec_decode

    model, path, ps, want, _ = checkpoint
    real_uniform, real_rows = drafter.mtp_uniform_drafts, drafter.uniform_rows
    logs, catch_up_only = [], []

    def counted(m, hidden, inp, block_size):
        if inp.steps == 0:
            catch_up_only.append(inp.seq_lens.shape[0])
        return real_uniform(m, hidden, inp, block_size)

    monkeypatch.setattr(drafter, "mtp_uniform_drafts", counted)
    for uniform in (True, False):
        monkeypatch.setattr(drafter, "uniform_rows", real_rows if uniform else (lambda *a: 0))
        monkeypatch.setattr(spec_decode, "uniform_step_rows", drafter.uniform_step_rows if uniform else (lambda *a: 0))
        llm = engine(path, 3)
        spec, steps = llm.engine.spec, [0]
        room, end_step = spec.room, spec.end_step
        spec.room = lambda seq, running: room(seq, running) if steps[0] % 2 == 0 else 0
        spec.end_step = lambda: (steps.__setitem__(0, steps[0] + 1), end_step())[1]
        logs.append(draft_log(llm))
        assert generate(llm, ps[:2]) == want[:2]
        if uniform:
            assert catch_up_only  # the catch-up-alone steps ran uniformly
            seen = len(catch_up_only)
        else:
            assert len(catch_up_only) == seen  # the row lists never took the uniform path
    drafting = [[d for d in log if any(d)] for log in logs]  # the head right after a step also runs in its last
    assert drafting[0] and drafting[0] == drafting[1]


def test_drafts_are_read_after_the_step_that_verifies_them_is_launched(checkpoint, monkeypatch):
    """The head's drafts stay on the device (DeferredDrafts): the next step is built with
    placeholders in its draft rows and launched with the drafts fed from the device, and only then
    are they read back (into the sequence and the verify plan); tokens equal transformers'."""
    model, path, ps, want, _ = checkpoint
    llm = engine(path, 3)
    ex, events = llm.engine.executor, []
    draft, execute, result = ex.mtp_draft, ex.execute, DeferredDrafts.result

    def logged_draft(request, fed=None):
        events.append("draft")
        return draft(request, fed)

    def logged_execute(batch, feed=None):
        drafted_rows = feed.dst if feed is not None else []
        assert all(batch.input_ids[r] == PLACEHOLDER_TOKEN for r in drafted_rows)
        events.append(("execute", len(drafted_rows)))
        return execute(batch, feed) if feed is not None else execute(batch)

    monkeypatch.setattr(ex, "mtp_draft", logged_draft)
    monkeypatch.setattr(ex, "execute", logged_execute)
    monkeypatch.setattr(DeferredDrafts, "result", lambda self: events.append("result") or result(self))
    for cls in (DeferredTokens, VerifiedDrafts):  # the step's own tokens read back
        monkeypatch.setattr(cls, "result", lambda self, read=cls.result: events.append("tokens") or read(self))
    assert generate(llm, [ps[0]]) == [want[0]]
    fed = [i for i, e in enumerate(events) if isinstance(e, tuple) and e[1]]
    assert fed and llm.engine.spec.stats.drafted > 0
    launches = [i for i, e in enumerate(events) if isinstance(e, tuple)]
    steps = [events[a + 1 : b] for a, b in zip(launches, launches[1:] + [len(events)])]
    for i in fed:  # the head ran in the step before; its drafts are read once this step is launched
        assert "draft" in steps[launches.index(i) - 1] and events[i + 1] == "result"
    # decode and verify steps: the head is launched before the step's own tokens are read
    early = [s for s in steps if "draft" in s and "tokens" in s and s.index("draft") < s.index("tokens")]
    assert len(early) >= len(fed) - 1


def test_retired_sequences_skip_the_heads_rows_and_keep_their_tokens(checkpoint):
    """The automatic fallback with verify steps that never pay (an injected clock): once the
    bucket settles its sequences are retired, and from then on the head runs no rows for them
    (neither right after a step nor after its tokens: its pages go stale, the sequences never
    draft again); the tokens are those of the engine without drafts."""
    _, path, ps, _, _ = checkpoint
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = generate(ngram_or_mtp_engine(path), ps[:2], params)
    llm = engine(path, 2, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "disable_when_slower": True})
    spec = llm.engine.spec
    policy, clock = spec.policy, types.SimpleNamespace(now=0.0, plain=1.0, verify=50.0)  # seconds a step
    policy.clock, policy.probe_interval, policy.max_probe_interval, policy.retire_after = (lambda: clock.now), 4, 16, 1
    started, right_after, request = policy.step_started, spec.head_right_after, spec.mtp_request
    head_rows = []  # per head call: (retired so far, rows it ran)

    def timed(num_seqs, all_decode, drafted):
        started(num_seqs, all_decode, drafted)
        clock.now += clock.verify if drafted else clock.plain

    def logged_right_after(chunks, *args):
        runs = right_after(chunks, *args)
        head_rows.append((spec.stats.retired, len(chunks) if runs else 0))
        return runs

    def logged_request(*args):
        req = request(*args)
        head_rows.append((spec.stats.retired, sum(req.rows) if req is not None else 0))
        return req

    policy.step_started, spec.head_right_after, spec.mtp_request = timed, logged_right_after, logged_request
    assert generate(llm, ps[:2], params) == want
    assert spec.stats.retired == 2 and spec.stats.verifies > 0
    after = [rows for retired, rows in head_rows if retired == 2]
    assert any(rows for retired, rows in head_rows if retired == 0)  # the head ran before
    assert len(after) > 10 and not any(after)
