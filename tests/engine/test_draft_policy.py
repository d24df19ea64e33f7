"""The automatic per-step fallback of speculative decoding (engine/draft_policy.py,
speculative_config.disable_when_slower): with an injected clock whose verify steps cost more than
their accepted drafts save, drafting turns off; once verifying pays it turns back on. Greedy
tokens stay those of the engine without drafts throughout. The n-gram Llama of
test_spec_decode.py."""
import pytest

from qsaserve import SamplingParams
from qsaserve.engine.draft_policy import DraftPolicy, batch_bucket
from qsaserve.errors import InvalidRequestError
from qsaserve.speculative_config import parse_speculative_config

from test_spec_decode import engine, generate, hf_llama, repetitive_prompts  # noqa: F401 (fixture)


class StepClock:
    """Seconds that advance only inside a timed step: `plain` or `verify` per step."""

    def __init__(self, plain: float, verify: float):
        self.now, self.plain, self.verify = 0.0, plain, verify

    def __call__(self) -> float:
        return self.now


def drive(policy: DraftPolicy, clock: StepClock, steps: int, batch: int, accepted: int,
          drafting: bool = True) -> list[bool]:
    """Steps as the engine runs them: each drafts iff the previous one's decision said so (drafts
    are made after a step for the next), every verifying sequence accepting `accepted` drafts."""
    decisions = []
    for _ in range(steps):
        policy.step_started(batch, True, drafting)
        clock.now += clock.verify if drafting else clock.plain
        if drafting:
            for _ in range(batch):
                policy.verified(accepted)
        drafting = policy.allows()
        assert policy.allows() == drafting  # one decision per step
        decisions.append(drafting)
        policy.step_finished()
    return decisions


def test_drafting_follows_the_measured_costs_and_probes_the_other_kind():
    clock = StepClock(plain=1.0, verify=5.0)  # 1 + 2 accepted = 3 tokens per verify, for 5x the time
    policy = DraftPolicy(clock, probe_interval=4, max_probe_interval=4)  # probes at a fixed interval
    d = drive(policy, clock, 12, batch=8, accepted=2)
    # A decision is made during a step, before that step's time is in: step 1's (no time yet)
    # drafts; steps 2 and 3 decide before a plain step was timed; then plain, with a verify probe
    # every 4th decision.
    assert d == [True, False, False, False, False, False, True, False, False, False, True, False]
    assert policy.pays(8) is False and policy.gain == 3.0
    clock.verify = 2.0  # verifying pays now: the next probe's time replaces the stale one
    d = drive(policy, clock, 12, batch=8, accepted=2, drafting=d[-1])
    # The probe (decision 3) is timed in the step after it, whose decision still sees the stale
    # verify time; from then on drafting, with a plain probe every 4th decision.
    assert d == [False, False, True, False, True, True, False, True, True, True, False, True]
    assert policy.pays(8) is True


def test_probes_that_confirm_the_preference_come_ever_less_often():
    """Verifying never pays: each probe (a verify step) confirms plain decoding, so the gaps
    between probes double up to max_probe_interval; once verifying pays, the probe that sees it
    turns drafting on and the interval is back to probe_interval."""
    clock = StepClock(plain=1.0, verify=50.0)
    policy = DraftPolicy(clock, probe_interval=4, max_probe_interval=32)
    d = drive(policy, clock, 200, batch=8, accepted=0)
    probes = [i for i, drafts in enumerate(d) if drafts][1:]  # after the first (untimed) verify
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [8, 16, 32] and set(gaps[3:]) == {32}
    assert policy.buckets[8].interval == 32
    clock.verify = 0.5  # now a verify step costs half a plain one
    d = drive(policy, clock, 40, batch=8, accepted=0, drafting=False)
    first = d.index(True)
    assert first < 32 and d[first + 2] and d[first + 3]  # the probe's time turns drafting on
    plain = [i for i in range(first + 2, len(d)) if not d[i]]  # plain probes now, every 4, then 8
    assert plain[0] - first == 4 and plain[1] - plain[0] == 8


def test_buckets_are_timed_apart():
    clock = StepClock(plain=1.0, verify=1.5)
    policy = DraftPolicy(clock, probe_interval=8)
    drive(policy, clock, 6, batch=2, accepted=1)  # pays at 2: 2 tokens for 1.5x
    assert policy.pays(batch_bucket(2)) is True and policy.pays(batch_bucket(64)) is None
    policy.step_started(64, True, False)
    assert policy.allows()  # a bucket never timed drafts first
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_steps_with_prompt_chunks_are_not_timed():
    clock = StepClock(plain=1.0, verify=9.0)
    policy = DraftPolicy(clock)
    policy.step_started(3, False, True)
    clock.now += 100.0
    policy.step_finished()
    assert policy.buckets.get(4) is None and policy.gain is None


def test_policy_arguments_and_the_config_field():
    with pytest.raises(ValueError, match="probe_interval"):
        DraftPolicy(probe_interval=1)
    with pytest.raises(ValueError, match="smoothing"):
        DraftPolicy(smoothing=0)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}).disable_when_slower is True
    with pytest.raises(InvalidRequestError) as err:
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "disable_when_slower": "no"})
    assert err.value.param == "speculative_config.disable_when_slower"


