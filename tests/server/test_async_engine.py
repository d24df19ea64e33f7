"""AsyncLLMEngine on the real model, and the server's failure paths: overload (503 + Retry-After),
requests ending with finish_reason "error", client cancellation, clean shutdown and a dead engine
loop (health 503). One LLMEngine is shared; each test gets a fresh AsyncLLMEngine (and server)."""
import asyncio
import http.client
import json
import time

import openai
import pytest
import torch

from qsaserve import SamplingParams
from qsaserve.config import EngineConfig
from qsaserve.engine.async_engine import AsyncLLMEngine, EngineOverloadedError
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.errors import EngineDeadError, InvalidRequestError
from qsaserve.server import build_app
from qsaserve.server.cli import BackgroundServer

GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = dict(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_engine():
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=256, max_num_seqs=2, kv_cache_memory=32 * 2**20), progress=False)
    yield engine
    engine.shutdown()


def assert_idle(engine: LLMEngine):
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture
def aengine(llm_engine):
    a = AsyncLLMEngine(llm_engine, max_waiting_requests=8)
    yield a
    a.shutdown(shutdown_engine=False)
    assert_idle(llm_engine)


@pytest.fixture
def make_server(llm_engine):
    made = []

    def make(**kwargs):
        a = AsyncLLMEngine(llm_engine, **kwargs)
        srv = BackgroundServer(build_app(a, "smol", shutdown_engine=False))
        srv.aengine = a
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()
        srv.aengine.shutdown(shutdown_engine=False)
    assert_idle(llm_engine)


async def collect(aengine, rid, prompt, params):
    outs = [out async for out in aengine.generate(rid, prompt, params)]
    return outs


# ---------------- AsyncLLMEngine ----------------
def test_generate_streams_cumulative_outputs(aengine):
    outs = asyncio.run(collect(aengine, "a", "The capital of France is", GREEDY))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 8
    assert outs[-1].outputs[0].text.startswith(outs[0].outputs[0].text)


def test_concurrent_requests_match_serial(aengine):
    prompts = [f"Fact number {i}: the" for i in range(4)]

    async def serial():
        return [(await collect(aengine, f"s{i}", p, GREEDY))[-1].outputs[0].text for i, p in enumerate(prompts)]

    async def concurrent():
        results = await asyncio.gather(*(collect(aengine, f"c{i}", p, GREEDY) for i, p in enumerate(prompts)))
        return [r[-1].outputs[0].text for r in results]

    assert asyncio.run(concurrent()) == asyncio.run(serial())


def test_cancelled_consumer_aborts_and_frees_blocks(aengine, llm_engine):
    async def scenario():
        seen = asyncio.Event()

        async def consume():
            async for out in aengine.generate("long", "Tell me a story", SamplingParams(**LONG)):
                if len(out.outputs[0].token_ids) >= 3:
                    seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 60)
        assert await aengine.run(lambda e: "long" in e.requests)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The abort is queued before this command, so the request is gone when it runs.
        return await aengine.run(lambda e: ("long" in e.requests, e.block_manager.num_free_blocks == e.block_manager.num_blocks))

    assert asyncio.run(scenario()) == (False, True)
    assert aengine.is_healthy()


def test_add_requests_is_all_or_nothing(aengine):
    async def scenario():
        with pytest.raises(InvalidRequestError) as e:
            await aengine.add_requests([("ok", "Hello", GREEDY), ("bad", "", GREEDY)])
        assert e.value.param == "prompt"
        with pytest.raises(InvalidRequestError) as e:
            await aengine.add_requests([("dup", "Hello", GREEDY), ("dup", "Hi", GREEDY)])
        assert e.value.param == "request_id"
        return await aengine.run(lambda eng: dict(eng.requests))

    assert asyncio.run(scenario()) == {}


def test_waiting_queue_bound(aengine):
    short = SamplingParams(temperature=0, max_tokens=1)

    async def scenario():
        with pytest.raises(InvalidRequestError) as e:  # 9 sequences can never fit a queue of 8
            await aengine.add_requests([(f"r{i}", "Hello", short) for i in range(9)])
        assert e.value.param == "n"
        ok = await aengine.add_requests([(f"r{i}", "Hello", short) for i in range(8)])
        return [(await _last(s)).finished for s in ok]

    assert asyncio.run(scenario()) == [True] * 8


