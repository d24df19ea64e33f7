"""The guard in front of every route: API key and per-route HTTP status counts."""
from __future__ import annotations

import hmac

from qsaserve.server.errors import error_response
from qsaserve.server.state import ServerState

OPEN_PATHS = {"/health"}  # reachable without the API key (load balancers probe it)
ROUTES = {
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
    "/tokenizer_info", "/version", "/health", "/metrics",
}


class GuardMiddleware:
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
            if self._expected is not None and path not in OPEN_PATHS and not self._authorized(scope):
                resp = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            route = path if path in ROUTES else "other"
            self.state.metrics.http_requests.labels(route, str(status[0])).inc()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False
