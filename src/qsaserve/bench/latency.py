"""`qsaserve bench latency`: steady-state decode speed by batch size, time to first token by
prompt length, and how close batch-1 decode comes to the memory-bandwidth roofline."""
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


def _decode(engine: LLMEngine, batch: int, context: int, steps: int, warmup: int, rng: random.Random,
            profile_steps: int = 0) -> dict:
    """B requests prefilled, then `warmup` untimed and `steps` timed decode steps (each step ends
    with the sampled tokens on the host, so wall time is device time plus host overhead); then,
    with profile_steps, a breakdown of 2 x profile_steps more (bench.step_profile)."""
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
        row["profile"] = profile
    return row


def _spec_delta(before: dict, after: dict) -> dict:
    """Speculative decoding over the timed steps: drafted, accepted, acceptance length (mean and
    per position)."""
    verifies = after["verifies"] - before["verifies"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
    return {"drafted": after["drafted"] - before["drafted"], "accepted": accepted, "verifies": verifies,
            "acceptance_length": round(1 + accepted / verifies, 4) if verifies else None,
            "acceptance_rate_per_position": [round(a / verifies, 4) if verifies else None for a in per_pos]}


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
                seed: int = 0, profile_steps: int = 16) -> dict:
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise InvalidRequestError("batch_sizes", f"must be integers >= 1, got {batch_sizes}")
    if max(batch_sizes) > config.max_num_seqs:
        raise InvalidRequestError("batch_sizes", f"{max(batch_sizes)} exceeds max_num_seqs ({config.max_num_seqs})")
    if not prompt_lens or any(n < 1 for n in prompt_lens):
        raise InvalidRequestError("prompt_lens", f"must be integers >= 1, got {prompt_lens}")
    for name, value in (("decode_steps", decode_steps), ("ttft_trials", ttft_trials), ("decode_context", decode_context)):
        if value < 1:
            raise InvalidRequestError(name, f"must be >= 1, got {value}")
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
        context = min(decode_context, max_len - warmup_steps - decode_steps - 2 * profile_steps - 2)
        if context < 1:
            raise InvalidRequestError("max_model_len", f"{max_len} leaves no room for {decode_steps} decode steps")
        lens = sorted({min(n, max_len - 1) for n in prompt_lens})
        # Batch 1 also gets a step breakdown (bench.step_profile): what keeps it from the roofline.
        decode = [_decode(engine, b, context, decode_steps, warmup_steps, rng, profile_steps if b == 1 else 0)
                  for b in sorted(set(batch_sizes))]
        ttft = [_ttft(engine, n, ttft_trials, rng) for n in lens]
        weight_bytes = engine.executor.decode_weight_bytes()
        kv_bytes = int(engine.executor.kv_spec.bytes_per_token * (context + warmup_steps + decode_steps / 2))
        cuda_graphs = engine.executor.cuda_graphs
        hf_config, vocab_size = engine.checkpoint.hf_config, engine.vocab_size
    finally:
        engine.shutdown()
        del engine
        release_memory(device)

    report["params"] = {"batch_sizes": sorted(set(batch_sizes)), "prompt_lens": lens, "decode_context": context,
                        "decode_steps": decode_steps, "warmup_steps": warmup_steps, "ttft_trials": ttft_trials,
                        "seed": seed, "cuda_graphs": cuda_graphs, "profile_steps": profile_steps}
    report["decode"] = decode
    report["ttft"] = ttft
    step_bytes = weight_bytes + kv_bytes
    roofline_tok_s = bandwidth["used_gb_s"] * 1e9 / step_bytes
    b1 = next((d for d in decode if d["batch_size"] == 1), None)
    report["roofline"] = {
        "weight_bytes_per_step": weight_bytes, "kv_bytes_per_step_batch1": kv_bytes, "bandwidth": bandwidth,
        "roofline_tok_s_batch1": round(roofline_tok_s, 1),
        "fraction_batch1": round(b1["tok_s"] / roofline_tok_s, 4) if b1 else None,
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

