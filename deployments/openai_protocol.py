"""OpenAI-compatible request models, response bodies, stream chunks and error bodies.

No Ray here: the ingress turns these into ``GenerateRequest`` objects and back. ``null``
means "the default" wherever OpenAI accepts it; every parameter is either implemented
(docs/openai_parameters.md) or refused by name, never silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from engine.request import MAX_LOGPROBS, Choice, GenerateRequest, GenerateResult, TokenDelta

from .openai_logprobs import chat_logprobs, completion_logprobs


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False


MAX_STOP_SEQUENCES = 4          # as OpenAI
MAX_STOP_CHARS = 256
# Parameters OpenAI defines that this server does not implement: refused by name, never ignored.
UNIMPLEMENTED = ("tools", "tool_choice", "functions", "function_call", "logit_bias", "suffix",
                 "parallel_tool_calls", "prediction", "audio", "modalities", "reasoning_effort",
                 "web_search_options", "moderation", "verbosity", "prompt_cache_options", "prompt_cache_retention")
# Harmless fields clients send that change nothing here (identifiers, storage and tier hints; prompt
# prefixes are cached whatever the key).
IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")

Probability = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
Penalty = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are checked by name in _check_common

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Optional[float] = Probability
    n: Optional[int] = Field(default=None, ge=1)
    best_of: Optional[int] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(default=None, ge=0, le=2**63 - 1)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Penalty
    frequency_penalty: Optional[float] = Penalty
    response_format: Optional[dict] = None
    # vLLM's extra sampling parameters, which evaluation and load tools send
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=10.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(default=None, ge=-1)  # -1 and 0: every token (vLLM takes both)
    min_tokens: Optional[int] = Field(default=None, ge=0)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS, strict=True)  # a count, not a flag


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)


class UnsupportedParameter(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check_common(body: _Common) -> None:
    extra = body.model_extra or {}
    for name in UNIMPLEMENTED:
        if extra.get(name) is not None:
            raise UnsupportedParameter(name, f"{name} is not supported by this server")
    unknown = sorted(set(extra) - set(UNIMPLEMENTED) - set(IGNORED))
    if unknown:
        raise UnsupportedParameter(unknown[0], f"unknown parameter {unknown[0]!r}")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise UnsupportedParameter("stop", f"stop takes at most {MAX_STOP_SEQUENCES} sequences of at most "
                                           f"{MAX_STOP_CHARS} characters")
    if body.best_of not in (None, 1):
        raise UnsupportedParameter("best_of", f"best_of={body.best_of} is not supported (use n for several samples)")


def _message_text(index: int, message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for j, part in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if part.get("type") != "text":
            raise UnsupportedParameter("messages", f"{where}: content of type {part.get('type')!r} is not supported")
        if not isinstance(part.get("text"), str):
            raise UnsupportedParameter("messages", f"{where}.text must be a string")
        parts.append(part["text"])
    return "".join(parts)


def _default(value, default):
    return default if value is None else value


def to_generate_request(body: Union[CompletionRequest, ChatCompletionRequest], adapter: Optional[str],
                        default_max_tokens: Optional[int] = None) -> GenerateRequest:
    """``default_max_tokens``: a chat request's when it names none (None: what the context leaves)."""
    _check_common(body)
    common = dict(
        adapter=adapter, temperature=_default(body.temperature, 1.0), top_p=_default(body.top_p, 1.0),
        top_k=max(0, _default(body.top_k, 0)),
        seed=body.seed, stop=body.stop, n=_default(body.n, 1),
        presence_penalty=_default(body.presence_penalty, 0.0), frequency_penalty=_default(body.frequency_penalty, 0.0),
        repetition_penalty=_default(body.repetition_penalty, 1.0), min_tokens=_default(body.min_tokens, 0),
        stop_token_ids=body.stop_token_ids, ignore_eos=bool(body.ignore_eos), response_format=body.response_format,
    )
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs requires logprobs: true")
        max_tokens = _default(body.max_completion_tokens, _default(body.max_tokens, default_max_tokens))
        messages = [{"role": m.role, "content": _message_text(i, m)} for i, m in enumerate(body.messages)]
        logprobs = _default(body.top_logprobs, 0) if body.logprobs else None
        return GenerateRequest(messages=messages, max_tokens=max_tokens, logprobs=logprobs, **common)
    if body.echo and body.stream:
        raise UnsupportedParameter("echo", "echo with stream is not supported; send it with stream false")
    max_tokens = _default(body.max_tokens, 16)  # OpenAI's default for completions
    if max_tokens == 0 and not body.echo:
        raise UnsupportedParameter("max_tokens", "max_tokens must be at least 1 (0 only with echo, to score "
                                                 "the prompt)")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise UnsupportedParameter("prompt", "batched prompts are not supported; send one prompt per request")
        prompt = prompt[0]
    # echo always scores the prompt: it returns the prompt's text (and log-probabilities when asked)
    scoring = dict(logprobs=body.logprobs, prompt_logprobs=_default(body.logprobs, 0) if body.echo else None)
    if isinstance(prompt, list):
        return GenerateRequest(token_ids=list(prompt), max_tokens=max_tokens, **scoring, **common)
    return GenerateRequest(prompt=prompt, max_tokens=max_tokens, **scoring, **common)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def result_choices(result: GenerateResult) -> list[Choice]:
    return result.choices or [Choice(0, result.text, result.token_ids, result.finish_reason, result.logprobs)]


def completion_body(result: GenerateResult, model: str, rid: str, chat: bool,
                    body: Union[CompletionRequest, ChatCompletionRequest, None] = None) -> dict:
    created = int(time.time())
    choices = []
    for c in result_choices(result):
        if chat:
            lp = chat_logprobs(c.logprobs) if c.logprobs is not None else None
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "finish_reason": c.finish_reason, "logprobs": lp})
            continue
        text, prompt_lps = c.text, None
        if body is not None and body.echo:
            prompt_text = body.prompt if isinstance(body.prompt, str) else result.prompt_text or ""
            if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
                prompt_text = body.prompt[0]
            text, prompt_lps = prompt_text + c.text, result.prompt_logprobs
        lp = None
        if body is not None and body.logprobs is not None:
            lp = completion_logprobs(prompt_lps or [], c.logprobs or [], len(text) - len(c.text))
        choices.append({"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": lp})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": result.usage}


def _delta_logprobs(delta: TokenDelta, chat: bool) -> Optional[dict]:
    if delta.logprob is None:
        return None
    return chat_logprobs([delta.logprob]) if chat else completion_logprobs([], [delta.logprob], 0)


def stream_chunk(delta: Optional[TokenDelta], model: str, rid: str, chat: bool, *, first: bool = False,
                 usage: Optional[dict] = None) -> str:
    """One server-sent event in OpenAI's chunk format (``usage`` alone makes the final usage chunk)."""
    created = int(time.time())
    if usage is not None:
        choices: list = []
    elif chat:
        content = {"role": "assistant", "content": ""} if first else ({"content": delta.text} if delta.text else {})
        choices = [{"index": 0 if first else delta.index, "delta": content,
                    "finish_reason": None if first else delta.finish_reason,
                    "logprobs": None if first else _delta_logprobs(delta, chat)}]
    else:
        choices = [{"index": delta.index, "text": delta.text, "finish_reason": delta.finish_reason,
                    "logprobs": _delta_logprobs(delta, chat)}]
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