def test_engine_falls_back_when_verifying_does_not_pay_and_returns_when_it_does(hf_llama):
    _, path = hf_llama
    ps = repetitive_prompts()
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = generate(engine(path), ps, params)
    # One sequence at a time: every decision in one batch-size bucket.
    llm = engine(path, {"method": "ngram", "num_speculative_tokens": 3, "disable_when_slower": True}, max_num_seqs=1)
    spec = llm.engine.spec
    clock = StepClock(plain=1.0, verify=50.0)  # no acceptance length makes this pay
    spec.policy.clock, spec.policy.probe_interval, spec.policy.max_probe_interval = clock, 4, 8
    started = spec.policy.step_started

    def timed(num_seqs, all_decode, drafted):
        started(num_seqs, all_decode, drafted)
        clock.now += clock.verify if drafted else clock.plain

    spec.policy.step_started = timed
    assert generate(llm, ps, params) == want
    st = spec.stats
    assert st.fallback_steps > 2 * st.drafting_steps > 0 and st.verifies > 0
    assert st.as_dict()["fallback_steps"] == st.fallback_steps
    before = (st.verifies, st.drafting_steps, st.fallback_steps)
    clock.verify = 1.0  # verifying costs a plain step: it pays whenever a draft is accepted
    assert generate(llm, ps, params) == want
    verifies, drafting, fallback = (st.verifies - before[0], st.drafting_steps - before[1],
                                    st.fallback_steps - before[2])
    assert drafting > 2 * fallback and verifies > before[0]


def test_decisions_use_the_bucket_of_the_step_they_are_made_in(hf_llama):
    """The decision made in a step is for the batch size that step is timed under (its scheduled
    sequences), also in the steps where a sequence finishes (before the others propose), a request
    waits for a slot, or it is admitted."""
    _, path = hf_llama
    ps = repetitive_prompts()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 30, 20, 40)]
    want = [o.outputs[0].token_ids for o in engine(path, max_num_seqs=3).generate(
        [{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]
    llm = engine(path, {"method": "ngram", "num_speculative_tokens": 3, "disable_when_slower": True}, max_num_seqs=3)
    policy = llm.engine.spec.policy
    clock = StepClock(plain=1.0, verify=1.2)
    policy.clock = clock
    timed_under, decided_for = {}, {}
    started, decide = policy.step_started, policy._decide

    def step_started(num_seqs, all_decode, drafted):
        started(num_seqs, all_decode, drafted)
        timed_under[policy._step] = batch_bucket(num_seqs)
        clock.now += clock.verify if drafted else clock.plain

    def spy(cost):
        decided_for[policy._step] = next(b for b, c in policy.buckets.items() if c is cost)
        return decide(cost)

    policy.step_started, policy._decide = step_started, spy
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params,
                                                          use_tqdm=False)]
    assert got == want
    assert len(decided_for) > 20 and {4, 2, 1} <= set(decided_for.values())
    assert {step: timed_under[step] for step in decided_for} == decided_for


def test_each_bucket_keeps_its_own_gain():
    """Acceptance differs by batch size (here: 3 drafts accepted per sequence at batch 2, none at
    batch 8): each bucket compares its times with its own gain, not the last verify's."""
    clock = StepClock(plain=1.0, verify=1.5)
    policy = DraftPolicy(clock, probe_interval=100)
    drive(policy, clock, 4, batch=8, accepted=0)  # 1 token per verify for 1.5x: does not pay at 8
    assert policy.pays(8) is False
    drive(policy, clock, 4, batch=2, accepted=3)  # 4 tokens for 1.5x: pays at 2
    assert policy.pays(2) is True and policy.pays(8) is False
    assert policy.buckets[8].gain == 1.0 and policy.buckets[2].gain == 4.0
    policy.step_started(8, True, False)
    assert policy.allows() is False  # batch 8 decides on its own gain


def test_under_async_scheduling_plain_and_verify_times_are_of_synchronous_steps(hf_llama):
    """Async scheduling: a step with a sequence that may draft runs synchronously whether or not
    the policy lets it draft (SpecDecoder.needs_host_tokens does not ask the policy: drafts are
    made from the step's tokens on the host), so the plain steps the fallback chooses run in the
    mode of the verify steps it compares them with, and both kinds are timed as such. A step that
    overlaps (no sequence may draft: here a min_tokens request left alone) never reaches
    step_finished and is not timed: no bucket mixes the two modes."""
    _, path = hf_llama
    ps = repetitive_prompts()[:3]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    params = [greedy, greedy, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, min_tokens=1)]

    def run(llm, on_step=None):
        eng, done = llm.engine, {}
        for i, (p, sp) in enumerate(zip(ps, params)):
            eng.add_request(str(i), {"prompt_token_ids": p}, sp)
        while eng.has_unfinished_requests():
            for o in eng.step(outputs="finished"):
                done[o.request_id] = o.outputs[0].token_ids
            if on_step is not None:
                on_step(eng)
        return [done[str(i)] for i in range(len(ps))]

    want = run(engine(path, async_scheduling=True))
    llm = engine(path, {"method": "ngram", "num_speculative_tokens": 3, "disable_when_slower": True},
                 async_scheduling=True)
    policy = llm.engine.spec.policy
    clock = StepClock(plain=1.0, verify=50.0)  # verifying never pays: plain steps once timed
    policy.clock, policy.probe_interval = clock, 4
    started, finished = policy.step_started, policy.step_finished
    timed, kinds, overlapped = set(), {}, set()

    def step_started(num_seqs, all_decode, drafted):
        started(num_seqs, all_decode, drafted)
        kinds[policy._step] = drafted
        clock.now += clock.verify if drafted else clock.plain

    def step_finished():
        if policy._timing is not None:
            timed.add(policy._step)
        finished()

    def on_step(eng):  # the step just launched left its tokens on the device: it overlaps the next
        if eng._in_flight is not None:
            overlapped.add(policy._step)

    policy.step_started, policy.step_finished = step_started, step_finished
    assert run(llm, on_step) == want
    assert overlapped and not overlapped & timed
    assert any(kinds[s] for s in timed) and sum(not kinds[s] for s in timed) > 5
    assert llm.engine.spec.stats.fallback_steps > 0


