"""OpenAI-shaped error answers: `{"error": {"message", "type", "param", "code"}}`.

`ClientError` carries the HTTP status, the OpenAI `type`, the field at fault (`param`) and a
stable `code` a client can branch on; `Retry-After` goes with 429 and 503 answers.
"""

from __future__ import annotations

import re

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


# "max_tokens=1000000 cannot be greater than …": the field an engine's message is about.
_FIELD_IN_MESSAGE = re.compile(r"\b([a-z_][a-z0-9_]*)\s*=")
_ENGINE_CODES = {400: "invalid_value", 401: "invalid_api_key", 403: "permission_denied",
                 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                 422: "invalid_value", 429: "rate_limit_exceeded"}


def engine_error(status: int, body: bytes) -> ClientError | None:
    """An engine's 4xx JSON answer in the edge's own shape: the engine's status and message,
    the field at fault from the engine's `param` (vLLM 0.32 names it, older ones send null;
    a validation error's `body.` prefix is dropped) or else from the message ("max_tokens=…");
    None if the body is not an error the edge can read."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(document, dict):
        return None
    error = document.get("error", document)  # vLLM ≥ 0.9 nests it; older ones do not
    if not isinstance(error, dict):
        return None
    message = error.get("message")
    if not isinstance(message, str):
        detail = error.get("detail")
        if not isinstance(detail, str):
            return None
        message = detail
    param = error.get("param")
    if not isinstance(param, str) or not param:
        found = _FIELD_IN_MESSAGE.search(message)
        param = found.group(1) if found else None
    elif param.startswith("body."):
        param = param[5:]
    type_ = "not_found_error" if status == 404 else "invalid_request_error"
    return ClientError(status, message, code=_ENGINE_CODES.get(status, "invalid_request"),
                       type_=type_, param=param)
