"""Request limits shared by the app and the `serve` flags (importable without FastAPI)."""

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
