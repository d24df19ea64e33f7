"""The guard in front of every route, in order: the Host allow-list (DNS rebinding), the Origin
check (web pages), the API key, JSON-only POST bodies (a text/plain POST needs no CORS
preflight), 503 while the server shuts down (drain.py), and per-route HTTP status counts. Pure
ASGI, so streaming responses and client-disconnect cancellation pass through untouched."""
from __future__ import annotations

import hmac
from typing import Iterable

from qsaserve.server.errors import error_response, shutting_down_response
from qsaserve.server.state import ServerState

OPEN_PATHS = {"/health"}  # reachable without the API key (load balancers probe it)
ROUTES = {
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
    "/tokenizer_info", "/version", "/health", "/metrics",
}
# The names a loopback address goes by; a server bound to loopback answers only to these unless
# told otherwise (--allowed-hosts).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(value: str) -> str:
    """'[::1]:8000' -> '::1', 'LocalHost.:80' -> 'localhost'."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1:value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


class HostPatterns:
    """Exact names and '*.domain' wildcards (as Starlette's TrustedHostMiddleware); '*' alone
    allows any host."""

    def __init__(self, patterns: Iterable[str]):
        self.patterns = [host_name(p) if not p.startswith("*.") else p.lower() for p in patterns]
        self.any = "*" in self.patterns

    def allows(self, host: str) -> bool:
        return self.any or any(host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in self.patterns)


class GuardMiddleware:
    def __init__(self, app, state: ServerState, allowed_hosts: Iterable[str] | None, allowed_origins: Iterable[str]):
        self.app = app
        self.state = state
        self._expected = f"Bearer {state.api_key}".encode() if state.api_key else None
        self._hosts = HostPatterns(allowed_hosts) if allowed_hosts is not None else None
        self._origins = set(allowed_origins)

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
            refusal = self._refusal(scope, path)
            if refusal is None and self.state.drain.draining:
                refusal = shutting_down_response()
            if refusal is not None:
                await refusal(scope, receive, send_wrapper)
            else:
                await self.state.drain.run(self.app, scope, receive, send_wrapper)
        finally:
            route = path if path in ROUTES else "other"
            self.state.metrics.http_requests.labels(route, str(status[0])).inc()

    def _refusal(self, scope, path: str):
        """The error response that refuses this request before any route sees it, or None."""
        headers = {}
        for name, value in scope.get("headers", ()):
            if name in (b"host", b"origin", b"authorization", b"content-type"):
                headers.setdefault(name, value.decode("latin-1"))
        host = headers.get(b"host")
        if self._hosts is not None and host is not None and not self._hosts.allows(host_name(host)):
            return error_response(400, f"Host: {host!r} is not a name this server answers to (a page on another site "
                                       "may be reaching a local server through DNS rebinding); start it with "
                                       "--allowed-hosts to add names", param="Host", code="invalid_host")
        origin = headers.get(b"origin")
        if origin is not None and "*" not in self._origins and origin not in self._origins:
            return error_response(400, f"Origin: requests from web pages at {origin!r} are not allowed; start the "
                                       "server with --allowed-origins to allow them", param="Origin",
                                  code="origin_not_allowed")
        if self._expected is not None and path not in OPEN_PATHS:
            given = headers.get(b"authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self._expected):
                return error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if scope.get("method") == "POST":
            media_type = headers.get(b"content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                shown = repr(headers[b"content-type"]) if b"content-type" in headers else "missing"
                return error_response(400, f"Content-Type: request bodies must be JSON, sent as 'application/json' "
                                           f"(got {shown})", param="Content-Type", code="invalid_content_type")
        return None
