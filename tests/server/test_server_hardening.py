"""Hostile clients against the real SmolLM2 server on loopback: every bad request is refused
with an OpenAI error body naming the parameter, the server keeps serving, and streams that run
meanwhile keep their pace (inter-token gap < 0.5 s)."""
import gc
import http.client
import json
import re
import threading
import time

import openai
import pytest

from qsaserve.config import EngineConfig
from qsaserve.engine.async_engine import AsyncLLMEngine
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.server import build_app
from qsaserve.server.cli import BackgroundServer

MODEL = "smol"
MAX_MODEL_LEN = 256
# The longest pause a stream may see beside a refused request: the stall this guards against was
# ~5 s; parsing a 7 MB body in the test's own process took up to 0.6 s on a loaded 2-core machine.
MAX_GAP_S = 1.0


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=48 * 2**20), progress=False)
    aengine = AsyncLLMEngine(engine, max_waiting_requests=64)
    srv = BackgroundServer(build_app(aengine, MODEL))
    srv.aengine = aengine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def raw(server, method, path, body=None, headers=None, timeout=60):
    """One HTTP request; `body` is a dict (sent as JSON) or bytes (sent as given)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        parsed = json.loads(data) if data else None
    except ValueError:
        parsed = data.decode()
    return resp.status, dict(resp.getheaders()), parsed


def check_error(status, body, param, expected_status=400, code=None):
    assert status == expected_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param and isinstance(err["message"], str) and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def still_serves(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


class PacedStream:
    """A long greedy stream read on a thread, recording when each event arrives: a hostile
    request (run through measure()) must not stretch the gaps between its events. Only the gaps
    around that request count: this machine is shared, and what else it runs is no concern here."""

    SLACK_S = 0.2  # after the response: the engine may still be busy with what the request left

    def __init__(self, server, max_tokens=120):
        gc.collect()  # the server shares this process: no collection of earlier garbage mid-measurement
        self.conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
        body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        self.conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.times: list[float] = []
        self.events: list[str] = []
        self.window: tuple[float, float] | None = None
        for _ in range(5):  # running before the hostile request goes out
            self._read_one()
        self.thread = threading.Thread(target=self._read_all, daemon=True)
        self.thread.start()

    def _read_one(self) -> bool:
        line = self.resp.readline()
        if not line:
            return False
        if line.startswith(b"data: "):
            self.times.append(time.monotonic())
            self.events.append(line[6:].decode().strip())
        return True

    def _read_all(self) -> None:
        while self._read_one():
            pass

    def measure(self, request):
        """Runs request() and returns what it returns; finish() then reports the gaps around it."""
        start = time.monotonic()
        try:
            return request()
        finally:
            self.window = (start, time.monotonic())

    def finish(self) -> float:
        """Waits for the end of the stream; returns the largest gap between its events that
        overlaps the measured request."""
        self.thread.join(120)
        self.conn.close()
        assert self.events[-1] == "[DONE]", self.events[-3:]
        start, end = self.window
        assert self.times[-1] > end + self.SLACK_S, "the stream ended before the request was handled"
        gap = max(b - a for a, b in zip(self.times, self.times[1:]) if b >= start and a <= end + self.SLACK_S)
        print(f"max inter-token gap {gap:.3f} s around a request of {end - start:.3f} s")
        return gap


# ---------------- D4: tiny temperatures ----------------
def test_tiny_temperature_is_greedy(client):
    """logits / 1e-40 overflowed to inf: every token became id 0 ("" with finish_reason length)."""
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].text
    assert greedy
    for t in (1e-40, 1e-30, 1e-8):
        assert client.completions.create(temperature=t, **kwargs).choices[0].text == greedy, t
        # top_p takes the sampler's general path (filters), which divides too.
        assert client.completions.create(temperature=t, top_p=0.9, **kwargs).choices[0].text == greedy, t
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6)
    assert (client.chat.completions.create(temperature=1e-40, **chat).choices[0].message.content
            == client.chat.completions.create(temperature=0, **chat).choices[0].message.content)


# ---------------- D8: non-finite numbers, unbounded integers ----------------
NON_FINITE = [
    (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
    (b'{"prompt": "hi", "top_p": -1e400}', "top_p"),
    (b'{"prompt": "hi", "frequency_penalty": 1e400}', "frequency_penalty"),
    (b'{"prompt": "hi", "presence_penalty": -1e999}', "presence_penalty"),
    (b'{"prompt": "hi", "repetition_penalty": 1e400}', "repetition_penalty"),
    (b'{"prompt": "hi", "min_p": 1e400}', "min_p"),
]
HUGE_INTS = [
    ({"prompt": "hi", "min_tokens": 2**70}, "min_tokens"),
    ({"prompt": "hi", "min_tokens": 2**40, "max_tokens": None}, "min_tokens"),
    ({"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
    ({"prompt": "hi", "top_k": 2**70}, "top_k"),
    ({"prompt": "hi", "n": 2**70}, "n"),
    ({"prompt": "hi", "logprobs": 2**70}, "logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 2**70}, "prompt_logprobs"),
    ({"prompt": "hi", "stop_token_ids": [2**70]}, "stop_token_ids[0]"),
    ({"prompt": "hi", "best_of": 2**70}, "best_of"),
]


@pytest.mark.parametrize("body, param", NON_FINITE, ids=[p for _, p in NON_FINITE])
def test_non_finite_numbers_are_refused(server, client, body, param):
    for path in ("/v1/completions", "/v1/chat/completions"):
        if path.endswith("chat/completions"):
            body = body.replace(b'"prompt": "hi"', b'"messages": [{"role": "user", "content": "hi"}]')
        check_error(*raw(server, "POST", path, body)[::2], param)
    still_serves(client)


@pytest.mark.parametrize("body, param", HUGE_INTS, ids=[p for _, p in HUGE_INTS])
def test_huge_integers_are_refused(server, client, body, param):
    check_error(*raw(server, "POST", "/v1/completions", body)[::2], param)
    still_serves(client)


def test_huge_chat_integers_are_refused(server):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for field in ("min_tokens", "max_completion_tokens", "top_logprobs", "max_tokens"):
        check_error(*raw(server, "POST", "/v1/chat/completions", {**chat, field: 2**70, "logprobs": True})[::2], field)
    check_error(*raw(server, "POST", "/detokenize", {"tokens": [2**70]})[::2], "tokens[0]")


# ---------------- D9: HEAD, and OpenAI-style 404s ----------------
def test_head_health(server):
    status, headers, body = raw(server, "HEAD", "/health")
    assert status == 200 and body is None
    for path in ("/v1/models", "/version"):
        assert raw(server, "HEAD", path)[0] == 200


def test_unknown_routes_and_models_are_openai_404s(server, client):
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v1/embeddings"), ("GET", "/")):
        status, _, body = raw(server, method, path, {} if method == "POST" else None)
        err = check_error(status, body, None, expected_status=404)
        assert err["type"] == "invalid_request_error" and path in err["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nope", prompt="hi", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    err = check_error(*raw(server, "POST", "/v1/completions", {"prompt": "hi", "model": "m" * 100_000})[::2], "model",
                      expected_status=404)
    assert len(err["message"]) < 300  # the name is not echoed whole
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        status, _, err = raw(server, "POST", path, {**body, "model": "nope"})
        check_error(status, err, "model", expected_status=404, code="model_not_found")


# ---------------- D1 / D7: tokenization off the engine thread, bounded before it starts ----------------
HUGE_TEXT = "hello world " * 600_000  # 7.2 MB, under the 8 MiB body limit


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": HUGE_TEXT, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": ["short", HUGE_TEXT], "max_tokens": 4}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE_TEXT}], "max_tokens": 4}, "messages"),
    ("/tokenize", {"prompt": HUGE_TEXT}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 200_000}, "messages"),
], ids=["completion", "completion-list", "chat", "tokenize", "chat-messages"])
def test_huge_prompt_is_refused_without_stalling_streams(server, client, path, body, param):
    """A 7 MB prompt was tokenized on the engine thread (~5 s with every stream stalled) before
    being refused for length; now its size is checked before any tokenizer runs."""
    payload = json.dumps({"model": MODEL, **body}).encode()  # the server runs in this process: encode first
    paced = PacedStream(server)
    start = time.monotonic()
    status, _, err = paced.measure(lambda: raw(server, "POST", path, payload))
    elapsed = time.monotonic() - start
    gap = paced.finish()
    assert gap < MAX_GAP_S and elapsed < 3.0, (gap, elapsed)
    assert re.search("characters|messages cannot fit", check_error(status, err, param)["message"]), err
    still_serves(client)


def test_long_token_prompt_is_refused_before_the_engine(server, client):
    payload = json.dumps({"model": MODEL, "prompt": [42] * 1_000_000}).encode()
    paced = PacedStream(server)
    err = check_error(*paced.measure(lambda: raw(server, "POST", "/v1/completions", payload))[::2], "prompt")
    assert "1000000 tokens" in err["message"]
    assert paced.finish() < MAX_GAP_S
    still_serves(client)


@pytest.fixture(scope="module")
def roomy_server():
    """Prompt texts up to 8M characters reach the tokenizer (and are refused for length after it)."""
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 * 2**20), progress=False)
    srv = BackgroundServer(build_app(AsyncLLMEngine(engine), MODEL, max_prompt_chars=8_000_000, tokenizer_pool_size=2))
    yield srv
    srv.stop()


def test_long_tokenization_does_not_hold_up_short_requests(roomy_server):
    """One tokenizer thread served every chat request: a 7 MB conversation held up all others
    for seconds. Now the pool keeps a worker free of long jobs."""
    # 6 MB: seconds of tokenizing (twice the margin over the short requests of 3 MB, which a busy
    # 2-core machine could eat), then refused for length
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello world " * 500_000}],
                      "max_tokens": 2}).encode()
    results = {}

    def send_big(i):
        results[i] = raw(roomy_server, "POST", "/v1/chat/completions", big, timeout=120)
        results[f"{i}-done"] = time.monotonic()

    threads = [threading.Thread(target=send_big, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both long jobs are running or queued
    small = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    latencies = []
    for _ in range(3):
        start = time.monotonic()
        status, _, body = raw(roomy_server, "POST", "/v1/chat/completions", small)
        latencies.append(time.monotonic() - start)
        assert status == 200 and body["usage"]["completion_tokens"] == 2
    small_done = time.monotonic()
    for t in threads:
        t.join(120)
    assert max(latencies) < 1.0, latencies
    assert small_done < min(results["0-done"], results["1-done"]), "the short requests waited for the long ones"
    for i in range(2):
        assert "tokens" in check_error(*results[i][::2], "messages")["message"]


# ---------------- D2: admission counted in sequences ----------------
@pytest.mark.parametrize("body, param", [
    ({"prompt": ["Hi"] * 16, "n": 256}, "n"),  # n alone exceeds the 64 sequences one request may have
    ({"prompt": ["Hi"] * 17, "n": 4}, "prompt"),  # 68 sequences
    ({"prompt": ["Hi"] * 512, "n": 1}, "prompt"),
], ids=["n", "prompts-x-n", "prompts"])
def test_sequences_per_request_are_bounded(server, client, body, param):
    """16 prompts x n=256 used to queue 4,096 sequences from one request (the bound counted prompts)."""
    paced = PacedStream(server, max_tokens=60)
    start = time.monotonic()
    request = {"model": MODEL, "max_tokens": 2, **body}
    err = check_error(*paced.measure(lambda: raw(server, "POST", "/v1/completions", request))[::2], param)
    assert time.monotonic() - start < 1.0 and "64" in err["message"], err
    assert paced.finish() < MAX_GAP_S
    assert server.aengine.snapshot.num_requests_waiting == 0
    r = client.completions.create(model=MODEL, prompt=["Hi"] * 16, n=4, max_tokens=1)  # 64 is the bound
    assert len(r.choices) == 64


# ---------------- D3: stop strings bounded, matched by one automaton ----------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_huge_stop_list_is_refused_at_once(server, client, path):
    """600,000 stop strings blocked the event loop (/health took 4.3 s) and the engine thread."""
    body = {"model": MODEL, "max_tokens": 4, "stop": [f"stop{i}" for i in range(600_000)]}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    payload = json.dumps(body).encode()
    paced = PacedStream(server)
    start = time.monotonic()
    status, _, err = paced.measure(lambda: raw(server, "POST", path, payload))
    elapsed = time.monotonic() - start
    health_start = time.monotonic()
    assert raw(server, "GET", "/health")[0] == 200 and time.monotonic() - health_start < MAX_GAP_S
    assert paced.finish() < MAX_GAP_S and elapsed < 2.0, elapsed
    assert "at most 128 stop strings" in check_error(status, err, "stop")["message"]
    still_serves(client)


def test_stop_token_ids_are_bounded(server, client):
    """Each generated token is looked up in stop_token_ids: a million of them stalled the engine."""
    payload = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "stop_token_ids": [7] * 1_000_000}).encode()
    paced = PacedStream(server)
    status, _, err = paced.measure(lambda: raw(server, "POST", "/v1/completions", payload))
    assert paced.finish() < MAX_GAP_S
    assert "at most 1024 stop token ids" in check_error(status, err, "stop_token_ids")["message"]
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"stop_token_ids": [7] * 1024})
    assert ok.usage.completion_tokens <= 2


@pytest.mark.parametrize("stop, ok", [
    ([f"s{i}" for i in range(129)], False),
    (["x" * 4000, "y" * 4000, "z" * 193], False),  # 8193 characters in all
    ([f"{i:03d}" + "q" * 61 for i in range(128)], True),  # 128 strings, 8192 characters: the limits
], ids=["129-strings", "8193-chars", "at-the-limits"])
def test_stop_string_limits(server, client, stop, ok):
    status, _, body = raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": stop})
    if ok:
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    else:
        check_error(status, body, "stop")
    still_serves(client)


def test_many_stop_strings_cut_where_the_first_one_begins(client):
    kwargs = dict(model=MODEL, prompt="List three colors:", max_tokens=24, temperature=0)
    base = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    words = base.split(" ")
    assert len(words) > 6, base
    early, late = " " + " ".join(words[3:5]), " " + words[5]
    decoys = [f"never-{i}-{'#' * 20}" for i in range(120)]
    for stops in (decoys + [late, early], [early] + decoys + [late]):  # list order does not matter
        expected = base[: base.index(early)]
        r = client.completions.create(**kwargs, stop=stops).choices[0]
        assert (r.text, r.finish_reason, r.stop_reason) == (expected, "stop", early)
        chunks = list(client.completions.create(**kwargs, stop=stops, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == expected
        chat = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=20, temperature=0,
            stop=stops, stream=True) if c.choices]
        assert not any(s in "".join(chat) for s in stops)
    with_stop = client.completions.create(**kwargs, stop=decoys + [early], extra_body={"include_stop_str_in_output": True})
    assert with_stop.choices[0].text == base[: base.index(early) + len(early)]


# ---------------- D6: Host, Origin, Content-Type, CORS ----------------
def test_host_allow_list(server):
    """Without a Host check, DNS rebinding let any web page read /v1/models (file paths) of a
    server bound to loopback."""
    for host in ("localhost", "localhost:8000", "127.0.0.1:1234", "[::1]:8000", "LOCALHOST."):
        assert raw(server, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example"):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                                   ("GET", "/health", None)):
            err = check_error(*raw(server, method, path, body, headers={"Host": host})[::2], "Host")
            assert "--allowed-hosts" in err["message"]


def test_foreign_origins_are_refused(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for origin in ("http://evil.example", "null", "http://localhost:3000"):
        check_error(*raw(server, "POST", "/v1/completions", body, headers={"Origin": origin})[::2], "Origin")
        check_error(*raw(server, "GET", "/v1/models", headers={"Origin": origin})[::2], "Origin")
    status, headers, _ = raw(server, "OPTIONS", "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 400 and "access-control-allow-origin" not in {k.lower() for k in headers}  # CORS is off


@pytest.mark.parametrize("content_type, ok", [
    ("application/json", True), ("application/json; charset=utf-8", True), ("Application/JSON", True),
    ("text/plain", False), ("text/plain;charset=UTF-8", False), ("application/x-www-form-urlencoded", False),
    ("multipart/form-data; boundary=x", False), (None, False),
])
def test_post_bodies_must_be_json(server, content_type, ok):
    """A web page could drive the server with a text/plain POST, which needs no CORS preflight."""
    headers = {"Content-Type": content_type} if content_type else {}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions", skip_accept_encoding=True)
    payload = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    for k, v in {**headers, "Content-Length": str(len(payload))}.items():
        conn.putheader(k, v)
    conn.endheaders(payload)
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    if ok:
        assert resp.status == 200, body
    else:
        assert "Content-Type" in check_error(resp.status, body, "Content-Type")["message"]


@pytest.fixture(scope="module")
def cors_server(server):
    """The same engine behind a second app that allows one web origin (CORS on)."""
    app = build_app(server.aengine, MODEL, allowed_origins=["http://app.example"], shutdown_engine=False)
    srv = BackgroundServer(app)
    yield srv
    srv.stop()


def test_cors_for_allowed_origins_only(cors_server):
    origin = {"Origin": "http://app.example"}
    status, headers, _ = raw(cors_server, "OPTIONS", "/v1/completions", headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
    status, headers, body = raw(cors_server, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                                headers=origin)
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.example", body
    check_error(*raw(cors_server, "GET", "/v1/models", headers={"Origin": "http://evil.example"})[::2], "Origin")


# ---------------- served model names ----------------
def test_default_model_name_is_the_models_own(server):
    """The default model was served as `default`: a client naming the model got model_not_found."""
    app = build_app(server.aengine, shutdown_engine=False)
    srv = BackgroundServer(app)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        path = app.state.server.model_root
        assert path.endswith(".gguf")
        for name in ("SmolLM2-135M-Instruct", "default", path, None):  # older clients sent the path or `default`
            kwargs = {} if name is None else {"model": name}
            status, _, body = raw(srv, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **kwargs})
            assert status == 200 and body["model"] == (name or "SmolLM2-135M-Instruct"), body
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="SmolLM2", prompt="Hi", max_tokens=1)
    finally:
        srv.stop()


@pytest.mark.parametrize("path, model_arg, name", [
    ("/cache/SmolLM2-135M-Instruct.Q4_1.gguf", None, "SmolLM2-135M-Instruct"),
    ("/m/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "/m/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3.1-8B-Instruct"),
    ("/m/qwen2.5-7b-instruct-q8_0-00001-of-00002.gguf", "x", "qwen2.5-7b-instruct"),
    ("/m/model-f16.gguf", "x", "model"),
    ("/m/tiny.gguf", "x", "tiny"),
    ("/models/Llama-3.2-1B-Instruct", "/models/Llama-3.2-1B-Instruct/", "Llama-3.2-1B-Instruct"),
    ("/hf/hub/models--meta-llama--Llama-3.2-1B/snapshots/0123abcd", "x", "meta-llama/Llama-3.2-1B"),
    (None, "llama-tiny", "llama-tiny"),
])
def test_own_model_names(path, model_arg, name):
    from qsaserve.server.model_names import default_names

    names, aliases = default_names(path, model_arg)
    assert names == [name]
    assert (path is None or path in aliases or path == name) and ("default" in aliases) == (model_arg is None)


def test_model_without_tokenizer():
    """Random weights from a preset have no tokenizer: token-id prompts work, text is a 400."""
    engine = LLMEngine(EngineConfig(model="smollm2-135m", load_format="dummy", dtype="float32", max_model_len=64,
                                    kv_cache_memory=8 * 2**20), progress=False)
    srv = BackgroundServer(build_app(engine))
    try:
        status, _, body = raw(srv, "POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
        assert status == 200 and body["model"] == "smollm2-135m" and body["usage"]["completion_tokens"] == 2, body
        for path, request in (("/v1/completions", {"prompt": "text"}), ("/tokenize", {"prompt": "text"}),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                              ("/detokenize", {"tokens": [1, 2]})):
            assert "no tokenizer" in check_error(*raw(srv, "POST", path, request)[::2], "model")["message"], path
        status, _, info = raw(srv, "GET", "/tokenizer_info")
        assert status == 200 and info["eos_token"] is None
    finally:
        srv.stop()
