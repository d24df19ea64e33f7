"""The OpenAI-compatible server over the real SmolLM2 model, through a real uvicorn socket:
endpoints with the official openai client, auth, client disconnects, metrics and every kind of
bad input (400 naming the parameter, after which the server still serves)."""
import asyncio
import http.client
import json
import socket
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qsaserve.config import EngineConfig
from qsaserve.engine.async_engine import AsyncLLMEngine
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.server import build_app
from qsaserve.server.cli import BackgroundServer

API_KEY = "sk-test-key"
MODEL = "smol"
MAX_MODEL_LEN = 256
MAX_BODY = 64 * 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=48 * 2**20), progress=False)
    aengine = AsyncLLMEngine(engine, max_waiting_requests=256)
    srv = BackgroundServer(build_app(aengine, [MODEL, "alias"], API_KEY, max_request_bytes=MAX_BODY))
    srv.aengine = aengine
    yield srv
    srv.stop()
    assert not aengine.is_healthy()  # the app's shutdown stopped the engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def raw(server, method, path, body=None, headers=None, timeout=60):
    """One HTTP request with the standard library (the openai client cannot send broken bodies)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    hdrs = dict(AUTH)
    hdrs.update(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        parsed = json.loads(data) if data else None
    except ValueError:
        parsed = data.decode()
    return resp.status, dict(resp.getheaders()), parsed


def engine_state(server):
    def read(e):
        return dict(free=e.block_manager.num_free_blocks, total=e.block_manager.num_blocks, requests=len(e.requests),
                    waiting=len(e.scheduler.waiting), running=len(e.scheduler.running), finished=e.stats["finished"])

    return asyncio.run(server.aengine.run(read))


def wait_idle(server, timeout=20.0):
    """Aborts reach the engine asynchronously: poll until nothing is left and every block is free."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(server)
        if state["requests"] == state["waiting"] == state["running"] == 0 and state["free"] == state["total"]:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {state}")
        time.sleep(0.05)


def still_serves(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


# ---------------- completions ----------------
def test_completion_greedy_matches_token_prompt_and_stream(server, client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.finish_reason in ("length", "stop") and choice.text
    ids = raw(server, "POST", "/tokenize", {"prompt": prompt})[2]["tokens"]
    assert r.usage.prompt_tokens == len(ids) and r.usage.total_tokens == len(ids) + r.usage.completion_tokens

    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == choice.text

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage anywhere


def test_completion_stream_with_usage(client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + 10
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_echo_with_logprobs(client):
    prompt = "Hello, my name is"
    k = 3
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=k, echo=True)
    (choice,) = r.choices
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 5
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, (tok, off) in enumerate(zip(lp.tokens, lp.text_offset)):
        assert choice.text[off : off + len(tok)] == tok
        if i:
            assert tok in lp.top_logprobs[i] and lp.top_logprobs[i][tok] == pytest.approx(lp.token_logprobs[i])
            assert len(lp.top_logprobs[i]) <= k + 1 and all(v <= 0 for v in lp.top_logprobs[i].values())
    # Greedy: every generated token is the most likely one.
    for i in range(n_prompt, n_prompt + 5):
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()))

    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=k)
    assert plain.choices[0].text == choice.text[len(prompt):]
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n_prompt:], abs=1e-4)
    assert plain.choices[0].logprobs.text_offset[0] == 0  # offsets index the returned text

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=k,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_n_choices_and_seed(client):
    kwargs = dict(model=MODEL, prompt="My favourite food is", max_tokens=8, temperature=1.0, n=4, seed=7)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2, 3]
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len({c.text for c in a.choices}) > 1  # per-choice seeds differ
    assert 4 <= a.usage.completion_tokens <= 32

    chunks = list(client.completions.create(**kwargs, stream=True))
    texts = {i: "" for i in range(4)}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert [texts[i] for i in range(4)] == [c.text for c in sorted(a.choices, key=lambda c: c.index)]


