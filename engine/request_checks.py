"""Checks of a request's output parameters (n, log-probabilities, penalties, stop tokens): errors name the field.

Run by ``InputProcessor`` on the caller's thread, so a bad value costs no step. The same
limits hold for HTTP and for ``DeploymentHandle`` callers, who build ``GenerateRequest``s
themselves.
"""

from __future__ import annotations

import math

from .errors import InvalidRequestError
from .request import MAX_LOGPROBS, GenerateRequest

MAX_N = 16  # parallel samples per request
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency, as OpenAI


def _number(request: GenerateRequest, name: str) -> float:
    value = getattr(request, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(name, f"{name} must be a finite number, got {value!r}")
    return value


def _count(request: GenerateRequest, name: str, low: int, high: int) -> None:
    value = getattr(request, name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(name, f"{name} must be an integer in [{low}, {high}], got {value!r}")


def check_output_params(request: GenerateRequest, vocab_size: int) -> None:
    _count(request, "n", 1, MAX_N)
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(request, name) is not None:
            _count(request, name, 0, MAX_LOGPROBS)
    for name in ("presence_penalty", "frequency_penalty"):
        if not PENALTY_RANGE[0] <= _number(request, name) <= PENALTY_RANGE[1]:
            raise InvalidRequestError(name, f"{name} must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], "
                                            f"got {getattr(request, name)}")
    if not 0 < _number(request, "repetition_penalty") <= 10:
        raise InvalidRequestError("repetition_penalty", f"repetition_penalty must be in (0, 10], "
                                                        f"got {request.repetition_penalty}")
    _count(request, "min_tokens", 0, 1 << 20)
    if request.max_tokens is not None and request.min_tokens > request.max_tokens:
        raise InvalidRequestError("min_tokens", f"min_tokens ({request.min_tokens}) exceeds max_tokens "
                                                f"({request.max_tokens})")
    ids = request.stop_token_ids
    if ids is not None and (not isinstance(ids, list) or len(ids) > 64 or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids)):
        raise InvalidRequestError("stop_token_ids", f"stop_token_ids must be a list of at most 64 token ids in "
                                                    f"[0, {vocab_size})")
    if not isinstance(request.ignore_eos, bool):
        raise InvalidRequestError("ignore_eos", f"ignore_eos must be true or false, got {request.ignore_eos!r}")
    if request.max_tokens == 0 and request.prompt_logprobs is None:
        raise InvalidRequestError("max_tokens", "max_tokens must be a positive integer (0 only with echo, to "
                                                "score the prompt)")
