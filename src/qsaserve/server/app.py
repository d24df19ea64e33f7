"""The OpenAI-compatible HTTP API over an AsyncLLMEngine.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
/tokenizer_info, /version, /health, /metrics. Every client mistake is a 400 with an OpenAI error
body naming the parameter; an overloaded or dead engine is a 503; only server bugs are 500s.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Sequence

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import qsaserve
from qsaserve.engine.async_engine import AsyncLLMEngine, EngineOverloadedError, RequestStream
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.entrypoints.llm import apply_chat_template, validate_messages
from qsaserve.errors import EngineDeadError, InvalidRequestError
from qsaserve.outputs import PositionLogprobs, RequestOutput
from qsaserve.sampling_params import MAX_LOGPROBS, SamplingParams
from qsaserve.server import DEFAULT_MAX_REQUEST_BYTES
from qsaserve.server import metrics as metrics_mod
from qsaserve.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)

logger = logging.getLogger("qsaserve")

_OPEN_PATHS = {"/health"}  # reachable without the API key (load balancers probe it)
_ROUTES = {
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
    "/tokenizer_info", "/version", "/health", "/metrics",
}


# ---------------- errors ----------------
class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type, param, code, headers


class _ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _loc_to_param(loc: Iterable) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; drops pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "body" and not out:
            continue
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict", "none"):
            out += ("." if out else "") + part
    return out or "body"


def _validation_error(errors: Sequence[dict]) -> ApiError:
    err = errors[0]
    param = _loc_to_param(err.get("loc", ()))
    given = err.get("input")
    detail = err.get("msg", "invalid value")
    if err.get("type") != "missing":
        shown = json.dumps(given, default=str) if given is not None else "null"
        detail += f" (got {shown[:80]})"
    return _bad(param, f"{param}: {detail}")


# ---------------- tokenizer ----------------
class ServerTokenizer:
    """A private copy of the engine's tokenizer, used on one worker thread: the engine thread keeps
    its own copy (so they never share Rust state) and long prompts never block the event loop."""

    def __init__(self, tokenizer):
        self.tok = copy.deepcopy(tokenizer)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="qsaserve-tokenizer")

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        # The same function LLM.chat uses: served and offline chat prompts are token-identical.
        try:
            return apply_chat_template(self.tok, messages, add_generation_prompt)
        except jinja2.TemplateError as e:
            raise InvalidRequestError("messages", f"the chat template rejected the conversation: {e}") from e

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---------------- app state ----------------
@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_names: list[str]
    api_key: str | None
    max_request_bytes: int
    max_logprobs: int
    max_n: int
    max_prompts: int
    tokenizer: ServerTokenizer
    metrics: metrics_mod.ServerMetrics
    max_model_len: int
    vocab_size: int
    model_root: str | None
    started: int = field(default_factory=lambda: int(time.time()))

    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names:
            raise ApiError(400, f"model: the model {requested!r} does not exist; this server serves {self.model_names}",
                           param="model", code="model_not_found")
        return requested


def build_app(
    engine: AsyncLLMEngine | LLMEngine,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_logprobs: int = MAX_LOGPROBS,
    shutdown_engine: bool = True,
) -> FastAPI:
    """The FastAPI app. `engine` may be an LLMEngine (wrapped, unbounded queue) or an
    AsyncLLMEngine; `shutdown_engine` stops it when the app shuts down."""
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine)
    core = engine.engine
    if served_model_name is None:
        names = [core.config.model or "default"]
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

    state = ServerState(
        engine=engine,
        model_names=names,
        api_key=api_key or None,
        max_request_bytes=max_request_bytes,
        max_logprobs=max_logprobs,
        max_n=core.config.max_num_seqs,
        max_prompts=engine.max_waiting_requests or 1024,
        tokenizer=ServerTokenizer(core.tokenizer),
        metrics=metrics_mod.ServerMetrics(engine, names[0]),
        max_model_len=core.max_model_len,
        vocab_size=core.vocab_size,
        model_root=getattr(getattr(core, "checkpoint", None), "path", None),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.tokenizer.close()
        if shutdown_engine:
            await asyncio.to_thread(engine.shutdown)
            logger.info("server shut down: engine stopped")

    app = FastAPI(title="qsaserve", version=qsaserve.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    _install_error_handlers(app)
    app.add_middleware(_GuardMiddleware, state=state)

    @app.get("/health")
    async def health() -> Response:
        dead = engine.dead_error
        if dead is not None or not engine.is_healthy():
            reason = str(dead) if dead is not None else "the engine is not running"
            return error_response(503, reason, type="service_unavailable_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=metrics_mod.CONTENT_TYPE)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": qsaserve.__version__})

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [ModelCard(id=n, created=state.started, root=state.model_root, max_model_len=state.max_model_len) for n in names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        tok = state.tokenizer.tok
        return JSONResponse({
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": state.max_model_len,
            "vocab_size": state.vocab_size,
        })

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = _parse(TokenizeRequest, await _read_json(request, state.max_request_bytes))
        state.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise _bad("prompt", "prompt: give exactly one of 'prompt' or 'messages'")
        tok = state.tokenizer
        if req.messages is not None:
            messages = _normalize_messages(req.messages)
            ids = await tok.call(tok.render_chat, messages, req.add_generation_prompt)
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await tok.call(lambda: tok.tok.encode(req.prompt, add_special_tokens=add_special))
        strs = await tok.call(tok.tok.convert_ids_to_tokens, ids) if req.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)
        return JSONResponse(body.model_dump())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = _parse(DetokenizeRequest, await _read_json(request, state.max_request_bytes))
        state.model_name(req.model)
        bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise _bad("tokens", f"tokens: ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})")
        text = await state.tokenizer.call(state.tokenizer.tok.decode, req.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = _parse(CompletionRequest, await _read_json(request, state.max_request_bytes))
        return await _completions(state, request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = _parse(ChatCompletionRequest, await _read_json(request, state.max_request_bytes))
        return await _chat(state, request, req)

    return app


# ---------------- middleware and error handlers ----------------
class _GuardMiddleware:
    """API-key check (all routes but /health) and per-route HTTP status counts. Pure ASGI, so
    streaming responses and client-disconnect cancellation pass through untouched."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self._expected = f"Bearer {state.api_key}".encode() if state.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self._expected is not None and path not in _OPEN_PATHS and not self._authorized(scope):
                resp = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            route = path if path in _ROUTES else "other"
            self.state.metrics.http_requests.labels(route, str(status[0])).inc()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return error_response(e.status, e.message, type=e.type, param=e.param, code=e.code, headers=e.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid(_: Request, e: InvalidRequestError):
        return error_response(400, str(e), param=e.param)

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, e: EngineOverloadedError):
        return error_response(503, str(e), type="service_unavailable_error", code="server_overloaded",
                              headers={"Retry-After": str(e.retry_after)})

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, e: EngineDeadError):
        return error_response(503, str(e), type="service_unavailable_error", code="engine_dead")

    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, e: RequestValidationError):
        err = _validation_error(e.errors())
        return error_response(400, err.message, param=err.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "internal_server_error"
        return error_response(e.status_code, str(e.detail), type=kind, headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, e: ClientDisconnect):
        # The client left while its request body was still being read: nothing was queued and no
        # one is listening. Recorded as 499 (client closed request), like a disconnect mid-generation.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception):
        logger.exception("internal error while serving a request")
        return error_response(500, f"internal server error: {type(e).__name__}", type="internal_server_error")


# ---------------- request parsing ----------------
def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def _read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; every malformed body is a 400 naming 'body'."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _bad("body", f"body: the request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _bad("body", f"body: the request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise _bad("body", "body: the request body is empty; expected a JSON object")
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
        # Lone surrogates ("\ud800") decode from JSON but cannot be tokenized.
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as e:
        raise _bad("body", f"body: malformed JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _bad("body", f"body: must be a JSON object, got {type(obj).__name__}")
    return obj


def _parse(model: type[BaseModel], obj: dict):
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _normalize_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token_id(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
            return list(prompt)
    raise _bad("prompt", "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _normalize_messages(messages: list[dict]) -> list[dict]:
    """Validates roles/contents and flattens content-part lists to text, as chat templates expect strings."""
    validate_messages(messages)
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}]", "only {'type': 'text', 'text': str} parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({**m, "content": content if content is not None else ""})
    return out


# ---------------- engine iteration ----------------
async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several requests' outputs as they arrive; closing it aborts all of them."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def _final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Waits for every request to finish; a client disconnect aborts them all (raises _ClientGone)."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def run() -> None:
        async for i, out in _merge(streams):
            finals[i] = out

    task = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also on cancellation of this handler
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for s in streams:
            s.abort()
    if task not in done:
        raise _ClientGone()
    task.result()  # re-raises an engine failure
    return finals  # type: ignore[return-value]


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that begins some stop string: it may still become
    a stop (which the engine would cut), so streaming must not send it yet."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


def _sse(model: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def _sse_error(e: Exception) -> str:
    if isinstance(e, InvalidRequestError):
        info = ErrorInfo(message=str(e), type="invalid_request_error", param=e.param)
    elif isinstance(e, (EngineDeadError, EngineOverloadedError)):
        info = ErrorInfo(message=str(e), type="service_unavailable_error", code="engine_dead")
    else:
        logger.exception("internal error while streaming", exc_info=e)
        info = ErrorInfo(message=f"internal server error: {type(e).__name__}", type="internal_server_error")
    return f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"


class _SSEResponse(StreamingResponse):
    """An SSE stream that aborts its requests however the response ends: a client disconnect can
    cancel it before the body generator starts, or abandon the generator at a yield."""

    def __init__(self, body: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()


async def _add(state: ServerState, request_id: str, prompts: list, params: SamplingParams) -> list[RequestStream]:
    entries = [(f"{request_id}-{i}", p if isinstance(p, str) else {"prompt_token_ids": p}, params) for i, p in enumerate(prompts)]
    return await state.engine.add_requests(entries)


# ---------------- logprobs formats ----------------
def _legacy_logprobs(entries: Sequence[PositionLogprobs | None], token_ids: Sequence[int], num_top: int,
                     offset: int, first_token: str | None = None) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy completions format. text_offset indexes the choice's `text` (which starts
    with the prompt when echo is on). top_logprobs holds the top num_top plus the chosen token."""
    lp = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries):
        if entry is None:  # the first prompt token has no context, so no logprob
            text = first_token or ""
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            chosen = entry[tid]
            text = chosen.decoded_token or ""
            lp.token_logprobs.append(chosen.logprob)
            top: dict[str, float] = {}
            for t, item in sorted(entry.items(), key=lambda kv: kv[1].rank):
                if item.rank <= num_top or t == tid:
                    top.setdefault(item.decoded_token or "", item.logprob)
            lp.top_logprobs.append(top)
        lp.tokens.append(text)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp, offset


def _chat_logprobs(entries: Sequence[PositionLogprobs], token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    out = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        tops = sorted((item for item in entry.values() if item.rank <= num_top), key=lambda item: item.rank)[:num_top]
        token = chosen.decoded_token or ""
        out.append(TokenLogprob(
            token=token, logprob=chosen.logprob, bytes=list(token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=t.decoded_token or "", logprob=t.logprob,
                                     bytes=list((t.decoded_token or "").encode("utf-8"))) for t in tops],
        ))
    return out


def _prompt_logprobs_json(entries) -> list[dict[str, PromptLogprob] | None] | None:
    if entries is None:
        return None
    return [
        None if e is None else {str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token) for t, lp in e.items()}
        for e in entries
    ]


def _usage(outputs: Sequence[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# ---------------- /v1/completions ----------------
async def _completions(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    model = state.model_name(req.model)
    req.check_common(state.max_n, state.max_logprobs)
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of", "best_of: only best_of == n (or unset) is supported")
    if req.suffix:
        raise _bad("suffix", "suffix: is not supported by this server")
    if req.logprobs is not None and req.logprobs > state.max_logprobs:
        raise _bad("logprobs", f"logprobs: must be <= {state.max_logprobs}, got {req.logprobs}")
    prompts = _normalize_prompts(req.prompt)
    if len(prompts) > state.max_prompts:
        raise _bad("prompt", f"prompt: at most {state.max_prompts} prompts per request, got {len(prompts)}")
    echo_lps = req.echo and req.logprobs is not None
    prompt_lps = req.prompt_logprobs
    if echo_lps:
        prompt_lps = max(req.logprobs, prompt_lps or 0)
    params = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_lps)

    request_id = random_id("cmpl")
    created = int(time.time())
    streams = await _add(state, request_id, prompts, params)
    if req.stream:
        return _SSEResponse(_completion_stream(state, req, params, request_id, created, model, prompts, streams), streams)
    try:
        finals = await _final_outputs(request, streams)
    except _ClientGone:
        return Response(status_code=499)
    choices = []
    for pi, out in enumerate(finals):
        prompt_text, first_tok = await _echo_parts(state, prompts[pi], out, req.echo, echo_lps)
        for comp in out.outputs:
            text, lp, offset = "", None, 0
            if req.echo:
                text = prompt_text
                if echo_lps:
                    lp, offset = _legacy_logprobs(out.prompt_logprobs or [], out.prompt_token_ids, req.logprobs, 0, first_tok)
            text += comp.text
            if req.logprobs is not None:
                gen, _ = _legacy_logprobs(comp.logprobs or [], comp.token_ids, req.logprobs, offset)
                lp = gen if lp is None else _concat_logprobs(lp, gen)
            choices.append(CompletionChoice(
                index=pi * req.n + comp.index, text=text, logprobs=lp, finish_reason=comp.finish_reason,
                stop_reason=comp.stop_reason,
                prompt_logprobs=_prompt_logprobs_json(out.prompt_logprobs) if req.prompt_logprobs is not None else None,
            ))
    body = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=_usage(finals))
    return JSONResponse(body.model_dump())


def _concat_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset,
    )


async def _echo_parts(state: ServerState, prompt, out: RequestOutput, echo: bool, with_logprobs: bool) -> tuple[str, str | None]:
    """The prompt text to echo and the text of its first token (which has no logprob entry)."""
    if not echo:
        return "", None
    tok = state.tokenizer
    text = prompt if isinstance(prompt, str) else await tok.call(tok.tok.decode, list(prompt))
    first = await tok.call(tok.tok.decode, out.prompt_token_ids[:1]) if with_logprobs else None
    return text, first


@dataclass
class _ChoiceState:
    sent_chars: int = 0
    sent_tokens: int = 0
    offset: int = 0  # text_offset of the next token
    started: bool = False
    finished: bool = False


async def _completion_stream(state: ServerState, req: CompletionRequest, params: SamplingParams, request_id: str,
                             created: int, model: str, prompts: list, streams: list[RequestStream]) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    echo_lps = req.echo and req.logprobs is not None
    choices: dict[int, _ChoiceState] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for pi, out in _merge(streams):
            if out.finished:
                finals[pi] = out
            for comp in out.outputs:
                idx = pi * req.n + comp.index
                st = choices.setdefault(idx, _ChoiceState())
                if st.finished:
                    continue
                final = comp.finish_reason is not None
                text, lp = "", None
                if req.echo and not st.started:
                    if not comp.token_ids and not final:
                        continue  # the prompt (and its logprobs) is not fully processed yet
                    prompt_text, first_tok = await _echo_parts(state, prompts[pi], out, True, echo_lps)
                    text = prompt_text
                    if echo_lps:
                        lp, st.offset = _legacy_logprobs(out.prompt_logprobs or [], out.prompt_token_ids, req.logprobs, 0, first_tok)
                    else:
                        st.offset = len(prompt_text)
                st.started = True
                limit = len(comp.text) if final else len(comp.text) - _stop_holdback(comp.text, params.stop_strings)
                if limit > st.sent_chars:
                    text += comp.text[st.sent_chars:limit]
                    st.sent_chars = limit
                if req.logprobs is not None and len(comp.token_ids) > st.sent_tokens:
                    gen, st.offset = _legacy_logprobs((comp.logprobs or [])[st.sent_tokens:], comp.token_ids[st.sent_tokens:],
                                                      req.logprobs, st.offset)
                    lp = gen if lp is None else _concat_logprobs(lp, gen)
                st.sent_tokens = len(comp.token_ids)
                if not text and lp is None and not final:
                    continue
                st.finished = final
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=model,
                    choices=[CompletionStreamChoice(index=idx, text=text, logprobs=lp, finish_reason=comp.finish_reason,
                                                    stop_reason=comp.stop_reason)],
                )
                yield _sse(chunk, exclude)
        if include_usage:
            usage = _usage([finals[i] for i in sorted(finals)])
            yield _sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
        yield _sse_error(e)
    finally:
        for s in streams:
            s.abort()
    yield "data: [DONE]\n\n"


# ---------------- /v1/chat/completions ----------------
async def _chat(state: ServerState, request: Request, req: ChatCompletionRequest) -> Response:
    model = state.model_name(req.model)
    req.check_common(state.max_n, state.max_logprobs)
    if req.tools:
        raise _bad("tools", "tools: tool calling is not supported by this server")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise _bad("response_format", "response_format: only {'type': 'text'} is supported")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise _bad("top_logprobs", "top_logprobs: requires logprobs to be true")
        if not 0 <= req.top_logprobs <= state.max_logprobs:
            raise _bad("top_logprobs", f"top_logprobs: must be in [0, {state.max_logprobs}], got {req.top_logprobs}")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise _bad("max_completion_tokens", f"max_completion_tokens: must be >= 1, got {req.max_completion_tokens}")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    num_top = req.top_logprobs or 0
    params = req.sampling_params(max_tokens=max_tokens, logprobs=num_top if req.logprobs else None,
                                 prompt_logprobs=req.prompt_logprobs)
    messages = _normalize_messages(req.messages)
    prompt_ids = await state.tokenizer.call(state.tokenizer.render_chat, messages, req.add_generation_prompt)
    request_id = random_id("chatcmpl")
    created = int(time.time())
    try:
        streams = await _add(state, request_id, [prompt_ids], params)
    except InvalidRequestError as e:
        if e.param == "prompt":  # the prompt is the rendered conversation
            raise InvalidRequestError("messages", str(e).removeprefix("prompt: ")) from None
        raise
    if req.stream:
        return _SSEResponse(_chat_stream(req, params, request_id, created, model, streams[0]), streams)
    try:
        (out,) = await _final_outputs(request, streams)
    except _ClientGone:
        return Response(status_code=499)
    choices = [
        ChatChoice(
            index=c.index, message=ChatMessage(content=c.text), finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=ChatLogprobs(content=_chat_logprobs(c.logprobs or [], c.token_ids, num_top)) if req.logprobs else None,
        )
        for c in out.outputs
    ]
    body = ChatCompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=_usage([out]),
        prompt_logprobs=_prompt_logprobs_json(out.prompt_logprobs) if req.prompt_logprobs is not None else None,
    )
    return JSONResponse(body.model_dump())


async def _chat_stream(req: ChatCompletionRequest, params: SamplingParams, request_id: str, created: int, model: str,
                       stream: RequestStream) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    num_top = req.top_logprobs or 0
    states = [_ChoiceState() for _ in range(req.n)]
    last: RequestOutput | None = None

    def chunk(index: int, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None) -> str:
        body = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[
            ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        ])
        return _sse(body, exclude)

    try:
        for i in range(req.n):  # the role comes first, as OpenAI sends it
            yield chunk(i, DeltaMessage(role="assistant", content=""))
        async for _, out in _merge([stream]):
            last = out
            for comp in out.outputs:
                st = states[comp.index]
                if st.finished:
                    continue
                final = comp.finish_reason is not None
                limit = len(comp.text) if final else len(comp.text) - _stop_holdback(comp.text, params.stop_strings)
                text = ""
                if limit > st.sent_chars:
                    text = comp.text[st.sent_chars:limit]
                    st.sent_chars = limit
                lps = None
                if req.logprobs and len(comp.token_ids) > st.sent_tokens:
                    lps = ChatLogprobs(content=_chat_logprobs((comp.logprobs or [])[st.sent_tokens:], comp.token_ids[st.sent_tokens:], num_top))
                st.sent_tokens = len(comp.token_ids)
                if not text and lps is None and not final:
                    continue
                st.finished = final
                yield chunk(comp.index, DeltaMessage(content=text) if text or not final else DeltaMessage(), lps,
                            comp.finish_reason, comp.stop_reason)
        if include_usage and last is not None:
            yield _sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=_usage([last])))
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
        yield _sse_error(e)
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"