def test_multiple_prompts(server, client):
    prompts = ["One, two, three,", "Roses are red,"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text for p in prompts]
    by_index = {c.index: c.text for c in r.choices}
    assert [by_index[0], by_index[2]] == singles and by_index[1] == by_index[0]
    ids = [raw(server, "POST", "/tokenize", {"prompt": p})[2]["tokens"] for p in prompts]
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in sorted(r2.choices, key=lambda c: c.index)] == singles


def test_stop_string_held_back_while_streaming(client):
    base = client.completions.create(model=MODEL, prompt="List three colors:", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # A multi-token stop from the middle of the greedy text: streaming must never send its prefix.
    words = base.split(" ")
    assert len(words) > 4, base
    stop = " " + " ".join(words[3:5])
    expected = base[: base.index(stop)]
    r = client.completions.create(model=MODEL, prompt="List three colors:", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="List three colors:", max_tokens=24, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_vllm_extra_fields_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt="Numbers: 1, 2, 3,", max_tokens=6, temperature=0.8, seed=3,
        extra_body=dict(top_k=20, min_p=0.05, ignore_eos=True, repetition_penalty=1.1, min_tokens=6,
                        stop_token_ids=[2], skip_special_tokens=True, include_stop_str_in_output=False, prompt_logprobs=2),
    )
    choice = r.choices[0]
    assert r.usage.completion_tokens == 6 and choice.finish_reason == "length"
    plps = choice.model_extra["prompt_logprobs"]
    assert len(plps) == r.usage.prompt_tokens and plps[0] is None
    assert all(v["logprob"] <= 0 and v["rank"] >= 1 for e in plps[1:] for v in e.values())


# ---------------- chat ----------------
def test_chat_completion(server, client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    n_prompt = raw(server, "POST", "/tokenize", {"messages": messages})[2]["count"]
    assert r.usage.prompt_tokens == n_prompt

    # Content-part lists are the same conversation.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=10, temperature=0)
    assert r2.choices[0].message.content == choice.message.content

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == choice.finish_reason


def test_chat_logprobs_and_n(client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, n=2,
                                       logprobs=True, top_logprobs=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens // 2
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy = rank 1
        assert bytes(t.bytes).decode() == t.token

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


# ---------------- other endpoints ----------------
def test_models_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    assert client.completions.create(model="alias", prompt="Hi", max_tokens=1).choices
    status, _, tok = raw(server, "POST", "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == MAX_MODEL_LEN
    status, _, detok = raw(server, "POST", "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == "Hello world"
    status, _, info = raw(server, "GET", "/tokenizer_info")
    assert status == 200 and info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert raw(server, "GET", "/version")[0] == 200


def test_unknown_route_and_method_use_openai_errors(server):
    status, _, body = raw(server, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    status, _, body = raw(server, "GET", "/v1/completions")
    assert status == 405 and "error" in body


# ---------------- auth ----------------
def test_auth(server):
    url = server.url + "/v1"
    for key in ("wrong-key", ""):
        bad = openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/metrics", "/tokenize", "/version"):
        status, headers, body = raw(server, "GET" if path != "/tokenize" else "POST", path, headers={"Authorization": ""})
        assert status == 401 and body["error"]["type"] == "invalid_request_error", path
    status, _, _ = raw(server, "GET", "/v1/models", headers={"Authorization": f"Bearer {API_KEY}x"})
    assert status == 401
    assert raw(server, "GET", "/health", headers={"Authorization": ""})[0] == 200
    assert raw(server, "GET", "/v1/models")[0] == 200


# ---------------- client disconnects ----------------
def test_disconnect_aborts_non_streaming_request(server):
    finished = wait_idle(server)["finished"]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=0.5)
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True, "temperature": 0})
    conn.request("POST", "/v1/completions", body=body, headers={**AUTH, "Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    assert engine_state(server)["requests"] == 1  # still generating when the client leaves
    conn.close()
    assert wait_idle(server, timeout=10)["finished"] == finished  # aborted, not run to completion


def test_disconnect_aborts_stream(server, client):
    finished = wait_idle(server)["finished"]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to 100."}],
                                            max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert engine_state(server)["requests"] == 1
    stream.close()
    assert wait_idle(server, timeout=10)["finished"] == finished
    still_serves(client)


def http_status_counts(server, route):
    _, _, text = raw(server, "GET", "/metrics")
    counts = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "qsaserve:http_requests_total" and s.labels["route"] == route:
                counts[s.labels["status"]] = s.value
    return counts


def test_disconnect_while_the_body_is_read(server, client):
    """A client that leaves before its whole body arrived: nothing is queued, the request is
    counted as 499 (client closed request), not as a server error, and the server goes on."""
    before = http_status_counts(server, "/v1/completions")
    sock = socket.create_connection((server.host, server.port), timeout=10)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n")
    sock.sendall(head.encode() + b'{"prompt": "Tell me')  # 19 of the 200 bytes promised
    time.sleep(0.2)  # the server is now waiting for the rest of the body
    sock.close()
    deadline = time.monotonic() + 10
    while http_status_counts(server, "/v1/completions").get("499", 0) == before.get("499", 0):
        assert time.monotonic() < deadline, "the abandoned request was never counted"
        time.sleep(0.05)
    after = http_status_counts(server, "/v1/completions")
    assert after.get("499", 0) == before.get("499", 0) + 1
    assert {k: v for k, v in after.items() if k.startswith("5")} == {k: v for k, v in before.items() if k.startswith("5")}
    assert wait_idle(server)["requests"] == 0
    still_serves(client)


# ---------------- metrics ----------------
def test_metrics(server, client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 5  # > 2 KV blocks: the repeat hits the prefix cache
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    raw(server, "POST", "/v1/completions", {"prompt": "x", "temperature": -1})
    status, headers, text = raw(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name, suffix="", **labels):
        for s in fams[name].samples:
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        raise KeyError(name + suffix)

    for gauge in ("qsaserve:num_requests_running", "qsaserve:num_requests_waiting"):
        assert value(gauge) >= 0
    assert 0.0 <= value("qsaserve:kv_cache_usage_perc") <= 1.0
    assert 0.0 < value("qsaserve:prefix_cache_hit_rate") <= 1.0  # repeated prompts above hit the cache
    assert value("qsaserve:prefix_cache_hits", "_total") <= value("qsaserve:prefix_cache_queries", "_total")
    assert value("qsaserve:num_preemptions", "_total") >= 0
    # A Llama model keeps no recurrent-state snapshots (hybrid models fill these).
    assert value("qsaserve:prefix_state_hits", "_total") == 0 == value("qsaserve:prefix_state_snapshot_bytes")
    assert value("qsaserve:host_tier_hits", "_total") == 0 == value("qsaserve:host_tier_bytes")  # no --kv-offload-gib
    assert value("qsaserve:prompt_tokens", "_total") > 0 and value("qsaserve:generation_tokens", "_total") > 0
    assert value("qsaserve:engine_healthy") == 1.0
    finished = value("qsaserve:request_success", "_total", finished_reason="length")
    assert finished >= 1
    for hist in ("qsaserve:time_to_first_token_seconds", "qsaserve:e2e_request_latency_seconds", "qsaserve:inter_token_latency_seconds"):
        count, total = value(hist, "_count"), value(hist, "_sum")
        assert count >= 1 and total > 0 and total / count < 60, hist
    assert value("qsaserve:time_to_first_token_seconds", "_count") >= finished
    assert value("qsaserve:http_requests", "_total", route="/v1/completions", status="400") >= 1
    assert value("qsaserve:http_requests", "_total", route="/v1/completions", status="200") >= 1


# ---------------- bad input ----------------
LONG = "word " * 400

BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),  # prompt + max_tokens > max_model_len
    ({"prompt": LONG, "max_tokens": 1}, "prompt"),  # prompt alone too long
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": 123}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["ok", 5]}, "prompt"),
    ({"prompt": [[1, 2], [3, "x"]]}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt_token_ids"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 1.5}, "n"),
    ({"prompt": "hi", "n": 100000}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "seed": "1"}, "seed"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": "hi", "top_k": -5}, "top_k"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "frequency_penalty": 5}, "frequency_penalty"),
    ({"prompt": "hi", "presence_penalty": -3}, "presence_penalty"),
    ({"prompt": "hi", "min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": "2"}, "stop_token_ids"),
    ({"prompt": "hi", "prompt_logprobs": 50}, "prompt_logprobs"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "logit_bias": {"50": 10}}, "logit_bias"),
    ({"prompt": "hi", "echo": "yes"}, "echo"),
    ({"prompt": "hi", "ignore_eos": 1}, "ignore_eos"),
]

GOOD_CHAT = [{"role": "user", "content": "hi"}]
BAD_CHAT = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [5]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ({"messages": GOOD_CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": GOOD_CHAT, "logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    ({"messages": GOOD_CHAT, "logprobs": 3}, "logprobs"),
    ({"messages": GOOD_CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": GOOD_CHAT, "max_tokens": 300}, "max_tokens"),
    ({"messages": GOOD_CHAT, "temperature": -1}, "temperature"),
    ({"messages": GOOD_CHAT, "n": 0}, "n"),
    # tool_choice defaults to "auto", which this server (no --enable-auto-tool-choice) refuses
    ({"messages": GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"messages": GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": GOOD_CHAT, "tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]"),
    ({"messages": GOOD_CHAT, "tool_choice": "required"}, "tool_choice"),
    ({"messages": GOOD_CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": GOOD_CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": GOOD_CHAT, "guided_regex": "("}, "guided_regex"),
    ({"messages": GOOD_CHAT, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"messages": GOOD_CHAT, "guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
]

BAD_OTHER = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": GOOD_CHAT}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "bad", "content": "x"}]}, "messages[0].role"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
]


def check_400(status, body, param):
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert isinstance(err["message"], str) and param.split("[")[0].split(".")[0] in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS, ids=[f"completions-{p}-{i}" for i, (_, p) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_params(server, client, body, param):
    check_400(*raw(server, "POST", "/v1/completions", body)[::2], param)
    still_serves(client)


@pytest.mark.parametrize("body, param", BAD_CHAT, ids=[f"chat-{p}-{i}" for i, (_, p) in enumerate(BAD_CHAT)])
def test_bad_chat_params(server, client, body, param):
    check_400(*raw(server, "POST", "/v1/chat/completions", body)[::2], param)
    still_serves(client)


@pytest.mark.parametrize("path, body, param", BAD_OTHER, ids=[f"{p[1:]}-{q}-{i}" for i, (p, _, q) in enumerate(BAD_OTHER)])
def test_bad_tokenizer_params(server, client, path, body, param):
    check_400(*raw(server, "POST", path, body)[::2], param)
    still_serves(client)


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[1, 2]", b"", b'"text"', b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "\\ud800"}',
     b"[" * 30000 + b"]" * 30000, b'{"prompt": "\xff"}'],
    ids=["malformed", "array", "empty", "string", "nan", "lone-surrogate", "deep-nesting", "bad-utf8"],
)
def test_bad_bodies(server, client, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, _, err = raw(server, "POST", path, body, headers={"Content-Type": "application/json"})
        check_400(status, err, "body")
    still_serves(client)


def test_oversized_body(server, client):
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
    status, _, err = raw(server, "POST", "/v1/completions", big, headers={"Content-Type": "application/json"})
    check_400(status, err, "body")
    assert err["error"]["code"] == "request_too_large"
    # Without Content-Length (chunked), the limit applies while reading.
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=iter([big[i : i + 8192] for i in range(0, len(big), 8192)]),
                 headers={**AUTH, "Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    check_400(resp.status, json.loads(resp.read()), "body")
    conn.close()
    still_serves(client)


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-2)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"
    still_serves(client)
