"""OpenAI-shaped errors: the exception every route raises, and a failed Omni call turned into one."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc
from omnistage.common.runtime.errors import RETRY_PUSHBACK_KEY
from starlette.responses import JSONResponse


def printable(text: str) -> str:
    """`text` as UTF-8 can carry it: a lone UTF-16 surrogate a client sent is written as `\\ud800`."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class HttpError(Exception):
    """An OpenAI-style error response: status, message, type, code, param and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        param = None if self.param is None else printable(self.param)
        return {
            "error": {
                "message": printable(self.message),
                "type": self.type,
                "param": param,
                "code": self.code,
            }
        }


def bad_request(param: str, message: str) -> HttpError:
    return HttpError(400, f"{param}: {message}", param=param, code="invalid_value")


def error_response(err: HttpError, request_id: str = "") -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def retry_headers(ms: int) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) and retry-after-ms (which the openai client prefers)."""
    return {"Retry-After": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}


def busy(message: str, retry_after_ms: int = 1000) -> HttpError:
    """Not now (the front's own bound): 429 with Retry-After, as the gateway's RESOURCE_EXHAUSTED."""
    return HttpError(
        429,
        message,
        type="rate_limit_error",
        code="resource_exhausted",
        headers=retry_headers(retry_after_ms),
    )


_C = grpc.StatusCode
# The statuses whose message names the request field at fault ("<field>: why"): a bad request (400).
_NAMES_A_FIELD = frozenset({_C.INVALID_ARGUMENT, _C.OUT_OF_RANGE, _C.FAILED_PRECONDITION})
# (HTTP status, OpenAI error type) ← the gRPC statuses that become it; any other is a 500.
_HTTP_OF: tuple[tuple[int, str, frozenset[grpc.StatusCode]], ...] = (
    (400, "invalid_request_error", _NAMES_A_FIELD),
    (401, "authentication_error", frozenset({_C.UNAUTHENTICATED})),
    (403, "permission_error", frozenset({_C.PERMISSION_DENIED})),
    (404, "not_found_error", frozenset({_C.NOT_FOUND})),
    (409, "conflict_error", frozenset({_C.ALREADY_EXISTS, _C.ABORTED})),
    (429, "rate_limit_error", frozenset({_C.RESOURCE_EXHAUSTED})),
    (499, "cancelled", frozenset({_C.CANCELLED})),
    (501, "server_error", frozenset({_C.UNIMPLEMENTED})),
    (503, "service_unavailable", frozenset({_C.UNAVAILABLE})),
    (504, "timeout", frozenset({_C.DEADLINE_EXCEEDED})),
)
_STATUS = {code: (status, kind) for status, kind, codes in _HTTP_OF for code in codes}


def pushback_ms(trailing: Iterable[tuple[str, Any]] | None) -> int | None:
    """The gateway's `grpc-retry-pushback-ms` trailer, or None."""
    for key, value in trailing or ():
        if key.lower() == RETRY_PUSHBACK_KEY:
            try:
                return max(0, int(value.decode() if isinstance(value, bytes) else value))
            except ValueError:
                return None
    return None


def from_grpc(
    code: grpc.StatusCode,
    details: str | None,
    trailing: Iterable[tuple[str, Any]] | None = (),
    param_of: Callable[[str], str | None] | None = None,
) -> HttpError:
    """The HTTP error of a failed Omni call; `param_of(details)` names the OpenAI field a refusal's
    message names (omni_params.py), when the route gives one."""
    details = details or code.name
    status, kind = _STATUS.get(code, (500, "server_error"))
    headers: dict[str, str] = {}
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "larger than max" in details:  # gRPC's own message-size limit: the body, not the load
            return HttpError(413, details, code="request_too_large")
        ms = pushback_ms(trailing)
        headers = retry_headers(ms if ms is not None else 1000)
    param = param_of(details) if param_of is not None and code in _NAMES_A_FIELD else None
    return HttpError(status, details, type=kind, code=code.name.lower(), param=param, headers=headers)
