"""HTTP status and OpenAI error body for every error family, installed as FastAPI handlers.

The layers below raise typed errors and know nothing of HTTP; this table is the one place
that decides what a client sees. Errors that crossed a Ray call arrive as Ray's task-error
wrapper (an instance of the cause's class too), so each handler unwraps to the cause first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import RayActorError

from engine.errors import (
    AdapterExistsError,
    AdapterUnregisteredError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnhealthyError,
    InvalidRequestError,
    RequestCancelledError,
)
from pool.errors import (
    AdapterError,
    AdapterNotFoundError,
    BatchTooLargeError,
    LoRAFleetError,
    PoolError,
    SourceAccessDeniedError,
    SourceBackendMissingError,
    SourceNotAllowedError,
    SourceUnavailableError,
)

from .content_version import SourceChangedError
from .openai_protocol import UnsupportedParameter, error_body
from .registry import RegistryConflictError, RegistryWriteError

log = logging.getLogger("ray.serve")


class HTTPError(Exception):
    """An error the ingress itself decides (auth, queue bound, timeout), with its status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after

    def __reduce__(self):  # crosses Ray calls to handle callers: keep every field
        return (HTTPError, (self.status, str(self), self.param, self.code, self.retry_after))


@dataclass(frozen=True)
class ErrorFamily:
    status: int
    code: Optional[str] = None        # OpenAI's error.code; None: the exception's class name
    retry_after: Optional[int] = None
    message: Optional[str] = None     # a fixed message, where the exception's own would leak internals


# Starlette picks the handler of the most specific class in the exception's MRO, so a
# subclass listed here overrides its base (AdapterNotFoundError over AdapterError, ...).
ERROR_FAMILIES: dict[type[BaseException], ErrorFamily] = {
    InvalidRequestError: ErrorFamily(400, "invalid_request"),
    UnsupportedParameter: ErrorFamily(400, "unsupported_parameter"),
    ValidationError: ErrorFamily(400, "invalid_request"),
    ValueError: ErrorFamily(400, "invalid_request"),
    AdapterNotFoundError: ErrorFamily(404, "model_not_found"),
    SourceNotAllowedError: ErrorFamily(403),
    SourceAccessDeniedError: ErrorFamily(403),
    SourceBackendMissingError: ErrorFamily(501),
    SourceUnavailableError: ErrorFamily(503, retry_after=1),
    AdapterError: ErrorFamily(400),
    BatchTooLargeError: ErrorFamily(400),
    AdapterExistsError: ErrorFamily(409),
    PoolError: ErrorFamily(409),
    AdapterUnregisteredError: ErrorFamily(410),
    EngineShutdownError: ErrorFamily(503, retry_after=1),
    EngineOverloadedError: ErrorFamily(503, "overloaded", retry_after=1),
    EngineUnhealthyError: ErrorFamily(503, "replica_unhealthy", retry_after=1),
    RequestCancelledError: ErrorFamily(499, "cancelled"),
    RegistryWriteError: ErrorFamily(503, "registry_unavailable", retry_after=1),
    RegistryConflictError: ErrorFamily(409, "registry_conflict"),
    SourceChangedError: ErrorFamily(409, "source_changed"),
    RayActorError: ErrorFamily(503, "replica_unavailable", retry_after=1,
                               message="the replica serving this request was lost; retry the request"),
    LoRAFleetError: ErrorFamily(500),
}


def unwrap(exc: BaseException) -> BaseException:
    """The user-level exception inside Ray's task-error wrapper."""
    from ray.exceptions import RayTaskError

    while isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return exc


def _param_of(exc: BaseException) -> Optional[str]:
    if isinstance(exc, InvalidRequestError):
        return exc.field
    if isinstance(exc, UnsupportedParameter):
        return exc.param
    if isinstance(exc, AdapterNotFoundError):
        return "model"
    return None


def family_of(exc: BaseException) -> Optional[ErrorFamily]:
    for cls in type(exc).__mro__:
        if cls in ERROR_FAMILIES:
            return ERROR_FAMILIES[cls]
    return None


def status_of(exc: BaseException) -> int:
    """The HTTP status a client gets for ``exc`` (500 for anything unexpected)."""
    exc = unwrap(exc)
    if isinstance(exc, HTTPError):
        return exc.status
    family = family_of(exc)
    return family.status if family else 500


def error_response(exc: BaseException) -> JSONResponse:
    """OpenAI's error body with the family's status (and Retry-After where retrying helps)."""
    exc = unwrap(exc)
    if isinstance(exc, HTTPError):
        status, param, code, retry_after = exc.status, exc.param, exc.code, exc.retry_after
        message = str(exc)
    else:
        family = family_of(exc)
        if family is None:
            log.error("lorafleet ingress: unexpected error", exc_info=exc)
            return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
        status, param, retry_after = family.status, _param_of(exc), family.retry_after
        code = family.code or type(exc).__name__
        message = family.message or str(exc)
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


async def _handle(_: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


async def _handle_request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = f"invalid field {field}: {first.get('msg', 'invalid request')}" if field else \
        f"the request body must be a JSON object ({first.get('msg', 'invalid request')})"
    return JSONResponse(error_body(400, message, field, "invalid_request"), status_code=400)


def install_error_handlers(app: FastAPI) -> None:
    """One handler per family, plus FastAPI's own body-validation errors as 400 naming the field."""
    app.add_exception_handler(RequestValidationError, _handle_request_validation)
    app.add_exception_handler(HTTPError, _handle)
    for family in ERROR_FAMILIES:
        app.add_exception_handler(family, _handle)
    app.add_exception_handler(Exception, _handle)
