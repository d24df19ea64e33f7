"""Request limits shared by the app and the `serve` flags (importable without FastAPI)."""

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_TOKENIZER_POOL_SIZE = 4
