"""The Batch API's refusals: each carries the HTTP status, OpenAI's error `type`, the field at
fault (`param`) and a stable `code`, and the API answers it in OpenAI's error shape."""

from __future__ import annotations


class BatchError(Exception):
    """A refusal the API answers with OpenAI's error shape."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind
