"""`qsaserve bench latency`: steady-state decode speed by batch size, time to first token by
prompt length, and how close batch-1 decode comes to the memory-bandwidth roofline (every weight
once, and the active weights of a mixture-of-experts model). Profiled batch sizes also get the
step's kernel launches, device and host time, the time per layer by kind and the step of a
deeper model of the same layer kinds projected from it."""
from __future__ import annotations

import random
import time

from qsaserve.bench.common import (measure_bandwidth, median, provenance, random_prompt,
                                   release_memory)
from qsaserve.bench.step_profile import profile_decode_steps
from qsaserve.config import EngineConfig
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.errors import InvalidRequestError
from qsaserve.sampling_params import SamplingParams


def decode_run(engine: LLMEngine, batch: int, context: int, steps: int, warmup: int, rng: random.Random,
            profile_steps: int = 0) -> dict:
    """B requests prefilled, then `warmup` untimed and `steps` timed decode steps (each step ends
    with the sampled tokens on the host, so wall time is device time plus host overhead); then,
    with profile_steps, a breakdown of 3 x profile_steps more (bench.step_profile)."""
    # Room to the model length, not just the steps: with chunked prefill a prompt that finishes early
    # decodes while the others prefill, and must not run out of tokens before the timed steps end.
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - context, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": random_prompt(rng, context, engine.vocab_size)}, params)
    seqs = [engine.requests[rid].seqs[0] for rid in ids]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step(outputs="finished")
    for _ in range(warmup):
        engine.step(outputs="finished")
    # Counted over the timed steps only: with chunked prefill a sequence whose prompt finished early
    # has decoded a few tokens by the time the last one starts.
    before = sum(s.num_output_tokens for s in seqs)
    spec_before = engine.spec.stats.as_dict() if engine.spec is not None else None
    start = time.perf_counter()
    for _ in range(steps):
        engine.step(outputs="finished")
    elapsed = time.perf_counter() - start
    produced = sum(s.num_output_tokens for s in seqs) - before
    profile = profile_decode_steps(engine, profile_steps) if profile_steps else None
    for rid in ids:
        engine.abort_request(rid)
    # With speculative decoding a step emits one token per sequence or more (accepted drafts).
    if produced < batch * steps or (engine.spec is None and produced != batch * steps):
        raise RuntimeError(f"batch_sizes: batch {batch} did not decode every sequence each step "
                           f"({produced} tokens in {steps} steps)")
    row = {"batch_size": batch, "context": context, "steps": steps, "ms_per_step": round(elapsed / steps * 1e3, 3),
           "tok_s": round(produced / elapsed, 1)}
    if spec_before is not None:
        row["speculative"] = _spec_delta(spec_before, engine.spec.stats.as_dict())
    if profile:
        row.update(step_figures(profile))
        row["profile"] = profile
    return row


def step_figures(profile: dict) -> dict:
    """The profile's headline figures as fields of their own: kernel launches per step, device
    time per step (kernels, CUDA only) and the rest of the profiled step's wall time (host work
    and waits the device did not cover)."""
    out = {"kernel_launches_per_step": profile.get("kernel_launches_per_step")}
    if "device_ms" in profile:
        out["device_ms_per_step"] = profile["device_ms"]
        out["host_only_ms_per_step"] = round(max(profile["wall_ms"] - profile["device_ms"], 0.0), 3)
    return out


# The layers' attributed kernels must cover at least this share of the profiled step's device time
# for a device-basis projection: the profiler attributes a kernel to a layer's range through its
# launch, and Triton's driver-API launches were seen unattributed (a GDN layer "0.0016 ms" in a
# 2.07 ms step with the Triton GEMV, 2026-12-04), which would project a deeper model as nearly free.
MIN_LAYER_COVERAGE = 0.5


