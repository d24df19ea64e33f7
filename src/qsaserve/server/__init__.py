"""OpenAI-compatible HTTP server: `build_app` makes the FastAPI app, `qsaserve serve` runs it."""
from qsaserve.server.app import build_app

__all__ = ["build_app"]
