"""`qsaserve bench prefix`: what the prefix cache buys.

  * repeated-prefix TTFT at each prompt length (capped at max_model_len): a fresh prefix (cold),
    the same prefix again with another suffix (GPU hit), and, with --kv-offload-gib, again after
    the GPU tier was moved to the host tier (host hit: its blocks and snapshot are copied back);
  * a multi-turn chat replay: each turn's prompt is the previous prompt + its answer + new text,
    with TTFT and the fraction of the prompt served from the cache per turn;
  * decode tok/s with caching on and with caching off (a second engine, same flags otherwise).

TTFT is the engine's own (RequestMetrics: arrival to the first token on the host), median over
trials, each trial on fresh random tokens. Before each cold run both tiers are emptied.
"""
from __future__ import annotations

import dataclasses
import random

from qsaserve.bench.common import median, provenance, random_prompt, release_memory
from qsaserve.bench.latency import decode_run
from qsaserve.config import EngineConfig
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.errors import InvalidRequestError
from qsaserve.sampling_params import SamplingParams

SUFFIX_TOKENS = 16  # the part of a repeated-prefix prompt that differs between its runs


def _run(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, int, list[int]]:
    """One request alone: (TTFT seconds, cached prompt tokens, generated tokens)."""
    engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step(outputs="finished"):
            if out.request_id == rid:
                final = out
    m = final.metrics
    return m.first_token_time - m.arrival_time, final.num_cached_tokens, final.outputs[0].token_ids


def _flush_host_copies(engine: LLMEngine, rng: random.Random, tag: str) -> None:
    """Runs the planned GPU -> host copies now, in an untimed one-token step, so the host-hit run
    that follows pays only for its copies back."""
    _run(engine, f"flush-{tag}", random_prompt(rng, 1, engine.vocab_size), 1)


def _repeated_prefix(engine: LLMEngine, length: int, trials: int, rng: random.Random) -> dict:
    bm = engine.block_manager
    host = bm.host_tier is not None
    rows = {"cold": [], "gpu_hit": [], "host_hit": []}
    cached = {"gpu_hit": [], "host_hit": []}
    restored = []
    for trial in range(trials + 1):  # the first is warm-up
        bm.reset_prefix_cache()
        prefix = random_prompt(rng, length - SUFFIX_TOKENS, engine.vocab_size)
        suffix = lambda: random_prompt(rng, SUFFIX_TOKENS, engine.vocab_size)  # noqa: E731
        runs = {"cold": _run(engine, f"cold-{length}-{trial}", prefix + suffix(), 1),
                "gpu_hit": _run(engine, f"gpu-{length}-{trial}", prefix + suffix(), 1)}
        if host:
            bm.offload_prefix_cache()
            _flush_host_copies(engine, rng, f"{length}-{trial}")
            before = bm.host_tier.stats.blocks_restored
            runs["host_hit"] = _run(engine, f"host-{length}-{trial}", prefix + suffix(), 1)
            restored.append(bm.host_tier.stats.blocks_restored - before)
        if not trial:
            continue
        for kind, (ttft, num_cached, _) in runs.items():
            rows[kind].append(ttft)
            if kind in cached:
                cached[kind].append(num_cached)
    row = {"prompt_len": length, "trials": trials}
    for kind, times in rows.items():
        row[f"{kind}_ttft_ms"] = round(median(times) * 1e3, 3) if times else None
    row["gpu_hit_cached_tokens"] = min(cached["gpu_hit"])
    row["host_hit_cached_tokens"] = min(cached["host_hit"]) if host else None
    row["host_hit_blocks_restored"] = min(restored) if host else None
    cold = row["cold_ttft_ms"]
    row["gpu_hit_over_cold"] = round(row["gpu_hit_ttft_ms"] / cold, 4)
    row["host_hit_over_cold"] = round(row["host_hit_ttft_ms"] / cold, 4) if host else None
    return row


def _chat_replay(engine: LLMEngine, turns: int, system_tokens: int, turn_tokens: int, answer_tokens: int,
                 rng: random.Random) -> list[dict]:
    engine.block_manager.reset_prefix_cache()
    prompt = random_prompt(rng, system_tokens + turn_tokens, engine.vocab_size)
    rows = []
    for turn in range(1, turns + 1):
        ttft, num_cached, answer = _run(engine, f"chat-{turn}", prompt, answer_tokens)
        rows.append({"turn": turn, "prompt_len": len(prompt), "cached_tokens": num_cached,
                     "hit_rate": round(num_cached / len(prompt), 4), "ttft_ms": round(ttft * 1e3, 3)})
        prompt = prompt + answer + random_prompt(rng, turn_tokens, engine.vocab_size)
    return rows