def test_retires_once_probes_in_a_row_confirmed_plain_steps():
    """retires(): in a step that decided plain (never in a probe), once the bucket's last
    retire_after probes in a row confirmed plain steps; never while verifying pays, nor without
    retire_after, nor when a bucket settled for drafting turns to plain steps between probes (a
    slow verify step): that turn starts the count of confirming probes anew."""
    def run(clock, policy, steps, retired, drafting=True):
        for i in range(steps):
            policy.step_started(8, True, drafting)
            clock.now += clock.verify if drafting else clock.plain
            drafting = policy.allows()
            if policy.retires():
                assert not drafting and policy.buckets[8].plain_confirmed >= policy.retire_after
                retired.append(i)
            policy.step_finished()
        return drafting

    def fresh(verify, retire_after):
        clock = StepClock(plain=1.0, verify=verify)
        return clock, DraftPolicy(clock, probe_interval=4, max_probe_interval=32, retire_after=retire_after)

    clock, policy = fresh(50.0, 2)
    retired = []
    run(clock, policy, 80, retired)
    # probes after 4 and 8 decisions confirmed plain steps: every plain decision from then on
    # retires, except the probes (every 16 decisions, then 32) and the decisions that see their times
    assert retired and retired[0] > 4 + 8 and len(retired) >= 80 - retired[0] - 2 * 4
    for verify, retire_after in ((50.0, None), (0.5, 2)):
        clock, policy = fresh(verify, retire_after)
        retired = []
        run(clock, policy, 80, retired)
        assert retired == []
    # settled for drafting (the interval at its maximum), then verify steps slow down: plain steps
    # are preferred at once, but nothing retires before two probes confirmed them
    clock, policy = fresh(0.5, 2)
    drafting = run(clock, policy, 120, retired := [])
    assert policy.buckets[8].interval == 32 and drafting
    clock.verify = 50.0
    run(clock, policy, 20, retired, drafting)
    assert retired == [] and policy.buckets[8].preferred is False
    with pytest.raises(ValueError, match="retire_after"):
        DraftPolicy(retire_after=0)


def test_engine_retires_sequences_whose_drafting_never_pays(hf_llama):
    """Verifying never pays: once the bucket settles, its sequences are retired (stats.retired,
    the metric), draft no more, and their steps overlap under async scheduling (no sequence needs
    its tokens on the host any longer); the tokens are those of the engine without drafts."""
    _, path = hf_llama
    ps = repetitive_prompts()[:2]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = generate(engine(path, async_scheduling=True), ps, params)
    llm = engine(path, {"method": "ngram", "num_speculative_tokens": 3, "disable_when_slower": True},
                 async_scheduling=True)
    spec, eng = llm.engine.spec, llm.engine
    policy = spec.policy
    clock = StepClock(plain=1.0, verify=50.0)
    policy.clock, policy.probe_interval, policy.max_probe_interval, policy.retire_after = clock, 4, 16, 1
    started = policy.step_started

    def timed(num_seqs, all_decode, drafted):
        started(num_seqs, all_decode, drafted)
        clock.now += clock.verify if drafted else clock.plain

    policy.step_started = timed
    done, after = {}, []  # after retirement: (verifies so far, whether the step overlaps)
    for i, p in enumerate(ps):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    while eng.has_unfinished_requests():
        for o in eng.step(outputs="finished"):
            done[o.request_id] = o.outputs[0].token_ids
        if spec.stats.retired == len(ps) and eng.has_unfinished_requests():
            after.append((spec.stats.verifies, eng._in_flight is not None))
    assert [done[str(i)] for i in range(len(ps))] == want
    assert spec.stats.retired == len(ps) and spec.stats.as_dict()["retired"] == len(ps)
    assert len(after) > 10 and len({v for v, _ in after}) == 1  # no verify after the retirement
    assert sum(overlaps for _, overlaps in after) > len(after) // 2
