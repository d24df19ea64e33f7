"""Engine outputs to HTTP: iterating a request's streams, waiting for final outputs while
watching for a disconnect, and Server-Sent Events."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from qsaserve.engine.async_engine import EngineOverloadedError, RequestStream
from qsaserve.errors import EngineDeadError, InvalidRequestError
from qsaserve.outputs import RequestOutput
from qsaserve.server.errors import ClientGone, ServerShuttingDown
from qsaserve.server.protocol import ErrorInfo, ErrorResponse
from qsaserve.stop_strings import StopStringMatcher

logger = logging.getLogger("qsaserve")


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Waits for every request to finish; a client disconnect aborts them all (raises ClientGone)."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def run() -> None:
        async for i, out in merge(streams):
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
        elif not task.cancelled():
            task.exception()  # seen: when this handler was cancelled meanwhile, nobody re-raises it
        for s in streams:
            s.abort()
    if task not in done:
        raise ClientGone()
    task.result()  # re-raises an engine failure
    return finals  # type: ignore[return-value]


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class ChoiceState:
    """What one streamed choice has sent so far."""
    sent_chars: int = 0
    sent_tokens: int = 0
    offset: int = 0  # text_offset of the next token
    started: bool = False
    finished: bool = False
    stop_state: int = 0  # the stop strings' automaton after the first `scanned` characters
    scanned: int = 0

    def sendable(self, text: str, final: bool, stops: StopStringMatcher | None) -> int:
        """How much of the cumulative text may be sent: all of a final one; otherwise all but its
        longest suffix that begins a stop string (it may still become a stop, which the engine
        would cut)."""
        if final or stops is None:
            return len(text)
        self.stop_state, _ = stops.advance(self.stop_state, text, self.scanned)
        self.scanned = len(text)
        return len(text) - min(stops.depth(self.stop_state), len(text))


def sse(model: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def sse_error(e: Exception) -> str:
    if isinstance(e, InvalidRequestError):
        info = ErrorInfo(message=str(e), type="invalid_request_error", param=e.param)
    elif isinstance(e, EngineOverloadedError):
        info = ErrorInfo(message=str(e), type="rate_limit_error", code="server_overloaded")
    elif isinstance(e, ServerShuttingDown):
        info = ErrorInfo(message=str(e), type="service_unavailable_error", code="server_shutting_down")
    elif isinstance(e, EngineDeadError):
        info = ErrorInfo(message=str(e), type="service_unavailable_error", code="engine_dead")
    else:
        logger.exception("internal error while streaming", exc_info=e)
        info = ErrorInfo(message=f"internal server error: {type(e).__name__}", type="internal_server_error")
    return f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
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
