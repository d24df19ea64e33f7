"""Speculative decoding's verify step against the plain decode step, in one engine and one run:
B requests of C context tokens each (random ids, dummy weights), then per mode a few timed engine
steps: "plain" (no drafts: the decode step, CUDA graphs when on, captured for batch B alone) and
"verify k" for k = 1, 2, 3
(every sequence carries exactly k drafts: its n-gram drafts, topped up with random tokens). A
step's time is the engine step's wall time (it reads the tokens back, so it includes the device).

tok/s per mode: plain B / t_plain; verify at the measured acceptance length L (random weights:
~1) B * L / t_verify, and at L = 2.98 (the published MTP3 figure for Qwen3.8-Flash-Next), the
figure random weights cannot measure. --force-accept makes every verify accept all its drafts
(the target is told its drafts were its own tokens: outputs are meaningless, times are those of
the all-accepted path, no rollback). --method mtp (a preset with the head, e.g.
qwen4exp-small-mtp): the drafts are the MTP head's, run after each step (engine/mtp_drafter.py;
its drafting replays its own graphs where the step is uniform, engine/mtp_graphs.py), k of them.
Its "plain" row is an engine of the same model with speculation off (same prompts, same graphs),
so the head's cost counts against speculation; "head_only" is the speculating engine's step with
no drafts (the head's catch-up row alone).

"auto" (--auto-steps N): the speculating engine as a user runs it, with the automatic fallback
(disable_when_slower) on, its real acceptance (random weights: drafts nearly always rejected, the
worst case), k = 3: output tok/s over N steps against plain (after --auto-warm-up untimed steps,
default 8, in which the policy times both kinds), the steps it drafted in and fell back in, and
the sequences it retired before and during them (a bucket settled against drafting retires its
sequences after about 100 decisions: --auto-warm-up 120 measures that steady state). --profile-steps N: N more steps per mode under torch.profiler (device ms, launches, the
top kernels per step). Prints one JSON line per row, then the document.

    PYTHONPATH=src python benchmarks/bench_spec_decode.py --model qwen4exp-small --batches 1,8,64 \
        --context 8192 [--force-accept] [--repeat-unit 64] [--method mtp] [--auto-steps 48] \
        [--profile-steps 4] [--out f.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from qsaserve import SamplingParams
from qsaserve.bench.common import emit_report, provenance
from qsaserve.config import EngineConfig
from qsaserve.engine.draft_policy import RETIRE_AFTER, DraftPolicy
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.engine.profiling import summarize_events

PUBLISHED_ACCEPTANCE_LENGTH = 2.98
KS = (1, 2, 3)


def max_new_tokens(steps: int) -> int:
    """Every request's output budget: the modes' steps (two warm-up each) at up to k + 1 tokens a
    step, plus room for the decode steps that sequences prefilled early take while the others'
    prompts are still being computed, so no request finishes (and the batch shrinks) before the
    last timed step."""
    return (steps + 2) * sum(k + 1 for k in (0, *KS)) + 2 * (max(KS) + 1) + PREFILL_ROOM


PREFILL_ROOM = 256


def budget(steps: int, extra_steps: int) -> int:
    """max_new_tokens plus `extra_steps` more steps of up to k + 1 tokens (auto and profiled steps)."""
    return max_new_tokens(steps) + extra_steps * (max(KS) + 1)


def build(model: str, batch: int, context: int, steps: int, force_accept: bool, enforce_eager: bool,
          method: str | None = "ngram", extra_steps: int = 0) -> LLMEngine:
    """method None: speculation off (the plain baseline of an MTP run)."""
    spec = None if method is None else {"method": method, "num_speculative_tokens": max(KS), "disable_when_slower": False}
    config = EngineConfig(model=model, load_format="dummy", max_num_seqs=batch, max_model_len=context + budget(steps, extra_steps) + 1,
                          enforce_eager=enforce_eager, ple_placement="gpu", cuda_graph_sizes=str(batch),
                          speculative_config=spec)
    engine = LLMEngine(config, progress=False)
    if force_accept and method is not None:
        spec, launch = engine.spec, engine.spec.verify_launch
        # the real verification's work, then every draft accepted (the head, fed the step's
        # tokens on the device, sees the same tokens the host does)
        spec.verify_launch = lambda logits, plan, generator: launch(logits, plan, generator).accepting_all()
    return engine


def timed_steps(engine: LLMEngine, k: int, steps: int, rng: random.Random) -> list[float]:
    if engine.spec is None:
        return _steps(engine, steps)
    spec, vocab = engine.spec, engine.vocab_size
    propose = type(spec).propose
    if spec.model_drafts:  # the head drafts min(k, room) after each step
        room = type(spec).room
        spec.room = lambda seq, running: min(k, room(spec, seq, running))
        return _steps(engine, steps)

    def exactly_k(seq, *running):
        propose(spec, seq)
        seq.draft_token_ids = (seq.draft_token_ids + [rng.randrange(vocab) for _ in range(k)])[:k]

    spec.propose = exactly_k if k else (lambda seq, *running: setattr(seq, "draft_token_ids", []))
    for seq in engine.scheduler.running:
        spec.propose(seq)
    return _steps(engine, steps)


def _steps(engine: LLMEngine, steps: int, warm_up: int = 2) -> list[float]:
    times = []
    for i in range(steps + warm_up):  # warm-up steps (a verify step's first shapes build kernels)
        if engine.config.torch_device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step(outputs="finished")
        if i >= warm_up:
            times.append(time.perf_counter() - t)
    return times


def profiled(engine: LLMEngine, steps: int) -> dict:
    """`steps` more steps (as the mode's) under torch.profiler: per step device ms, launches,
    idle device time, the top kernels."""
    cuda = engine.config.torch_device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        _steps(engine, steps, warm_up=0)
    got = summarize_events(prof.events(), steps, top=12)
    return {key: got[key] for key in ("device_ms", "kernel_launches_per_step", "device_span_ms", "device_idle_ms",
                                      "top_kernels", "top_host_ops")}


def auto_steps(engine: LLMEngine, steps: int, rng: random.Random, warm_up: int = 0) -> dict:
    """`steps` steps with the automatic fallback on and the real acceptance, k = max(KS) (n-gram:
    a sequence's lookup topped up with random ids to what the policy allows), after `warm_up`
    untimed ones (the policy's first decisions time both kinds): output tok/s and the policy's
    decisions in the timed steps."""
    spec, vocab, k = engine.spec, engine.vocab_size, max(KS)
    spec.verify_launch = type(spec).verify_launch.__get__(spec)  # the real verify, not the forced acceptance
    spec.room = type(spec).room.__get__(spec)
    spec.policy = DraftPolicy(on_decision=spec._count_decision, retire_after=RETIRE_AFTER)  # the engine's
    if not spec.model_drafts:
        propose = type(spec).propose

        def topped_up(seq, num_running=1):
            propose(spec, seq, num_running)
            allowed = spec.room(seq, num_running)
            seq.draft_token_ids = (seq.draft_token_ids + [rng.randrange(vocab) for _ in range(k)])[:allowed]

        spec.propose = topped_up
    _steps(engine, warm_up, warm_up=0)
    seqs = list(engine.scheduler.running)
    before_tokens = sum(s.num_output_tokens for s in seqs)
    before = spec.stats.as_dict()
    times = _steps(engine, steps, warm_up=0)
    after = spec.stats.as_dict()
    tokens = sum(s.num_output_tokens for s in seqs) - before_tokens
    return {"steps": steps, "warm_up_steps": warm_up, "tokens": tokens, "tok_s": round(tokens / sum(times), 1),
            "drafting_steps": after["drafting_steps"] - before["drafting_steps"],
            "fallback_steps": after["fallback_steps"] - before["fallback_steps"],
            "accepted": after["accepted"] - before["accepted"], "drafted": after["drafted"] - before["drafted"],
            "retired_before": before["retired"], "retired": after["retired"] - before["retired"]}


def prompt(rng: random.Random, vocab: int, context: int, repeat_unit: int) -> list[int]:
    """Random ids, or (repeat_unit > 0) one random unit of that many ids repeated: text n-gram
    drafts can copy from."""
    if not repeat_unit:
        return [rng.randrange(vocab) for _ in range(context)]
    unit = [rng.randrange(vocab) for _ in range(repeat_unit)]
    return (unit * (context // repeat_unit + 1))[:context]


def start(engine: LLMEngine, batch: int, context: int, steps: int, repeat_unit: int, extra_steps: int) -> list:
    """Adds the batch's requests and runs their prompts: -> the running sequences."""
    rng = random.Random(batch)
    for i in range(batch):
        ids = prompt(rng, engine.vocab_size, context, repeat_unit)
        engine.add_request(str(i), {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, ignore_eos=True,
                                          max_tokens=budget(steps, extra_steps)))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step(outputs="finished")
    return list(engine.scheduler.running)


def run(model: str, batch: int, context: int, steps: int, force_accept: bool, enforce_eager: bool,
        repeat_unit: int = 0, method: str = "ngram", auto: int = 0, profile: int = 0,
        auto_warm_up: int = 0) -> list[dict]:
    extra = auto + auto_warm_up + 4 * profile
    rows, plain_ms = [], None

    def plain_row(engine: LLMEngine, ms: float, mode: str) -> dict:
        return {"model": model, "method": method, "batch": batch, "context": context, "repeat_unit": repeat_unit,
                "mode": mode, "k": 0, "step_ms": round(ms, 3), "force_accept": force_accept,
                "tok_s": round(batch / ms * 1e3, 1)}

    def emit(row: dict, engine: LLMEngine) -> None:
        if profile:
            row["profile"] = profiled(engine, profile)
        print(json.dumps(row), flush=True)
        rows.append(row)

    if method == "mtp":  # the baseline without speculation: no head runs at all
        engine = build(model, batch, context, steps, False, enforce_eager, None, extra)
        start(engine, batch, context, steps, repeat_unit, extra)
        plain_ms = statistics.median(_steps(engine, steps)) * 1e3
        emit(plain_row(engine, plain_ms, "plain"), engine)
        engine.shutdown()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    engine = build(model, batch, context, steps, force_accept, enforce_eager, method, extra)
    rng = random.Random(batch)
    seqs = start(engine, batch, context, steps, repeat_unit, extra)
    for k in (0, *KS):
        before = engine.spec.stats.as_dict()
        ms = statistics.median(timed_steps(engine, k, steps, rng)) * 1e3
        after = engine.spec.stats.as_dict()
        verifies = after["verifies"] - before["verifies"]
        accepted = after["accepted"] - before["accepted"]
        length = 1 + accepted / verifies if verifies else 1.0
        if force_accept and k:  # every verify emitted its k drafts and the target's token
            length = k + 1.0
        if k == 0:
            if plain_ms is None:
                plain_ms = ms
                row = plain_row(engine, ms, "plain")
            else:  # the head's catch-up row alone, no drafts (its own graph, mtp_graphs.py)
                row = dict(plain_row(engine, ms, "head_only"), step_over_plain=round(ms / plain_ms, 3))
        else:
            row = {"model": model, "method": method, "batch": batch, "context": context, "repeat_unit": repeat_unit,
                   "mode": f"verify{k}", "k": k, "step_ms": round(ms, 3), "force_accept": force_accept,
                   "step_over_plain": round(ms / plain_ms, 3), "measured_acceptance_length": round(length, 3),
                   "tok_s_measured": round(batch * length / ms * 1e3, 1),
                   "tok_s_at_2_98": round(batch * min(PUBLISHED_ACCEPTANCE_LENGTH, k + 1) / ms * 1e3, 1),
                   "speedup_at_2_98": round(min(PUBLISHED_ACCEPTANCE_LENGTH, k + 1) * plain_ms / ms, 3),
                   "drafted": after["drafted"] - before["drafted"], "accepted": accepted}
        emit(row, engine)
    if auto:
        got = auto_steps(engine, auto, rng, auto_warm_up)
        row = {"model": model, "method": method, "batch": batch, "context": context, "repeat_unit": repeat_unit,
               "mode": "auto", "k": max(KS), **got, "over_plain": round(got["tok_s"] / (batch / plain_ms * 1e3), 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if any(s.is_finished for s in seqs):
        raise RuntimeError("a request finished before the last timed step: max_new_tokens is too small")
    config = engine.config
    engine.shutdown()
    return rows, config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen4exp-small")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--force-accept", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--repeat-unit", type=int, default=0, help="prompts repeat a random unit of this many ids")
    ap.add_argument("--method", default="ngram", choices=("ngram", "mtp"))
    ap.add_argument("--auto-steps", type=int, default=0, help="steps of the 'auto' row (fallback on, real acceptance)")
    ap.add_argument("--auto-warm-up", type=int, default=8, help="untimed steps before the 'auto' row's")
    ap.add_argument("--profile-steps", type=int, default=0, help="profiled steps per mode")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    rows, config = [], None
    for b in (int(x) for x in args.batches.split(",")):
        got, config = run(args.model, b, args.context, args.steps, args.force_accept, args.enforce_eager,
                          args.repeat_unit, args.method, args.auto_steps, args.profile_steps, args.auto_warm_up)
        rows += got
    doc = {"bench": "spec_decode", **provenance(config), "rows": rows, "wall_s": round(time.perf_counter() - start, 1)}
    emit_report(doc, args.out)


if __name__ == "__main__":
    main()
