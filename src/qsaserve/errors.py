"""Error types shared by the engine, the offline API and the server."""


class InvalidRequestError(ValueError):
    """A request parameter is invalid. `param` names it (the server maps this to HTTP 400)."""

    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(f"{param}: {message}")


class EngineDeadError(RuntimeError):
    """The engine loop or a worker died; no further request can be served."""
