"""`serve` command line: argument parsing, and a real server process (API key from the
environment, graceful SIGTERM: the in-flight stream completes, then the process exits 0)."""
import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from qsaserve.errors import InvalidRequestError
from qsaserve.server.cli import API_KEY_ENV, add_serve_parser, allowed_hosts_for, build_server_app, cmd_serve


def parse(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    return parser.parse_args(argv)


def test_command_line_builds_without_the_web_stack():
    """`qsaserve bench` / `generate` / `calibrate` run where FastAPI is not importable: building the
    parser (which adds `serve` and its flags) must not import it."""
    code = ("import sys; import qsaserve.cli as c; c.build_parser(); "
            "bad = sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_serve_arguments():
    args = parse(["serve", "model.gguf", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k", "--served-model-name", "a", "b",
                  "--max-waiting-requests", "3", "--retry-after", "5", "--max-request-bytes", "4096", "--max-logprobs", "5",
                  "--max-prompt-chars", "1000", "--tokenizer-pool-size", "2", "--max-waiting-tokens", "9999",
                  "--max-seqs-per-request", "7", "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    assert args.func is cmd_serve and args.model_tag == "model.gguf"
    assert (args.host, args.port, args.api_key, args.served_model_name) == ("0.0.0.0", 9000, "k", ["a", "b"])
    assert (args.max_waiting_seqs, args.retry_after, args.max_request_bytes, args.max_logprobs) == (3, 5, 4096, 5)
    assert (args.max_prompt_chars, args.tokenizer_pool_size, args.max_waiting_tokens, args.max_seqs_per_request) == (1000, 2, 9999, 7)
    assert parse(["serve", "--max-waiting-seqs", "9"]).max_waiting_seqs == 9
    assert args.max_num_seqs == 4 and args.enable_prefix_caching is False
    defaults = parse(["serve"])
    assert (defaults.host, defaults.port, defaults.api_key, defaults.model_tag) == ("127.0.0.1", 8000, None, None)


def test_host_and_origin_arguments():
    args = parse(["serve", "--allowed-hosts", "myhost", "*.lan", "--allowed-origins", "http://localhost:3000"])
    assert (args.allowed_hosts, args.allowed_origins) == (["myhost", "*.lan"], ["http://localhost:3000"])
    assert parse(["serve"]).allowed_origins == []
    loopback = ["localhost", "127.0.0.1", "::1"]
    for bind in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert allowed_hosts_for(bind, None) == loopback, bind
        assert allowed_hosts_for(bind, ["myhost"]) == loopback + ["myhost"]
    for bind in ("0.0.0.0", "::", "10.1.2.3", "myhost"):
        assert allowed_hosts_for(bind, None) is None, bind  # reached under names the server cannot know
        assert allowed_hosts_for(bind, ["myhost"]) == loopback + ["myhost"]


@pytest.mark.parametrize(
    "argv, param",
    [
        (["serve", "a.gguf", "--model", "b.gguf"], "model"),
        (["serve", "--port", "70000"], "port"),
        (["serve", "--max-waiting-requests", "0"], "max_waiting_seqs"),
        (["serve", "--max-waiting-seqs", "0"], "max_waiting_seqs"),
        (["serve", "--max-waiting-tokens", "0"], "max_waiting_tokens"),
        (["serve", "--max-seqs-per-request", "0"], "max_seqs_per_request"),
        (["serve", "--retry-after", "-1"], "retry_after"),
        (["serve", "--max-prompt-chars", "0"], "max_prompt_chars"),
        (["serve", "--tokenizer-pool-size", "0"], "tokenizer_pool_size"),
    ],
)
def test_bad_serve_arguments_fail_before_loading(argv, param):
    with pytest.raises(InvalidRequestError) as e:
        build_server_app(parse(argv))
    assert e.value.param == param


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, method, path, body=None, key=None, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    return conn, conn.getresponse()


def sse_events(resp) -> list[str]:
    return [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]


def test_serve_process_env_key_and_sigterm_drain(tmp_path):
    """SIGTERM used to let streams run on for the whole grace period, then drop their connections
    mid-body (no error event, no [DONE]), while new requests were still accepted, and to log
    CancelledError tracebacks. Now: new requests get 503 at once, a stream that finishes within
    the grace completes, the others end with an error event and [DONE], the process exits."""
    port = free_port()
    grace = 4
    env = dict(os.environ, **{API_KEY_ENV: "env-key"})
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "qsaserve.server.cli", "--dtype", "float32", "--max-model-len", "512",
         "--kv-cache-memory", str(32 * 2**20), "--port", str(port), "--served-model-name", "smol",
         "--timeout-graceful-shutdown", str(grace), "--uvicorn-log-level", "info"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                _, resp = request(port, "GET", "/health", timeout=5)
                if resp.status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.25)

        assert request(port, "GET", "/v1/models")[1].status == 401
        _, resp = request(port, "GET", "/v1/models", key="env-key")
        assert resp.status == 200 and [m["id"] for m in json.loads(resp.read())["data"]] == ["smol"]

        def start_stream(max_tokens):
            conn, stream = request(port, "POST", "/v1/completions", key="env-key", timeout=60,
                                   body={"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "ignore_eos": True,
                                         "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
            assert stream.status == 200 and stream.readline().startswith(b"data: ")
            return conn, stream

        _, short = start_stream(8)  # finishes within the grace, even on a loaded 2-core machine
        _, long = start_stream(490)  # does not
        waiting_conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # non-streaming, also too long
        waiting_conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json", "Authorization": "Bearer env-key"},
                             body=json.dumps({"prompt": "Story:", "max_tokens": 490, "ignore_eos": True}))
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        sigterm = time.monotonic()
        time.sleep(0.3)

        _, refused = request(port, "POST", "/v1/completions", key="env-key", body={"prompt": "New", "max_tokens": 2})
        body = json.loads(refused.read())
        assert refused.status == 503 and body["error"]["code"] == "server_shutting_down", body
        _, health = request(port, "GET", "/health")
        assert health.status == 503 and json.loads(health.read())["error"]["type"] == "service_unavailable_error"

        events = sse_events(short)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 8
        events = sse_events(long)
        ended = time.monotonic() - sigterm
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable_error"
        assert ended < grace, ended
        resp = waiting_conn.getresponse()
        assert resp.status == 503 and json.loads(resp.read())["error"]["code"] == "server_shutting_down"

        # uvicorn re-raises the signal after its graceful shutdown, so the status says SIGTERM.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert time.monotonic() - sigterm < grace + 10
        output = (tmp_path / "server.log").read_text()
        assert "server shut down: engine stopped" in output, output
        assert "Traceback" not in output and "CancelledError" not in output and "Exception in ASGI" not in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
