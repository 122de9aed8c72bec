"""Errors a user can cause. Each names the field and the limit; it ends one request only."""


class InvalidRequest(ValueError):
    """A request that can never run as asked (bad parameter, prompt too long, ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(ValueError):
    """The model path, format or architecture cannot be served."""