def run_prefix(config: EngineConfig, prompt_lens: list[int], trials: int = 3, chat_turns: int = 8,
               chat_system_tokens: int = 2048, chat_turn_tokens: int = 256, chat_answer_tokens: int = 128,
               decode_batch: int = 32, decode_context: int = 1024, decode_steps: int = 64, warmup_steps: int = 8,
               seed: int = 0) -> dict:
    if not prompt_lens or any(n <= SUFFIX_TOKENS for n in prompt_lens):
        raise InvalidRequestError("prompt_lens", f"must be integers > {SUFFIX_TOKENS}, got {prompt_lens}")
    for name, value in (("trials", trials), ("chat_turns", chat_turns), ("chat_turn_tokens", chat_turn_tokens),
                        ("chat_answer_tokens", chat_answer_tokens), ("decode_batch", decode_batch),
                        ("decode_context", decode_context), ("decode_steps", decode_steps)):
        if value < 1:
            raise InvalidRequestError(name, f"must be >= 1, got {value}")
    if decode_batch > config.max_num_seqs:
        raise InvalidRequestError("decode_batch", f"{decode_batch} exceeds max_num_seqs ({config.max_num_seqs})")
    device = config.torch_device
    report = {"bench": "prefix", **provenance(config)}
    rng = random.Random(seed)
    engine = LLMEngine(config, progress=False)
    try:
        bm = engine.block_manager
        if not bm.enable_prefix_caching:
            raise InvalidRequestError("enable_prefix_caching", "bench prefix measures the prefix cache: turn it on "
                                      "(--enable-prefix-caching; hybrid models have it off by default)")
        max_len = engine.max_model_len
        lens = sorted({min(n, max_len - 1) for n in prompt_lens})
        chat_len = chat_system_tokens + chat_turns * chat_turn_tokens + (chat_turns - 1) * chat_answer_tokens
        if chat_len + chat_answer_tokens > max_len:
            raise InvalidRequestError("chat_system_tokens", f"the replay's last turn needs {chat_len + chat_answer_tokens}"
                                      f" tokens, more than max_model_len {max_len}")
        repeated = [_repeated_prefix(engine, n, trials, rng) for n in lens]
        chat = _chat_replay(engine, chat_turns, chat_system_tokens, chat_turn_tokens, chat_answer_tokens, rng)
        bm.reset_prefix_cache()
        context = min(decode_context, max_len - warmup_steps - decode_steps - 2)
        decode_on = decode_run(engine, decode_batch, context, decode_steps, warmup_steps, rng)
        tier = bm.host_tier
        host = None if tier is None else {"blocks": tier.kv.num_slots, "snapshots": tier.snapshots.num_slots
                                          if tier.snapshots else 0, "bytes": tier.nbytes,
                                          "stats": dataclasses.asdict(tier.stats)}
        block_size = bm.block_size
        interval = bm.state_cache.interval if bm.state_cache is not None else None
    finally:
        engine.shutdown()
        del engine
        release_memory(device)
    off = LLMEngine(dataclasses.replace(config, enable_prefix_caching=False, kv_offload_gib=0.0), progress=False)
    try:
        decode_off = decode_run(off, decode_batch, context, decode_steps, warmup_steps, random.Random(seed + 1))
    finally:
        off.shutdown()
        del off
        release_memory(device)
    report["params"] = {"prompt_lens": lens, "trials": trials, "suffix_tokens": SUFFIX_TOKENS,
                        "chat_turns": chat_turns, "chat_system_tokens": chat_system_tokens,
                        "chat_turn_tokens": chat_turn_tokens, "chat_answer_tokens": chat_answer_tokens,
                        "block_size": block_size, "state_interval": interval, "seed": seed}
    report["repeated_prefix"] = repeated
    report["chat_replay"] = chat
    report["chat_turn_last_over_first_ttft"] = round(chat[-1]["ttft_ms"] / chat[0]["ttft_ms"], 4)
    report["host_tier"] = host
    report["decode"] = {"caching_on": decode_on, "caching_off": decode_off,
                        "on_over_off_tok_s": round(decode_on["tok_s"] / decode_off["tok_s"], 4)}
    return report
