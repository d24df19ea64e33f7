"""The OpenAI-compatible HTTP API over an AsyncLLMEngine: the app factory and the small routes.

Routes: /v1/completions (completions.py), /v1/chat/completions (chat.py), /v1/models, /tokenize,
/detokenize, /tokenizer_info, /version, /health, /metrics. Errors: errors.py; the guard in front
of every route: middleware.py; SSE plumbing: streaming.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Sequence

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

import qsaserve
from qsaserve.engine.async_engine import AsyncLLMEngine
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.errors import InvalidRequestError
from qsaserve.loader.generation_config import sampling_defaults
from qsaserve.sampling_params import MAX_LOGPROBS
from qsaserve.server.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TOKENIZER_POOL_SIZE
from qsaserve.server import metrics as metrics_mod
from qsaserve.server.chat import create_chat_completion
from qsaserve.server.completions import create_completion
from qsaserve.server.errors import bad_request, error_response, install_error_handlers
from qsaserve.server.middleware import LOOPBACK_HOSTS, GuardMiddleware
from qsaserve.server.model_names import default_names
from qsaserve.server.parsing import parse, read_json
from qsaserve.server.prompts import encode_conversation
from qsaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from qsaserve.server.state import ServerLimits, ServerState
from qsaserve.server.tokenizer import TokenizerPool, decode, encode_text, ids_to_tokens
from qsaserve.server.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("qsaserve")

READ_METHODS = ["GET", "HEAD"]  # HEAD too: health probes use it


def build_app(
    engine: AsyncLLMEngine | LLMEngine,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_logprobs: int = MAX_LOGPROBS,
    max_prompt_chars: int | None = None,
    max_seqs_per_request: int | None = None,
    tokenizer_pool_size: int = DEFAULT_TOKENIZER_POOL_SIZE,
    allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
    allowed_origins: Sequence[str] = (),
    shutdown_engine: bool = True,
    chat_template: str | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    generation_config: str = "auto",
) -> FastAPI:
    """The FastAPI app. `engine` may be an LLMEngine (wrapped, unbounded queue) or an
    AsyncLLMEngine; `shutdown_engine` stops it when the app shuts down. served_model_name
    (default: the model's own name, see model_names.py) is what /v1/models lists. max_prompt_chars
    (default: max_model_len x the longest token's characters, the most a prompt that fits can
    have) bounds each prompt text and each conversation before it is tokenized;
    max_seqs_per_request (default: max_num_seqs, at most the engine's waiting bound) bounds
    prompts x n. allowed_hosts: the Host names answered (None: any; the default suits a
    loopback bind); allowed_origins: the web origins allowed, with CORS (default: none).
    chat_template: a template's text, or a file holding one, used instead of the model's;
    enable_auto_tool_choice / tool_call_parser: tool_choice "auto" and how calls are parsed
    (server/tool_parsers.py); generation_config: auto, vllm or a directory (loader/generation_config.py)."""
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine)
    core = engine.engine
    model_root = getattr(getattr(core, "checkpoint", None), "path", None)
    aliases: set[str] = set()
    if served_model_name is None:
        names, aliases = default_names(model_root, core.config.model)
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise InvalidRequestError("served_model_name", f"must be one or more non-empty names, got {served_model_name!r}")
    if not isinstance(max_logprobs, int) or not 0 <= max_logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError("max_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {max_logprobs!r}")
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1024:
        raise InvalidRequestError("max_request_bytes", f"must be an integer >= 1024, got {max_request_bytes!r}")
    for name, value in (("max_prompt_chars", max_prompt_chars), ("max_seqs_per_request", max_seqs_per_request)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InvalidRequestError(name, f"must be an integer >= 1, got {value!r}")
    seqs_per_request = max_seqs_per_request or core.config.max_num_seqs
    if engine.max_waiting_requests is not None:  # more could never be admitted
        seqs_per_request = min(seqs_per_request, engine.max_waiting_requests)

    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise InvalidRequestError("tool_call_parser", f"must be one of {', '.join(TOOL_CALL_PARSERS)}; got {tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise InvalidRequestError("enable_auto_tool_choice", "needs --tool-call-parser")
    template = load_chat_template(chat_template)
    defaults = sampling_defaults(generation_config, model_root)
    tokenizer = TokenizerPool(core.tokenizer, tokenizer_pool_size)
    limits = ServerLimits(
        max_request_bytes=max_request_bytes,
        max_prompt_chars=max_prompt_chars or core.max_model_len * tokenizer.max_token_chars,
        max_logprobs=max_logprobs,
        max_n=min(core.config.max_num_seqs, seqs_per_request),
        max_seqs_per_request=seqs_per_request,
        max_model_len=core.max_model_len,
    )
    state = ServerState(
        engine=engine,
        model_names=names,
        model_aliases=aliases,
        api_key=api_key or None,
        limits=limits,
        tokenizer=tokenizer,
        metrics=metrics_mod.ServerMetrics(engine, names[0]),
        vocab_size=core.vocab_size,
        model_root=model_root,
        chat_template=template,
        sampling_defaults=defaults,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        reaper = asyncio.ensure_future(_release_when_dead(engine)) if shutdown_engine else None
        yield
        if reaper is not None:
            reaper.cancel()
        state.tokenizer.close()
        if shutdown_engine:
            await asyncio.to_thread(engine.shutdown)
            logger.info("server shut down: engine stopped")

    app = FastAPI(title="qsaserve", version=qsaserve.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins)
    if allowed_origins:  # added last, so outermost: it answers preflights itself
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "HEAD", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    _add_routes(app, state)
    return app


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself (vLLM accepts both)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError("chat_template", f"must be a Jinja template or a file holding one, got {value!r}")
    if "{{" in value or "{%" in value:
        return value
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise InvalidRequestError("chat_template", f"{value!r} is neither a file nor a Jinja template")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError("chat_template", f"{path} is not a valid Jinja template: {e}") from None
    return text


async def _release_when_dead(engine: AsyncLLMEngine, interval_s: float = 1.0) -> None:
    """Once the engine is dead (its loop failed, or a worker rank exited), stop it: that stops its
    surviving worker processes, which would otherwise wait on their dead sibling until the server
    exits. The server goes on answering, with 503s."""
    while engine.dead_error is None:
        await asyncio.sleep(interval_s)
    logger.error("the engine is dead (%s); stopping it and its worker processes", engine.dead_error)
    await asyncio.to_thread(engine.shutdown)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    engine, limits = state.engine, state.limits

    @app.api_route("/health", methods=READ_METHODS)
    async def health() -> Response:
        dead = engine.dead_error
        if dead is not None or not engine.is_healthy():
            reason = str(dead) if dead is not None else "the engine is not running"
            return error_response(503, reason, type="service_unavailable_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.api_route("/metrics", methods=READ_METHODS)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=metrics_mod.CONTENT_TYPE)

    @app.api_route("/version", methods=READ_METHODS)
    async def version() -> Response:
        return JSONResponse({"version": qsaserve.__version__})

    @app.api_route("/v1/models", methods=READ_METHODS)
    async def models() -> Response:
        cards = [ModelCard(id=n, created=state.started, root=state.model_root, max_model_len=limits.max_model_len)
                 for n in state.model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.api_route("/tokenizer_info", methods=READ_METHODS)
    async def tokenizer_info() -> Response:
        tok = state.tokenizer.tok  # None for a model without one
        return JSONResponse({
            "tokenizer_class": type(tok).__name__ if tok is not None else None,
            "eos_token": getattr(tok, "eos_token", None),
            "bos_token": getattr(tok, "bos_token", None),
            "pad_token": getattr(tok, "pad_token", None),
            "unk_token": getattr(tok, "unk_token", None),
            "chat_template": state.chat_template or getattr(tok, "chat_template", None),
            "model_max_length": limits.max_model_len,
            "vocab_size": state.vocab_size,
        })

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse(TokenizeRequest, await read_json(request, limits.max_request_bytes))
        state.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt", "prompt: give exactly one of 'prompt' or 'messages'")
        pool = state.tokenizer
        if req.messages is not None:
            ids = await encode_conversation(state, req.messages, req.add_generation_prompt)
        else:
            if len(req.prompt) > limits.max_prompt_chars:
                raise bad_request("prompt", f"prompt: the prompt has {len(req.prompt)} characters; at most "
                                            f"{limits.max_prompt_chars} are accepted")
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await pool.run(encode_text, req.prompt, add_special, chars=len(req.prompt))
        strs = await pool.run(ids_to_tokens, ids, chars=len(ids)) if req.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=limits.max_model_len, tokens=ids, token_strs=strs)
        return JSONResponse(body.model_dump())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse(DetokenizeRequest, await read_json(request, limits.max_request_bytes))
        state.model_name(req.model)
        bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise bad_request("tokens", f"tokens: ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})")
        text = await state.tokenizer.run(decode, req.tokens, chars=len(req.tokens))
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(CompletionRequest, await read_json(request, limits.max_request_bytes))
        return await create_completion(state, request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse(ChatCompletionRequest, await read_json(request, limits.max_request_bytes))
        return await create_chat_completion(state, request, req)
