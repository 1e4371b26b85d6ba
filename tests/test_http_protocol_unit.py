"""OpenAI request checks and the body limit, without a cluster: refused by name, nothing silently ignored."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from pydantic import ValidationError

from deployments.body_limit import BodyLimitMiddleware
from deployments.http_errors import install_error_handlers
from deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, UnsupportedParameter, \
    to_generate_request

pytestmark = pytest.mark.unit


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="demo-1", prompt="x", **fields)


@pytest.mark.parametrize("name,value", [("audio", {"voice": "x"}), ("tools", [{"type": "function"}]),
                                        ("logit_bias", {"5": 10}), ("best_of", 3), ("suffix", "!"),
                                        ("min_p", 0.1), ("tool_choice", "auto")])
def test_unimplemented_or_unknown_parameters_are_refused_by_name(name, value):
    with pytest.raises(UnsupportedParameter) as err:
        to_generate_request(completion(**{name: value}), "demo-1", 16)
    assert err.value.param == name


def test_harmless_fields_and_defaults_pass():
    request = to_generate_request(completion(user="u1", response_format={"type": "text"}, logit_bias=None), "demo-1", 16)
    assert request.prompt == "x"


@pytest.mark.parametrize("fields", [{"temperature": float("nan")}, {"temperature": float("inf")},
                                    {"temperature": -0.5}, {"temperature": 2.5}, {"top_p": 0}, {"top_p": 1.5},
                                    {"seed": -1}, {"seed": 2**64}, {"top_k": -2}, {"top_k": 1.5}])
def test_sampling_parameters_out_of_range_are_refused(fields):
    with pytest.raises(ValidationError) as err:
        completion(**fields)
    assert next(iter(fields)) in str(err.value)


@pytest.mark.parametrize("stop", [["a", "b", "c", "d", "e"], "x" * 300])
def test_stop_has_a_bounded_count_and_length(stop):
    with pytest.raises(UnsupportedParameter) as err:
        to_generate_request(completion(stop=stop), "demo-1", 16)
    assert err.value.param == "stop"


def test_chat_max_completion_tokens_wins():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5,
                                 max_tokens=9)
    assert to_generate_request(body, None, 16).max_tokens == 5


def _run_asgi(app, body_chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, dict]:
    sent: list[dict] = []
    chunks = list(body_chunks)

    async def receive():
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/echo", "headers": headers, "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def _echo_app():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.post("/parsed")
    async def parsed(body: dict):  # FastAPI reads and parses the body itself
        return {"keys": len(body)}

    app.add_middleware(BodyLimitMiddleware, max_body_bytes=1000)
    return app


def test_a_chunked_body_over_the_limit_is_refused_with_413():
    status, body = _run_asgi(_echo_app(), [b"x" * 400] * 4, [(b"transfer-encoding", b"chunked")])
    assert status == 413 and "1000 bytes" in body["error"]["message"]


def test_a_chunked_body_over_the_limit_read_by_fastapi_is_413_not_400():
    app = _echo_app()
    sent: list[dict] = []
    chunks = [b'{"a": "' + b"x" * 600, b"x" * 600 + b'"}']

    async def receive():
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/parsed", "query_string": b"", "http_version": "1.1",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
    asyncio.run(app(scope, receive, send))
    assert next(m["status"] for m in sent if m["type"] == "http.response.start") == 413


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    status, body = _run_asgi(_echo_app(), [b"x" * 10], [(b"content-length", b"5000")])
    assert status == 413 and "5000" in body["error"]["message"]


def test_a_body_under_the_limit_passes():
    status, body = _run_asgi(_echo_app(), [b"x" * 400, b"y" * 400], [(b"transfer-encoding", b"chunked")])
    assert status == 200 and body == {"bytes": 800}


def test_every_text_field_counts_toward_the_prompt_limit():
    from deployments.front_door import text_chars
    from engine.request import GenerateRequest

    request = GenerateRequest(messages=[{"role": "user", "content": "abcd"}], stop=["xy", "z"])
    assert text_chars(request) == len("user") + 4 + 3
    assert text_chars(GenerateRequest(prompt="hello")) == 5
