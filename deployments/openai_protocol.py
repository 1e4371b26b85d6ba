"""OpenAI-compatible request models, response bodies, stream chunks and error bodies.

No Ray here: the ingress turns these into ``GenerateRequest`` objects and back.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from engine.request import GenerateRequest, GenerateResult, TokenDelta


class StreamOptions(BaseModel):
    include_usage: bool = False


MAX_STOP_SEQUENCES = 4          # as OpenAI
MAX_STOP_CHARS = 256
# Parameters OpenAI defines that this server does not implement: refused by name, never ignored.
UNIMPLEMENTED = ("response_format", "tools", "tool_choice", "functions", "function_call", "logit_bias", "best_of",
                 "suffix", "parallel_tool_calls", "top_logprobs", "prediction", "audio", "modalities",
                 "reasoning_effort", "web_search_options")
# Harmless fields clients send that change nothing here.
IGNORED = ("user", "metadata", "store", "service_tier")


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are checked by name in _check_common

    model: str
    max_tokens: Optional[int] = Field(default=None)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = 1
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None


class UnsupportedParameter(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check_common(body: _Common) -> None:
    extra = body.model_extra or {}
    for name in UNIMPLEMENTED:
        value = extra.get(name)
        if value is None or (name == "response_format" and value == {"type": "text"}):
            continue
        raise UnsupportedParameter(name, f"{name} is not supported by this server")
    unknown = sorted(set(extra) - set(UNIMPLEMENTED) - set(IGNORED))
    if unknown:
        raise UnsupportedParameter(unknown[0], f"unknown parameter {unknown[0]!r}")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise UnsupportedParameter("stop", f"stop takes at most {MAX_STOP_SEQUENCES} sequences of at most "
                                           f"{MAX_STOP_CHARS} characters")
    if body.n != 1:
        raise UnsupportedParameter("n", f"n={body.n} is not supported; only n=1")
    if body.logprobs not in (None, False):
        raise UnsupportedParameter("logprobs", "logprobs are not supported")
    if body.presence_penalty or body.frequency_penalty:
        raise UnsupportedParameter("presence_penalty", "presence/frequency penalties are not supported")


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text":
            raise UnsupportedParameter("messages", f"message content of type {part.get('type')!r} is not supported")
        parts.append(part.get("text", ""))
    return "".join(parts)


def to_generate_request(body: Union[CompletionRequest, ChatCompletionRequest], adapter: Optional[str],
                        default_max_tokens: int) -> GenerateRequest:
    _check_common(body)
    common = dict(
        adapter=adapter, temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stop,
        stream=body.stream,
    )
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
        messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
        return GenerateRequest(messages=messages, max_tokens=max_tokens, **common)
    if body.echo:
        raise UnsupportedParameter("echo", "echo is not supported")
    max_tokens = body.max_tokens if body.max_tokens is not None else 16  # OpenAI's default for completions
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise UnsupportedParameter("prompt", "batched prompts are not supported; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return GenerateRequest(token_ids=list(prompt), max_tokens=max_tokens, **common)
    return GenerateRequest(prompt=prompt, max_tokens=max_tokens, **common)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_body(result: GenerateResult, model: str, rid: str, chat: bool) -> dict:
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "finish_reason": result.finish_reason, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": result.usage}


def stream_chunk(delta: Optional[TokenDelta], model: str, rid: str, chat: bool, *, first: bool = False,
                 usage: Optional[dict] = None) -> str:
    """One server-sent event in OpenAI's chunk format (``usage`` alone makes the final usage chunk)."""
    created = int(time.time())
    if usage is not None:
        choices: list = []
    elif chat:
        content = {"role": "assistant", "content": ""} if first else ({"content": delta.text} if delta.text else {})
        choices = [{"index": 0, "delta": content, "finish_reason": None if first else delta.finish_reason,
                    "logprobs": None}]
    else:
        choices = [{"index": 0, "text": delta.text, "finish_reason": delta.finish_reason, "logprobs": None}]
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


STREAM_DONE = "data: [DONE]\n\n"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
                410: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout_error"}


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}
