"""OpenAI-compatible HTTP server: `build_app` makes the FastAPI app, `qsaserve serve` runs it.

Importing this package stays light (no FastAPI) so the main CLI can add `serve` cheaply."""

from qsaserve.server.limits import DEFAULT_MAX_REQUEST_BYTES

__all__ = ["build_app", "DEFAULT_MAX_REQUEST_BYTES"]


def __getattr__(name: str):
    if name == "build_app":
        from qsaserve.server.app import build_app

        return build_app
    raise AttributeError(f"module 'qsaserve.server' has no attribute {name!r}")
