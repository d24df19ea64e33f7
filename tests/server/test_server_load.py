"""Bounded load test on loopback: 48 concurrent clients for ~20 s (streaming and not, completions
and chat, n > 1, random client aborts, some bad requests) against a small KV cache so preemption
and prefix caching are exercised, once with the synchronous engine and once with async scheduling. No response may be a 5xx, and afterwards every KV block is
free and no request is left anywhere."""
import asyncio
import random
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qsaserve.config import EngineConfig
from qsaserve.engine.async_engine import AsyncLLMEngine
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.server import build_app
from qsaserve.server.cli import BackgroundServer

CLIENTS = 48
LOAD_SECONDS = 20.0
MODEL = "smol"
PREFIXES = ["You are a helpful assistant. Answer briefly. Question: ", "Translate to French: ", "Write a haiku about "]
TOPICS = ["the sea", "mountains", "a cat", "rain", "coffee", "the moon", "trains", "autumn"]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def server(request):
    # ~56 KV blocks of 16 tokens for 48 clients: requests queue and get preempted under load. With
    # async scheduling too: aborts, preemptions and stops land on steps already launched.
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=256, kv_cache_memory=40 * 2**20,
                                    async_scheduling=request.param), progress=False)
    aengine = AsyncLLMEngine(engine, max_waiting_requests=1024)
    srv = BackgroundServer(build_app(aengine, MODEL))
    srv.aengine = aengine
    yield srv
    srv.stop()


async def worker(client: openai.AsyncOpenAI, rng: random.Random, deadline: float, stats: dict) -> None:
    while time.monotonic() < deadline:
        prompt = rng.choice(PREFIXES) + rng.choice(TOPICS) + f" #{rng.randrange(1000)}"
        max_tokens = rng.randint(2, 12)
        kind = rng.choice(["stream", "stream_chat", "plain", "plain", "bad"])
        abort_after = rng.randint(1, 4) if rng.random() < 0.3 else None
        try:
            if kind == "bad":
                with pytest.raises(openai.BadRequestError):
                    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, top_p=2.0)
                stats["bad"] += 1
            elif kind == "plain":
                call = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, n=rng.choice([1, 2]),
                                                 temperature=0.7, seed=rng.randrange(100))
                if abort_after is not None:  # give up while it runs: the server sees a disconnect
                    with pytest.raises(asyncio.TimeoutError):
                        await asyncio.wait_for(call, timeout=0.05)
                    stats["aborted"] += 1
                else:
                    r = await call
                    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
                    stats["ok"] += 1
            else:
                if kind == "stream":
                    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                             stream_options={"include_usage": True})
                else:
                    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                                  max_tokens=max_tokens, stream=True)
                chunks = 0
                finished = False
                async for chunk in stream:
                    chunks += 1
                    if chunk.choices and chunk.choices[0].finish_reason:
                        assert chunk.choices[0].finish_reason in ("stop", "length")
                        finished = True
                    if abort_after is not None and chunks >= abort_after and not finished:
                        break
                await stream.close()
                stats["ok" if finished else "aborted"] += 1
        except openai.APIStatusError as e:
            stats["errors"].append((kind, e.status_code, str(e)[:200]))
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            stats["errors"].append((kind, "connection", repr(e)[:200]))


async def run_load(srv) -> dict:
    stats = {"ok": 0, "aborted": 0, "bad": 0, "errors": [], "max_waiting": 0, "max_kv_usage": 0.0}

    async def monitor(deadline):  # same process: read the engine's snapshot to see the pressure
        while time.monotonic() < deadline:
            snap = srv.aengine.snapshot
            stats["max_waiting"] = max(stats["max_waiting"], snap.num_requests_waiting)
            stats["max_kv_usage"] = max(stats["max_kv_usage"], snap.kv_cache_usage)
            await asyncio.sleep(0.05)

    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        deadline = time.monotonic() + LOAD_SECONDS
        await asyncio.gather(monitor(deadline), *(worker(client, random.Random(i), deadline, stats) for i in range(CLIENTS)))
    return stats


def test_concurrent_load_with_aborts(server):
    start = time.monotonic()
    stats = asyncio.run(run_load(server))
    elapsed = time.monotonic() - start
    assert stats["errors"] == [], stats["errors"][:5]
    assert stats["ok"] >= CLIENTS and stats["aborted"] >= 5 and stats["bad"] >= 5, stats
    assert elapsed < LOAD_SECONDS + 60
    assert stats["max_waiting"] > 0 and stats["max_kv_usage"] > 0.5, stats  # the KV cache was the bottleneck

    # Aborts reach the engine asynchronously: wait until it has drained.
    def state(e):
        return dict(free=e.block_manager.num_free_blocks, total=e.block_manager.num_blocks, requests=len(e.requests),
                    waiting=len(e.scheduler.waiting), running=len(e.scheduler.running),
                    streams=len(server.aengine._streams), timing=len(server.aengine._timing))

    deadline = time.monotonic() + 30
    while True:
        s = asyncio.run(server.aengine.run(state))
        if s["free"] == s["total"] and not (s["requests"] or s["waiting"] or s["running"] or s["streams"] or s["timing"]):
            break
        assert time.monotonic() < deadline, f"engine not drained: {s}"
        time.sleep(0.1)
    assert server.aengine.is_healthy()

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        samples = [s for f in text_string_to_metric_families(resp.read().decode()) for s in f.samples]
    by_status: dict[str, float] = {}
    for s in samples:
        if s.name == "qsaserve:http_requests_total" and s.labels["route"] in ("/v1/completions", "/v1/chat/completions"):
            by_status[s.labels["status"]] = by_status.get(s.labels["status"], 0) + s.value
    assert not any(code.startswith("5") for code in by_status), by_status
    assert by_status.get("200", 0) >= stats["ok"] and by_status.get("400", 0) == stats["bad"]
    preemptions = next(s.value for s in samples if s.name == "qsaserve:num_preemptions_total")
    hits = next(s.value for s in samples if s.name == "qsaserve:prefix_cache_hits_total")
    print(f"load: {stats['ok']} ok, {stats['aborted']} aborted, {stats['bad']} bad in {elapsed:.1f} s; "
          f"peak {stats['max_waiting']} waiting, KV {stats['max_kv_usage']:.0%}; "
          f"{preemptions:.0f} preemptions, {hits:.0f} prefix-cache hit tokens")
