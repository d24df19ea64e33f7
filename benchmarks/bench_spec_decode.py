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
its drafting replays its own graphs where the step is uniform, engine/mtp_graphs.py), k of them; its "plain" rows
carry no drafts but still run the head's catch-up row. Prints one JSON line per row, then the document.

    PYTHONPATH=src python benchmarks/bench_spec_decode.py --model qwen4exp-small --batches 1,8,64 \
        --context 8192 [--force-accept] [--repeat-unit 64] [--method mtp] [--out f.json]
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
from qsaserve.engine.llm_engine import LLMEngine

PUBLISHED_ACCEPTANCE_LENGTH = 2.98
KS = (1, 2, 3)


def max_new_tokens(steps: int) -> int:
    """Every request's output budget: the modes' steps (two warm-up each) at up to k + 1 tokens a
    step, plus room for the decode steps that sequences prefilled early take while the others'
    prompts are still being computed, so no request finishes (and the batch shrinks) before the
    last timed step."""
    return (steps + 2) * sum(k + 1 for k in (0, *KS)) + 2 * (max(KS) + 1) + PREFILL_ROOM


PREFILL_ROOM = 256


def build(model: str, batch: int, context: int, steps: int, force_accept: bool, enforce_eager: bool,
          method: str = "ngram") -> LLMEngine:
    config = EngineConfig(model=model, load_format="dummy", max_num_seqs=batch, max_model_len=context + max_new_tokens(steps) + 1,
                          enforce_eager=enforce_eager, ple_placement="gpu", cuda_graph_sizes=str(batch),
                          speculative_config={"method": method, "num_speculative_tokens": max(KS),
                                              "disable_when_slower": False})
    engine = LLMEngine(config, progress=False)
    if force_accept:
        spec, verify = engine.spec, engine.spec.verify

        def accept_all(logits, plan, generator):
            got = verify(logits, plan, generator)  # the real work; the stats count what it really accepted
            return {sid: (list(plan.sample_seqs[i].draft_token_ids) + toks[-1:], ok)
                    for (i, _), (sid, (toks, ok)) in zip(plan.verify, got.items())}

        spec.verify = accept_all
    return engine


def timed_steps(engine: LLMEngine, k: int, steps: int, rng: random.Random) -> list[float]:
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


def _steps(engine: LLMEngine, steps: int) -> list[float]:
    times = []
    for i in range(steps + 2):  # two warm-up steps (a verify step's first shapes build kernels)
        if engine.config.torch_device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step(outputs="finished")
        if i >= 2:
            times.append(time.perf_counter() - t)
    return times


def prompt(rng: random.Random, vocab: int, context: int, repeat_unit: int) -> list[int]:
    """Random ids, or (repeat_unit > 0) one random unit of that many ids repeated: text n-gram
    drafts can copy from."""
    if not repeat_unit:
        return [rng.randrange(vocab) for _ in range(context)]
    unit = [rng.randrange(vocab) for _ in range(repeat_unit)]
    return (unit * (context // repeat_unit + 1))[:context]


def run(model: str, batch: int, context: int, steps: int, force_accept: bool, enforce_eager: bool,
        repeat_unit: int = 0, method: str = "ngram") -> list[dict]:
    engine = build(model, batch, context, steps, force_accept, enforce_eager, method)
    rng = random.Random(batch)
    for i in range(batch):
        ids = prompt(rng, engine.vocab_size, context, repeat_unit)
        engine.add_request(str(i), {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_new_tokens(steps)))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step(outputs="finished")
    seqs = list(engine.scheduler.running)
    rows, plain_ms = [], None
    for k in (0, *KS):
        before = engine.spec.stats.as_dict()
        ms = statistics.median(timed_steps(engine, k, steps, rng)) * 1e3
        after = engine.spec.stats.as_dict()
        verifies = after["verifies"] - before["verifies"]
        accepted = after["accepted"] - before["accepted"]
        length = 1 + accepted / verifies if verifies else 1.0
        if force_accept and k:  # every verify emitted its k drafts and the target's token
            length = k + 1.0
        row = {"model": model, "method": method, "batch": batch, "context": context, "repeat_unit": repeat_unit,
               "mode": "plain" if k == 0 else f"verify{k}",
               "k": k, "step_ms": round(ms, 3), "force_accept": force_accept}
        if k == 0:
            plain_ms = ms
            row["tok_s"] = round(batch / ms * 1e3, 1)
        else:
            row.update(step_over_plain=round(ms / plain_ms, 3), measured_acceptance_length=round(length, 3),
                       tok_s_measured=round(batch * length / ms * 1e3, 1),
                       tok_s_at_2_98=round(batch * min(PUBLISHED_ACCEPTANCE_LENGTH, k + 1) / ms * 1e3, 1),
                       speedup_at_2_98=round(min(PUBLISHED_ACCEPTANCE_LENGTH, k + 1) * plain_ms / ms, 3),
                       drafted=after["drafted"] - before["drafted"], accepted=accepted)
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    rows, config = [], None
    for b in (int(x) for x in args.batches.split(",")):
        got, config = run(args.model, b, args.context, args.steps, args.force_accept, args.enforce_eager,
                          args.repeat_unit, args.method)
        rows += got
    doc = {"bench": "spec_decode", **provenance(config), "rows": rows, "wall_s": round(time.perf_counter() - start, 1)}
    emit_report(doc, args.out)


if __name__ == "__main__":
    main()