def project_layers(row: dict, num_layers: int, target_layers: int) -> dict | None:
    """The decode step of a model with target_layers layers in the same proportion of kinds,
    from a profiled row: the measured step (graphs as served) plus, per kind, the extra layers
    times that kind's time per layer (device time on CUDA, host time where there is no device
    profile). None without a per-layer profile. On CUDA, where the layers' kernels account for
    less than MIN_LAYER_COVERAGE of the step's device time, no figure: {"layers", "basis":
    "device", "invalid": why} (an eager step's host time per layer is its launch time, not a
    served layer's cost, so it is no fallback there)."""
    profile = row.get("profile", {})
    layers = profile.get("layers")
    if not layers:
        return None
    device_ms = profile.get("device_ms")
    basis = "device" if device_ms is not None else "host"
    if basis == "device":
        covered = sum(k["layers"] * k["device_ms_per_layer"] for k in layers.values())
        if covered < MIN_LAYER_COVERAGE * device_ms:
            return {"layers": target_layers, "basis": basis,
                    "invalid": f"the layers' attributed kernels cover {covered:.3f} of the step's {device_ms:.3f} "
                               f"device ms (< {MIN_LAYER_COVERAGE:.0%}): launches the profiler did not attribute"}
    extra, kinds = 0.0, {}
    for kind, k in layers.items():
        target = k["layers"] * target_layers / num_layers
        kinds[kind] = {"layers": target, "ms_per_layer": k[f"{basis}_ms_per_layer"]}
        extra += (target - k["layers"]) * k[f"{basis}_ms_per_layer"]
    ms = row["ms_per_step"] + extra
    return {"layers": target_layers, "basis": basis, "kinds": kinds, "ms_per_step": round(ms, 3),
            "tok_s": round(row["batch_size"] * 1e3 / ms, 1)}


