"""Every error family maps to one HTTP status and an OpenAI error body, also through Ray's task-error wrapper."""

from __future__ import annotations

import json

import pytest
from ray.exceptions import RayTaskError

from deployments.http_errors import HTTPError, error_response, status_of
from deployments.openai_protocol import UnsupportedParameter
from engine.errors import AdapterExistsError, AdapterUnregisteredError, EngineShutdownError, InvalidRequestError
from pool.errors import (
    AdapterNotFoundError,
    BatchTooLargeError,
    CorruptWeightsError,
    NoEvictableSlotError,
    PickleWeightsRefusedError,
    PinRefusedError,
    RankTooLargeError,
    SourceAccessDeniedError,
    SourceBackendMissingError,
    SourceNotAllowedError,
    SourceUnavailableError,
)

pytestmark = pytest.mark.unit

CASES = [
    (InvalidRequestError("top_p", "top_p must be in (0, 1]"), 400, "top_p"),
    (UnsupportedParameter("n", "n=2 is not supported"), 400, "n"),
    (AdapterNotFoundError("adapter 'x' is not registered"), 404, "model"),
    (SourceNotAllowedError("outside the allow-list"), 403, None),
    (SourceAccessDeniedError("credentials refused"), 403, None),
    (SourceBackendMissingError("install s3fs"), 501, None),
    (SourceUnavailableError("endpoint unreachable"), 503, None),
    (PickleWeightsRefusedError("pickle refused"), 400, None),
    (CorruptWeightsError("truncated"), 400, None),
    (RankTooLargeError("a", 64, 16), 400, None),
    (BatchTooLargeError("5 adapters, 4 slots"), 400, None),
    (AdapterExistsError("already registered"), 409, None),
    (PinRefusedError("last free slot"), 409, None),
    (NoEvictableSlotError("all pinned"), 409, None),
    (AdapterUnregisteredError("unregistered"), 410, None),
    (EngineShutdownError("stopping"), 503, None),
    (HTTPError(429, "full", code="overloaded", retry_after=1), 429, None),
    (RuntimeError("boom"), 500, None),
]


@pytest.mark.parametrize("exc,status,param", CASES, ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "")
def test_status_and_body(exc, status, param):
    response = error_response(exc)
    body = json.loads(response.body)
    assert response.status_code == status_of(exc) == status
    assert body["error"]["param"] == param
    if status == 500:
        assert "boom" not in body["error"]["message"]  # internals are not echoed
    else:
        assert body["error"]["message"] == str(exc)


def test_errors_from_a_replica_are_unwrapped():
    cause = AdapterNotFoundError("adapter 'ghost' is not registered")
    wrapped = RayTaskError("generate", "Traceback ...", cause).as_instanceof_cause()
    response = error_response(wrapped)
    assert response.status_code == 404
    assert json.loads(response.body)["error"]["message"] == "adapter 'ghost' is not registered"


def test_retry_after_where_retrying_helps():
    assert error_response(EngineShutdownError("stopping")).headers["Retry-After"] == "1"
    assert "Retry-After" not in error_response(InvalidRequestError("x", "bad")).headers


def test_ingress_errors_keep_their_fields_across_ray_calls():
    """Handle callers get the ingress's own 429/504 (pickled across the call), status and code intact."""
    import pickle

    from deployments.http_errors import HTTPError

    error = pickle.loads(pickle.dumps(HTTPError(429, "full", param="model", code="overloaded", retry_after=1)))
    assert (error.status, str(error), error.param, error.code, error.retry_after) == (429, "full", "model",
                                                                                      "overloaded", 1)
