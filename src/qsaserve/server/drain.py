"""Graceful shutdown. On SIGTERM (or SIGINT) the server stops taking requests (503 at once, the
listening socket stays open so clients hear why), lets the running ones finish for most of the
grace period, then ends the rest: streams with an error event and [DONE], requests whose
response has not started with a 503. Only then is uvicorn told to exit, so it has nothing left
to cancel (no CancelledError tracebacks) before the app's shutdown stops the engine."""
from __future__ import annotations

import asyncio
import logging
import weakref

import uvicorn

from qsaserve.engine.async_engine import RequestStream
from qsaserve.server.errors import ServerShuttingDown, shutting_down_response

logger = logging.getLogger("qsaserve")


class _InFlight:
    __slots__ = ("task", "started")

    def __init__(self, task: asyncio.Task):
        self.task = task
        self.started = False  # the response's status line is sent


class Drain:
    """The app's side: tracks requests in flight and the engine streams they read."""

    def __init__(self):
        self.draining = False
        self.ended = False  # the grace period is over: what still runs is being ended
        self._in_flight: set[_InFlight] = set()
        self._streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()

    def watch_streams(self, streams: list[RequestStream]) -> None:
        self._streams.update(streams)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def run(self, app, scope, receive, send) -> None:
        """Runs the app for one request as a task of its own, which end() may cancel."""
        async def tracked_send(message):
            if message["type"] == "http.response.start":
                entry.started = True
            await send(message)

        entry = _InFlight(asyncio.ensure_future(app(scope, receive, tracked_send)))
        self._in_flight.add(entry)
        try:
            await entry.task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if not (entry.task.cancelled() and self.ended and not entry.started and not (me and me.cancelling())):
                raise
            await shutting_down_response()(scope, receive, send)
        finally:
            self._in_flight.discard(entry)

    def end(self) -> None:
        """The grace period is over: end every stream in-band, cancel what has not responded yet."""
        self.ended = True
        error = ServerShuttingDown("the server is shutting down; this request was ended before it finished")
        for stream in list(self._streams):
            if not stream.finished:
                stream.fail(error)
        for entry in list(self._in_flight):
            if not entry.started:
                entry.task.cancel()

    async def wait_idle(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._in_flight


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with the drain in front of its own shutdown. `grace` is the whole time
    allowed; running requests get most of it, ending the rest the last END_S of it."""

    END_S = 1.0

    def __init__(self, config: uvicorn.Config, drain: Drain, grace: float):
        self.end_s = min(self.END_S, grace / 2)
        config.timeout_graceful_shutdown = self.end_s  # what uvicorn may still wait once the drain is done
        super().__init__(config)
        self.drain = drain
        self.grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler. A second signal goes to uvicorn (which exits without waiting)."""
        if self._drain_task is not None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def request_drain(self) -> None:
        """Starts the graceful shutdown from any thread, as SIGTERM does."""
        if self._loop is None:  # not started yet
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._start_drain, None)

    def _start_drain(self, sig: int | None) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig: int | None) -> None:
        drain = self.drain
        drain.draining = True
        if drain.in_flight:
            logger.info("shutting down: %d request(s) in flight may finish within %.1f s", drain.in_flight, self.grace)
        if not await drain.wait_idle(self.grace - self.end_s):
            logger.info("shutting down: ending %d request(s) still running", drain.in_flight)
            drain.end()
            await drain.wait_idle(self.end_s)
        if sig is None:
            self.should_exit = True
        else:
            super().handle_exit(sig, None)  # and uvicorn re-raises the signal once it has shut down
