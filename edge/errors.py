"""OpenAI-shaped error answers: `{"error": {"message", "type", "param", "code"}}`.

`ClientError` carries the HTTP status, the OpenAI `type`, the field at fault (`param`) and a
stable `code` a client can branch on; `Retry-After` goes with 429 and 503 answers.
"""

from __future__ import annotations

import orjson

# Why nothing was picked (edge.policy reasons) → (status, message for the client).
NO_PICK = {
    "no_replicas": (503, "No replica of model {model} is serving right now."),
    "residency_unavailable": (
        503, "No replica that tenant {tenant}'s data-residency rules allow is healthy for "
             "model {model}; the request was not sent elsewhere."),
    "no_healthy_replica": (503, "No healthy replica of model {model}."),
}


class ClientError(Exception):
    def __init__(self, status: int, message: str, *, code: str,
                 type_: str = "invalid_request_error", param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type_
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}})

    def headers(self) -> bytes:
        if self.retry_after_s is None:
            return b""
        return b"retry-after: %d\r\n" % self.retry_after_s


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> ClientError:
    return ClientError(400, message, code=code, param=param)


def unauthorized(message: str) -> ClientError:
    return ClientError(401, message, code="invalid_api_key")


def model_not_found(model: str) -> ClientError:
    return ClientError(404, f"The model `{model}` does not exist or you do not have access "
                            "to it.", code="model_not_found", param="model")


def unavailable(code: str, message: str, retry_after_s: int | None = 1) -> ClientError:
    return ClientError(503, message, code=code, type_="server_error",
                       retry_after_s=retry_after_s)