def test_waiting_queue_counts_sequences_and_tokens(llm_engine):
    """The bound counted requests: one request with n=256 (or 512 prompts x n=256) got in whole."""
    a = AsyncLLMEngine(llm_engine, max_waiting_requests=8, max_waiting_tokens=100, retry_after=2)
    short = SamplingParams(temperature=0, max_tokens=1)

    async def blocked_then(*adds):
        """The adds run in one engine iteration, after the engine thread was kept busy: each sees
        what the ones before it queued, and no step schedules anything in between."""
        results = await asyncio.gather(a.run(lambda e: time.sleep(0.2)), *adds, return_exceptions=True)
        return results[1:]

    async def scenario():
        with pytest.raises(InvalidRequestError) as e:
            await a.add_request("n9", "Hello", short.clone(n=9))
        assert e.value.param == "n"
        with pytest.raises(InvalidRequestError) as e:  # 2 x 60 prompt tokens
            await a.add_request("t120", {"prompt_token_ids": [1] * 60}, short.clone(n=2))
        assert e.value.param == "prompt"
        first, second, third = await blocked_then(
            a.add_request("x", "Hello", short.clone(n=6)),
            a.add_request("y", "Hello", short.clone(n=3)),  # 6 + 3 > 8
            a.add_request("z", "Hello", short.clone(n=2)),  # 6 + 2 fits
        )
        assert isinstance(second, EngineOverloadedError) and second.retry_after == 2, second
        assert "6 sequences are waiting" in str(second)
        finished = [(await _last(s)).finished for s in (first, third)]
        first, second = await blocked_then(
            a.add_request("u", {"prompt_token_ids": [1] * 40}, short.clone(n=2)),
            a.add_request("v", "Hello " * 25, short),  # text: counted once tokenized, 80 + 25 > 100
        )
        assert isinstance(second, EngineOverloadedError) and "prompt tokens" in str(second), second
        return finished + [(await _last(first)).finished]

    try:
        assert asyncio.run(scenario()) == [True] * 3
    finally:
        a.shutdown(shutdown_engine=False)
    assert_idle(llm_engine)


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out


def test_run_errors_reach_the_caller_without_killing_the_engine(aengine):
    async def scenario():
        with pytest.raises(KeyError):
            await aengine.run(lambda e: {}["missing"])
        return await aengine.run(lambda e: e.max_model_len)

    assert asyncio.run(scenario()) == 256 and aengine.is_healthy()


def test_shutdown_ends_streams_and_frees_blocks(llm_engine):
    a = AsyncLLMEngine(llm_engine)

    async def scenario():
        stream = await a.add_request("s", "Tell me a story", SamplingParams(**LONG))
        first = await stream.__anext__()
        await asyncio.to_thread(a.shutdown, 30.0, False)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await a.add_request("t", "Hello", GREEDY)
        return first

    assert not asyncio.run(scenario()).finished
    assert not a.is_healthy() and "shut down" in str(a.dead_error)
    assert_idle(llm_engine)


# ---------------- server failure paths ----------------
def post(srv, path, body, timeout=60):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_overloaded_server_answers_429_with_retry_after(make_server, llm_engine):
    srv = make_server(max_waiting_requests=3, retry_after=3)
    # max_num_seqs=2: two long streams run; then sequences wait, three at most.
    running = []
    for i in range(2):  # one at a time: a request counts as waiting until a step schedules it
        running.append(post(srv, "/v1/completions", {"prompt": f"Story {i}:", "stream": True, **LONG}))
        resp = running[-1].getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    waiting = post(srv, "/v1/completions", {"prompt": "Waiting:", "max_tokens": 2, "n": 2})
    wait_for(lambda: srv.aengine.snapshot.num_requests_waiting == 1)
    refused = post(srv, "/v1/completions", {"prompt": "Refused:", "max_tokens": 2, "n": 2}).getresponse()
    body = json.loads(refused.read())
    assert refused.status == 429 and refused.getheader("Retry-After") == "3", body
    assert body["error"]["code"] == "server_overloaded" and body["error"]["type"] == "rate_limit_error"
    assert "2 sequences are waiting" in body["error"]["message"]
    fits = post(srv, "/v1/completions", {"prompt": "Fits:", "max_tokens": 2})  # 2 + 1 sequences
    for conn in running:  # the clients leave; their aborts let the waiting requests run
        conn.close()
    for conn in (waiting, fits):
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] >= 2
    ok = post(srv, "/v1/completions", {"prompt": "Now fine:", "max_tokens": 2}).getresponse()
    assert ok.status == 200


