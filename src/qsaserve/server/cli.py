"""`qsaserve serve [MODEL] [engine flags] [server flags]`: run the OpenAI-compatible server.

`add_serve_parser(subparsers)` adds the subcommand to the main CLI; `python -m
qsaserve.server.cli [MODEL] ...` runs it on its own.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from qsaserve.errors import InvalidRequestError
from qsaserve.server.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TOKENIZER_POOL_SIZE

API_KEY_ENV = "QSASERVE_API_KEY"
DEFAULT_MAX_WAITING_SEQS = 512
DEFAULT_MAX_WAITING_TOKENS = 2**20
DEFAULT_SHUTDOWN_GRACE_S = 10.0


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from qsaserve.sampling_params import MAX_LOGPROBS
    from qsaserve.server.tool_parsers import TOOL_CALL_PARSERS

    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="model to serve (same as --model)")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    group.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV} if set)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients may send in 'model', listed by /v1/models (default: the model's own "
                            "name, e.g. SmolLM2-135M-Instruct; its path, and 'default' for the default model, are "
                            "accepted too)")
    group.add_argument("--max-waiting-seqs", "--max-waiting-requests", dest="max_waiting_seqs", type=int,
                       default=DEFAULT_MAX_WAITING_SEQS,
                       help="sequences (prompts x n) that may wait to be scheduled; beyond it new requests get 429 + "
                            f"Retry-After (default: {DEFAULT_MAX_WAITING_SEQS})")
    group.add_argument("--max-waiting-tokens", type=int, default=None,
                       help="prompt tokens (times n) that may wait to be computed; beyond it new requests get 429 "
                            f"(default: {DEFAULT_MAX_WAITING_TOKENS}, or max-model-len if larger)")
    group.add_argument("--max-seqs-per-request", type=int, default=None,
                       help="largest prompts x n of one request (default: max-num-seqs, at most max-waiting-seqs)")
    group.add_argument("--retry-after", type=int, default=1, help="seconds sent in Retry-After when overloaded (default: 1)")
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help=f"largest accepted request body (default: {DEFAULT_MAX_REQUEST_BYTES})")
    group.add_argument("--max-prompt-chars", type=int, default=None,
                       help="longest prompt text (and conversation content) accepted before tokenizing "
                            "(default: max-model-len x the longest token's characters: a longer text cannot fit)")
    group.add_argument("--tokenizer-pool-size", type=int, default=DEFAULT_TOKENIZER_POOL_SIZE,
                       help=f"tokenizer worker threads; long prompts leave one free for short ones (default: {DEFAULT_TOKENIZER_POOL_SIZE})")
    group.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                       help=f"largest logprobs / top_logprobs / prompt_logprobs a request may ask for (default: {MAX_LOGPROBS})")
    group.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                       help="Host header names answered besides localhost, 127.0.0.1 and ::1 ('*.example.com' "
                            "matches subdomains, '*' any name); a server bound to loopback refuses other names "
                            "(DNS rebinding); bound elsewhere, any name is answered unless this is given")
    group.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                       help="web origins (e.g. http://localhost:3000, or '*') allowed to call the API, with CORS; "
                            "requests carrying any other Origin are refused (default: none)")
    group.add_argument("--timeout-graceful-shutdown", type=float, default=DEFAULT_SHUTDOWN_GRACE_S, metavar="SECONDS",
                       help="on SIGTERM/SIGINT: new requests get 503 at once, running ones may finish within this "
                            "many seconds, then the rest end with an error event (streams) or a 503 "
                            f"(default: {DEFAULT_SHUTDOWN_GRACE_S:g})")
    chat = parser.add_argument_group("chat, tools and sampling defaults")
    chat.add_argument("--chat-template", default=None,
                      help="a Jinja chat template, or a file holding one, used instead of the model's")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='allow tool_choice "auto" (the default when a request has tools): the output is parsed for '
                           "tool calls by --tool-call-parser")
    chat.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                      help="how tool calls are written: hermes (<tool_call>{json}</tool_call>: Hermes, Qwen2.5, Qwen3) or "
                           "qwen3_coder (<tool_call><function=...><parameter=...>: Qwen3-Coder)")
    chat.add_argument("--generation-config", default="auto",
                      help="sampling defaults for fields a request leaves unset: auto (the model directory's "
                           "generation_config.json, if any), vllm (none), or a directory holding a "
                           "generation_config.json (default: auto)")
    chat.add_argument("--trust-remote-code", action="store_true",
                      help="accepted for vLLM command lines; changes nothing: qsaserve runs no code from a checkpoint "
                           "(its models and tokenizers are built in)")
    group.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (default: info)")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `serve` subcommand to the main CLI's subparsers."""
    from qsaserve.engine_args import add_engine_args

    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                   description="Serve a model over an OpenAI-compatible HTTP API.")
    add_server_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=cmd_serve)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise InvalidRequestError("model", f"given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise InvalidRequestError("port", f"must be in [0, 65535], got {args.port}")
    for name in ("max_waiting_seqs", "max_waiting_tokens", "max_seqs_per_request", "max_prompt_chars", "tokenizer_pool_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidRequestError(name, f"must be >= 1, got {value}")
    if args.retry_after < 0:
        raise InvalidRequestError("retry_after", f"must be >= 0, got {args.retry_after}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InvalidRequestError("enable_auto_tool_choice", "needs --tool-call-parser (hermes or qwen3_coder)")
    from qsaserve.server.app import load_chat_template

    args.chat_template = load_chat_template(args.chat_template)  # checked before the model loads


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def allowed_hosts_for(bind_host: str, extra: list[str] | None) -> list[str] | None:
    """The Host names a server bound to bind_host answers to (None: any)."""
    from qsaserve.server.middleware import LOOPBACK_HOSTS

    if extra is None and not is_loopback(bind_host):
        return None
    return [*LOOPBACK_HOSTS, *(extra or ())]


def build_server_app(args: argparse.Namespace):
    """Loads the engine and builds the app from parsed `serve` arguments."""
    from qsaserve.engine.async_engine import AsyncLLMEngine
    from qsaserve.engine.llm_engine import LLMEngine
    from qsaserve.engine_args import engine_config_from_args
    from qsaserve.server.app import build_app

    _check_args(args)
    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    waiting_tokens = args.max_waiting_tokens or max(DEFAULT_MAX_WAITING_TOKENS, engine.max_model_len)
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=args.max_waiting_seqs, max_waiting_tokens=waiting_tokens,
                                  retry_after=args.retry_after)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return build_app(
        async_engine, args.served_model_name, api_key,
        max_request_bytes=args.max_request_bytes, max_logprobs=args.max_logprobs, max_prompt_chars=args.max_prompt_chars,
        max_seqs_per_request=args.max_seqs_per_request, tokenizer_pool_size=args.tokenizer_pool_size,
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts), allowed_origins=args.allowed_origins,
        chat_template=args.chat_template, enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, generation_config=args.generation_config,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from qsaserve.server.drain import GracefulServer

    app = build_server_app(args)
    logging.getLogger("qsaserve").info("serving %s on http://%s:%d", app.state.server.model_names, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    GracefulServer(config, app.state.server.drain, args.timeout_graceful_shutdown).run()
    return 0


class BackgroundServer:
    """A uvicorn server on a daemon thread (for notebooks, benchmarks and tests); port=0 picks a
    free port. stop() shuts it down as SIGTERM does `serve`, with `grace` seconds."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", startup_timeout: float = 60.0,
                 grace: float = DEFAULT_SHUTDOWN_GRACE_S):
        import threading
        import time

        import uvicorn

        from qsaserve.server.drain import GracefulServer

        self.app = app
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
        self.server = GracefulServer(config, app.state.server.drain, grace)
        self.thread = threading.Thread(target=self.server.run, name="qsaserve-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        self.host = host
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful stop: the drain, then uvicorn closes connections, then the app's lifespan shuts
        the engine down."""
        if self.thread.is_alive():
            self.server.request_drain()
            self.thread.join(timeout)


def main(argv: list[str] | None = None) -> int:
    from qsaserve.engine_args import add_engine_args

    parser = argparse.ArgumentParser(prog="qsaserve-serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    parser.add_argument("--log-level", default="INFO")
    add_server_args(parser)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return cmd_serve(args)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