def _spec_delta(before: dict, after: dict) -> dict:
    """Speculative decoding over the timed steps: drafted, accepted, acceptance length (mean and
    per position)."""
    verifies = after["verifies"] - before["verifies"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
    return {"drafted": after["drafted"] - before["drafted"], "accepted": accepted, "verifies": verifies,
            "acceptance_length": round(1 + accepted / verifies, 4) if verifies else None,
            "acceptance_rate_per_position": [round(a / verifies, 4) if verifies else None for a in per_pos],
            # the automatic fallback's decisions (engine/draft_policy.py)
            "drafting_steps": after["drafting_steps"] - before["drafting_steps"],
            "fallback_steps": after["fallback_steps"] - before["fallback_steps"],
            "retired": after["retired"] - before["retired"]}


def _ttft(engine: LLMEngine, length: int, trials: int, rng: random.Random) -> dict:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for trial in range(trials + 1):  # the first is warm-up
        rid = f"ttft-{length}-{trial}"
        start = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": random_prompt(rng, length, engine.vocab_size)}, params)
        while rid in engine.requests:
            engine.step(outputs="finished")
        if trial:
            times.append(time.perf_counter() - start)
    return {"prompt_len": length, "trials": trials, "ttft_ms": round(median(times) * 1e3, 3),
            "ttft_ms_min": round(min(times) * 1e3, 3)}


def run_latency(config: EngineConfig, batch_sizes: list[int], prompt_lens: list[int], decode_context: int = 128,
                decode_steps: int = 64, warmup_steps: int = 8, ttft_trials: int = 3, peer: str | None = None,
                seed: int = 0, profile_steps: int = 16, profile_batch_sizes: list[int] | None = None,
                project_to_layers: int = 48) -> dict:
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise InvalidRequestError("batch_sizes", f"must be integers >= 1, got {batch_sizes}")
    if max(batch_sizes) > config.max_num_seqs:
        raise InvalidRequestError("batch_sizes", f"{max(batch_sizes)} exceeds max_num_seqs ({config.max_num_seqs})")
    if not prompt_lens or any(n < 1 for n in prompt_lens):
        raise InvalidRequestError("prompt_lens", f"must be integers >= 1, got {prompt_lens}")
    for name, value in (("decode_steps", decode_steps), ("ttft_trials", ttft_trials), ("decode_context", decode_context)):
        if value < 1:
            raise InvalidRequestError(name, f"must be >= 1, got {value}")
    profile_batch_sizes = [b for b in batch_sizes if b == 1] if profile_batch_sizes is None else profile_batch_sizes
    if any(b not in batch_sizes for b in profile_batch_sizes):
        raise InvalidRequestError("profile_batch_sizes", f"must be among batch_sizes {batch_sizes}, got {profile_batch_sizes}")
    if project_to_layers < 1:
        raise InvalidRequestError("project_to_layers", f"must be >= 1, got {project_to_layers}")
    for name, value in (("warmup_steps", warmup_steps), ("profile_steps", profile_steps)):
        if value < 0:
            raise InvalidRequestError(name, f"must be >= 0, got {value}")
    device = config.torch_device
    report = {"bench": "latency", **provenance(config, with_transformers=peer == "hf")}
    rng = random.Random(seed)
    bandwidth = measure_bandwidth(device)  # before the engine takes its share of memory

    engine = LLMEngine(config, progress=False)
    try:
        max_len = engine.max_model_len
        context = min(decode_context, max_len - warmup_steps - decode_steps - 3 * profile_steps - 2)
        if context < 1:
            raise InvalidRequestError("max_model_len", f"{max_len} leaves no room for {decode_steps} decode steps")
        lens = sorted({min(n, max_len - 1) for n in prompt_lens})
        # Profiled batch sizes (default 1) also get a step breakdown (bench.step_profile): what
        # keeps them from the roofline, and the time per layer.
        decode = [decode_run(engine, b, context, decode_steps, warmup_steps, rng,
                          profile_steps if b in profile_batch_sizes else 0) for b in sorted(set(batch_sizes))]
        ttft = [_ttft(engine, n, ttft_trials, rng) for n in lens]
        weight_bytes = engine.executor.decode_weight_bytes()
        experts = engine.executor.expert_weight_bytes()
        state_bytes = engine.executor.state_bytes_per_sequence()
        memory_plan = engine.executor.memory_plan()
        kv_bytes = int(engine.executor.kv_spec.bytes_per_token * (context + warmup_steps + decode_steps / 2))
        cuda_graphs = engine.executor.cuda_graphs
        graphs_off_reason, side_tables = engine.executor.cuda_graphs_off_reason, engine.executor.side_table_memory()
        hf_config, vocab_size = engine.checkpoint.hf_config, engine.vocab_size
        num_layers = len(engine.executor.layer_kinds() or []) or None
    finally:
        engine.shutdown()
        del engine
        release_memory(device)

    report["params"] = {"batch_sizes": sorted(set(batch_sizes)), "prompt_lens": lens, "decode_context": context,
                        "decode_steps": decode_steps, "warmup_steps": warmup_steps, "ttft_trials": ttft_trials,
                        "seed": seed, "cuda_graphs": cuda_graphs, "profile_steps": profile_steps,
                        "cuda_graphs_off_reason": graphs_off_reason, "ple": side_tables,
                        "profile_batch_sizes": sorted(set(profile_batch_sizes)), "project_to_layers": project_to_layers}
    for row in decode:
        projected = project_layers(row, num_layers, project_to_layers) if num_layers else None
        if projected:
            row["projected"] = projected
    report["decode"] = decode
    report["memory_per_gpu"] = memory_plan  # bytes on rank 0: weights (FP8 part), PLE, KV (+ tokens), state, activations
    report["ttft"] = ttft
    step_bytes = weight_bytes + kv_bytes
    roofline_tok_s = bandwidth["used_gb_s"] * 1e9 / step_bytes
    b1 = next((d for d in decode if d["batch_size"] == 1), None)
    report["roofline"] = {
        "weight_bytes_per_step": weight_bytes, "kv_bytes_per_step_batch1": kv_bytes, "bandwidth": bandwidth,
        "roofline_tok_s_batch1": round(roofline_tok_s, 1),
        "fraction_batch1": round(b1["tok_s"] / roofline_tok_s, 4) if b1 else None,
        "active": active_roofline(weight_bytes, experts, state_bytes, kv_bytes, bandwidth["used_gb_s"], b1),
    }
    if peer == "hf":
        from qsaserve.bench.hf_peer import HfPeer

        hf = HfPeer(hf_config, device, config.torch_dtype)
        try:
            peer_decode = hf.decode_tok_s(1, context, decode_steps, lambda n: random_prompt(rng, n, vocab_size))
        finally:
            hf.close()
        report["peer"] = {"name": "hf", "method": "transformers generate, cache_implementation=static, greedy; "
                          "decode tok/s from the difference of two generate lengths", "decode_batch1": peer_decode}
        if b1:
            report["ratios"] = {"decode_batch1_tok_s_vs_hf": round(b1["tok_s"] / peer_decode["tok_s"], 3)}
    return report


def active_roofline(weight_bytes: int, experts: dict | None, state_bytes: int, kv_bytes: int, gb_s: float,
                    b1: dict | None) -> dict:
    """Batch-1 decode over what one token must read: the non-expert weights (shared experts
    included), its top-k routed experts (k / E of every layer's experts), the KV pages and its
    recurrent state (read and written back), over the bandwidth measured in the same run."""
    routed = experts["routed_bytes"] if experts else 0
    active_routed = routed * experts["top_k"] // experts["num_experts"] if experts else 0
    step = weight_bytes - routed + active_routed + kv_bytes + 2 * state_bytes
    tok_s = gb_s * 1e9 / step
    return {"non_expert_weight_bytes": weight_bytes - routed, "routed_expert_bytes_all": routed,
            "routed_expert_bytes_batch1": active_routed,
            "experts_per_token": [experts["top_k"], experts["num_experts"]] if experts else None,
            "kv_bytes_batch1": kv_bytes, "state_bytes_batch1": 2 * state_bytes, "bytes_per_step_batch1": step,
            "roofline_tok_s_batch1": round(tok_s, 1),
            "fraction_batch1": round(b1["tok_s"] / tok_s, 4) if b1 else None}