def test_error_finish_reason_is_reported_and_server_keeps_serving(make_server, llm_engine, monkeypatch):
    srv = make_server()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    execute = llm_engine.executor.execute
    poison = {"after": None}

    def maybe_nan(batch):
        logits = execute(batch)
        if poison["after"] is not None:
            if poison["after"] == 0:
                return torch.full_like(logits, float("nan"))
            poison["after"] -= 1
        return logits

    monkeypatch.setattr(llm_engine.executor, "execute", maybe_nan)
    poison["after"] = 0
    r = client.completions.create(model="smol", prompt="Hello there", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "error" and r.choices[0].text == ""

    poison["after"] = 3  # a few good tokens, then non-finite logits mid-stream
    chunks = list(client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=20, temperature=0, stream=True))
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["error"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    poison["after"] = None
    ok = client.completions.create(model="smol", prompt="Hello there", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 4
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    conn.request("GET", "/health")
    health = conn.getresponse()
    assert health.status == 200 and json.loads(health.read()) == {"status": "ok"}
    conn.request("GET", "/metrics")
    metrics = conn.getresponse().read().decode()
    assert 'qsaserve:request_success_total{finished_reason="error",model_name="smol"} 2.0' in metrics


def test_dead_engine_loop_makes_health_503(make_server, llm_engine, monkeypatch):
    srv = make_server()
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read() and srv.aengine.is_healthy()

    in_flight = post(srv, "/v1/completions", {"prompt": "Story:", "stream": True, **LONG})
    resp = in_flight.getresponse()
    assert resp.readline().startswith(b"data: ")

    def broken_step():
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(llm_engine, "step", broken_step)
    events = [line for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert "simulated device failure" in error["message"] and error["type"] == "service_unavailable_error"

    conn.request("GET", "/health")
    health = conn.getresponse()
    body = json.loads(health.read())
    assert health.status == 503 and "simulated device failure" in body["error"]["message"]
    refused = post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}).getresponse()
    assert refused.status == 503 and json.loads(refused.read())["error"]["code"] == "engine_dead"
    conn.request("GET", "/metrics")
    assert 'qsaserve:engine_healthy{model_name="smol"} 0.0' in conn.getresponse().read().decode()
    conn.request("GET", "/v1/models")  # the HTTP side still answers
    assert conn.getresponse().status == 200
    # The dying loop released what the engine held.
    assert_idle(llm_engine)


def test_stop_ends_streams_in_band_within_the_grace(llm_engine):
    a = AsyncLLMEngine(llm_engine)
    srv = BackgroundServer(build_app(a, "smol", shutdown_engine=False), grace=1.0)
    try:
        conn = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True, **LONG})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        start = time.monotonic()
        srv.stop()
        assert time.monotonic() - start < 3.0 and not srv.thread.is_alive()
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down", events[-3:]
    finally:
        srv.stop()
        a.shutdown(shutdown_engine=False)
    assert_idle(llm_engine)


def test_dead_worker_while_idle_makes_health_503(make_server, llm_engine, monkeypatch):
    """A worker rank that dies between steps is reported by /health before any request fails
    (the multi-process executor's check_health raises EngineDeadError naming the rank)."""
    from qsaserve.errors import EngineDeadError

    srv = make_server()
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    conn.request("GET", "/health")
    ok = conn.getresponse()
    assert ok.status == 200 and ok.read()

    def dead_worker():
        raise EngineDeadError("worker rank 1 exited with code -9")

    monkeypatch.setattr(llm_engine.executor, "check_health", dead_worker, raising=False)
    conn.request("GET", "/health")
    health = conn.getresponse()
    assert health.status == 503 and "rank 1" in json.loads(health.read())["error"]["message"]


def test_dead_engine_is_stopped_with_its_workers(llm_engine, monkeypatch):
    """A worker rank that died left its sibling ranks waiting on it until the server exited: the
    server now stops a dead engine (for the multi-process executor, that stops its ranks)."""
    import threading

    a = AsyncLLMEngine(llm_engine)
    stopped = threading.Event()
    monkeypatch.setattr(llm_engine, "shutdown", stopped.set)  # the LLMEngine is shared by these tests: not really stopped
    srv = BackgroundServer(build_app(a, "smol"))  # shutdown_engine=True, as `serve` runs it
    try:
        assert not stopped.wait(1.5)  # healthy: left alone

        def dead_worker():
            raise EngineDeadError("worker rank 1 exited with code -9")

        monkeypatch.setattr(llm_engine.executor, "check_health", dead_worker, raising=False)
        assert stopped.wait(10), "the dead engine was not stopped"
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
    finally:
        srv.stop()
    assert not a.is_healthy()
