"""Runs the selected stages: each configuration (baseline, candidates, then the FP64 oracle) is
built, measured by every stage that needs it, and shut down before the next starts (a process
holds one tensor-parallel world at a time); the comparisons run on the records afterwards.

A configuration is the common engine arguments plus its own overrides (EngineConfig fields), so
any engine feature a candidate needs (a KV dtype, a parallel layout, a PLE placement, another
checkpoint, speculative decoding) is just more KEY=VALUE.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field

from qsaserve.qualify import acceptance, capacity, health, oracle, provenance, tasks, teacher_forced, token_gate
from qsaserve.qualify.inputs import Corpus, build_corpus, codec_for, gate_prompts
from qsaserve.qualify.logits import record_logprobs, scored_positions
from qsaserve.qualify.rules import NOT_RUN, Rules, result

logger = logging.getLogger("qsaserve")

# Random weights are drawn on the device in the model dtype (models' init_dummy_weights): a float64
# CPU copy of a load_format=dummy model is another model, so there is nothing to compare against.
ORACLE_DUMMY = ("random weights (load_format=dummy) are drawn on the device in the model dtype: a float64 copy would be "
                "another model; qualify a saved checkpoint for the oracle")
STAGES = ("teacher_forced", "token_gate", "oracle", "tasks", "health", "capacity", "provenance")


@dataclass
class Settings:
    """How much each stage measures (the CLI's flags; tests shrink them)."""

    num_tokens: int = 4096  # stage 1
    window: int = 512
    gate_tokens: int = 32  # stage 2
    gate_long_tokens: int = 2048
    oracle_seeds: tuple[int, ...] = (0, 1, 2, 3)  # stage 3
    oracle_tokens: int = 256
    arithmetic_items: int = 100  # stage 4
    long_items: int = 2
    task_files: list[str] = field(default_factory=list)
    lmeval_tasks: list[str] = field(default_factory=list)
    task_temperature: float = 0.0
    seed: int = 0
    prefill_tokens: int = 1024  # stage 6
    decode_batch: int = 8
    decode_tokens: int = 32
    strict_provenance: bool = False


@dataclass
class Configuration:
    name: str
    role: str  # baseline | candidate | oracle
    overrides: dict


@dataclass
class Inputs:
    codec: object
    corpus: Corpus
    tf_windows: list[list[int]]
    oracle_windows: list[list[int]]
    gate: list
    items: list
    skipped_tasks: list[str]


def _build_inputs(llm, dataset, s: Settings, stages) -> Inputs:
    engine = llm.engine
    codec = codec_for(engine)
    corpus = build_corpus(codec, dataset)
    window = min(s.window, engine.max_model_len)
    tf = corpus.windows(window, s.num_tokens) if "teacher_forced" in stages else []
    length = min(s.oracle_tokens, engine.max_model_len)
    orc = [corpus.sample(seed, length) for seed in s.oracle_seeds] if "oracle" in stages else []
    gate = gate_prompts(codec, corpus, engine.max_model_len, s.gate_tokens, s.gate_long_tokens) if "token_gate" in stages else []
    items, skipped = [], []
    if "tasks" in stages:
        items, skipped = tasks.generate_tasks(codec, engine.max_model_len, arithmetic_items=s.arithmetic_items,
                                              long_items=s.long_items, seed=s.seed)
        for path in s.task_files:
            items += tasks.load_jsonl(path, codec)
        if s.lmeval_tasks:
            from qsaserve.qualify.lmeval import lmeval_items

            more, why = lmeval_items(s.lmeval_tasks, codec)
            items += more
            skipped += why
        limit = engine.max_model_len
        too_long = [it for it in items if len(it.ids) + it.max_tokens > limit]
        if too_long:
            skipped.append(f"{len(too_long)} items longer than max_model_len {limit} with their output")
            items = [it for it in items if it not in too_long]
    return Inputs(codec, corpus, tf, orc, gate, items, skipped)


def run(common: dict, configs: list[Configuration], dataset, stages: list[str], scratch: str, *,
        settings: Settings | None = None, rules: Rules | None = None) -> dict:
    """Every configuration's records and every candidate's stage results (the report's body)."""
    from qsaserve.entrypoints.llm import LLM

    s, rules = settings or Settings(), rules or Rules()
    unknown = [x for x in stages if x not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    os.makedirs(scratch, exist_ok=True)
    inputs: Inputs | None = None
    oracle_skipped = None
    records: dict[str, dict] = {}
    timings: dict[str, float] = {}
    try:
        for cfg in configs:
            if cfg.role == "oracle" and "oracle" not in stages:
                continue
            t0 = time.perf_counter()
            overrides = dict(cfg.overrides)
            if cfg.role == "oracle" and "max_model_len" not in overrides and inputs is not None:
                # float64 pages are large: the oracle only needs room for its own samples
                overrides["max_model_len"] = max(len(w) for w in inputs.oracle_windows) + 1
            llm = LLM(progress=False, **{**common, **overrides})
            try:
                if inputs is None:
                    if "oracle" in stages and llm.engine.checkpoint.format == "dummy":
                        stages = [x for x in stages if x != "oracle"]
                        oracle_skipped = ORACLE_DUMMY
                    inputs = _build_inputs(llm, dataset, s, stages)
                records[cfg.name] = _collect(llm, cfg, inputs, stages, scratch, s)
            finally:
                llm.engine.shutdown()
            timings[cfg.name] = round(time.perf_counter() - t0, 1)
            logger.info("qualify: %s measured in %.1f s", cfg.name, timings[cfg.name])
        t0 = time.perf_counter()
        results = _compare(configs, records, inputs, stages, rules, s)
        if oracle_skipped:
            for st in results["candidates"].values():
                st["oracle"] = result(NOT_RUN, [oracle_skipped])
        timings["compare"] = round(time.perf_counter() - t0, 1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"inputs": _describe_inputs(inputs, stages), "records": records, "results": results, "timings_s": timings}


def describe_engine(llm) -> dict:
    """What a report records about one engine: model, dtypes, KV layout, parallel layout."""
    engine = llm.engine
    ex, c = engine.executor, engine.config
    quant = ex.kv_quant
    return {"model": engine.checkpoint.path, "model_identity": engine.checkpoint.identity,
            "model_dtype": str(ex.dtype).removeprefix("torch."), "device": str(ex.device),
            "kv_cache_dtype": quant.name, "kv_dtype_reason": quant.reason, "kv_bytes_per_token": ex.kv_spec.bytes_per_token,
            "tensor_parallel_size": c.tensor_parallel_size, "decode_context_parallel_size": c.decode_context_parallel_size,
            "max_model_len": engine.max_model_len, "prefix_caching": engine.block_manager.enable_prefix_caching,
            "model_format": engine.checkpoint.format,
            "speculative_config": c.speculative_config.to_dict() if c.speculative_config is not None else None}


def _collect(llm, cfg: Configuration, inp: Inputs, stages, scratch: str, s: Settings) -> dict:
    rec: dict = {"role": cfg.role, "engine_args": cfg.overrides, **describe_engine(llm)}
    timing = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        timing[name] = round(time.perf_counter() - t0, 1)
        return out

    if cfg.role == "oracle":
        rec["oracle_logprobs"] = timed("oracle", lambda: record_logprobs(llm, inp.oracle_windows,
                                                                         os.path.join(scratch, f"{cfg.name}.oracle.f32")))
        rec["timings_s"] = timing
        return rec
    if "provenance" in stages:
        rec["provenance"] = timed("provenance", lambda: provenance.collect(llm))
    if "teacher_forced" in stages:
        rec["tf_logprobs"] = timed("teacher_forced", lambda: record_logprobs(
            llm, inp.tf_windows, os.path.join(scratch, f"{cfg.name}.tf.f32")))
    if "oracle" in stages:
        rec["oracle_logprobs"] = timed("oracle", lambda: record_logprobs(
            llm, inp.oracle_windows, os.path.join(scratch, f"{cfg.name}.oracle.f32")))
    if "token_gate" in stages:
        rec["token_gate"] = timed("token_gate", lambda: token_gate.collect(llm, inp.gate, s.gate_tokens))
    if "tasks" in stages:
        before = acceptance.snapshot(llm)
        rec["tasks"] = timed("tasks", lambda: tasks.collect(llm, inp.items, inp.codec, temperature=s.task_temperature,
                                                            seed=s.seed))
        rec["tasks_acceptance"] = acceptance.delta(before, acceptance.snapshot(llm))
    if "health" in stages:
        rec["health"] = timed("health", lambda: health.collect(llm, inp.corpus))
    if "capacity" in stages:
        rec["capacity"] = timed("capacity", lambda: capacity.collect(
            llm, inp.corpus, prefill_tokens=s.prefill_tokens, decode_batch=s.decode_batch, decode_tokens=s.decode_tokens))
    rec["timings_s"] = timing
    return rec


def _scans(rec: dict) -> dict:
    return {what: rec[key].summary() for what, key in (("teacher_forced", "tf_logprobs"), ("oracle", "oracle_logprobs"))
            if key in rec}


def _compare(configs, records, inp: Inputs, stages, rules: Rules, s: Settings) -> dict:
    base_cfg = next(c for c in configs if c.role == "baseline")
    base = records[base_cfg.name]
    orc = next((records[c.name] for c in configs if c.role == "oracle" and c.name in records), None)
    oracle_positions = [len(w) - 1 for w in inp.oracle_windows]
    out = {"health": {name: health.judge(rec.get("health", {}), _scans(rec))
                      for name, rec in records.items() if rec["role"] != "oracle" and "health" in stages}}
    if orc is not None:
        out["oracle_distances"] = {name: oracle.distance(orc["oracle_logprobs"], rec["oracle_logprobs"], oracle_positions)
                                   for name, rec in records.items() if rec["role"] != "oracle"}
        out["oracle_health"] = health.judge({}, _scans(orc))
    out["candidates"] = {}
    for cfg in configs:
        if cfg.role != "candidate":
            continue
        cand = records[cfg.name]
        st: dict[str, dict] = {}
        if "teacher_forced" in stages:
            m = teacher_forced.compare_records(base["tf_logprobs"], cand["tf_logprobs"])
            st["teacher_forced"] = {**teacher_forced.judge(m, rules), "metrics": m}
        if "token_gate" in stages:
            rows = token_gate.compare(base["token_gate"], cand["token_gate"])
            st["token_gate"] = {**token_gate.judge(rows, base["token_gate"], cand["token_gate"], rules), "prompts": rows}
        if "oracle" in stages:
            d = out["oracle_distances"]
            st["oracle"] = {**oracle.judge(d[base_cfg.name], d[cfg.name], rules),
                            "baseline": d[base_cfg.name], "candidate": d[cfg.name]}
            if out["oracle_health"]["status"] != "PASS":
                st["oracle"] = result("INCONCLUSIVE", ["the oracle itself has non-finite logits: "
                                                       + "; ".join(out["oracle_health"]["reasons"])])
        if "tasks" in stages:
            if inp.items:
                m = tasks.compare(base["tasks"], cand["tasks"], rules)
                st["tasks"] = {**tasks.judge(m, rules), "metrics": m, "skipped": inp.skipped_tasks}
                if base.get("tasks_acceptance") or cand.get("tasks_acceptance"):
                    st["tasks"]["speculation"] = "; ".join(
                        acceptance.line(side, r["speculative_config"], r.get("tasks_acceptance"))
                        for side, r in (("baseline", base), ("candidate", cand)))
            else:
                st["tasks"] = result(NOT_RUN, ["no task items fit this model"], skipped=inp.skipped_tasks)
        if "health" in stages:
            st["health"] = out["health"][cfg.name]
        if "capacity" in stages:
            st["capacity"] = {**capacity.judge(base["capacity"], cand["capacity"], rules),
                              "baseline": base["capacity"], "candidate": cand["capacity"]}
        if "provenance" in stages:
            st["provenance"] = provenance.judge(base["provenance"], cfg.name, cand["provenance"], s.strict_provenance)
        for name in STAGES:
            st.setdefault(name, result(NOT_RUN, ["not selected"]))
        out["candidates"][cfg.name] = st
    return out


def _describe_inputs(inp: Inputs | None, stages) -> dict:
    if inp is None:
        return {}
    return {
        "text": inp.corpus.description,
        "teacher_forced": {"windows": len(inp.tf_windows), "positions": scored_positions(inp.tf_windows)},
        "oracle": {"samples": len(inp.oracle_windows), "positions": scored_positions(inp.oracle_windows)},
        "token_gate": {p.name: len(p.ids) for p in inp.gate},
        "tasks": {"items": {t: sum(it.task == t for it in inp.items) for t in dict.fromkeys(it.task for it in inp.items)},
                  "prompt_tokens": {t: max(len(it.ids) for it in inp.items if it.task == t)
                                    for t in dict.fromkeys(it.task for it in inp.items)},
                  "skipped": inp.skipped_tasks},
    }
