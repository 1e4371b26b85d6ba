"""OpenAI parameters through real HTTP with the official client (and one DeploymentHandle call).

Few calls on purpose: the engine-level tests check each feature's numbers; these check that the
HTTP bodies carry them as OpenAI clients read them.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from conftest import FLEET_ARGS
from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.request import GenerateRequest

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer"},
                                           "tag": {"enum": ["a", "b"]}}, "required": ["ok", "count", "tag"]}


@pytest.fixture(scope="module")
def client(fleet, http_base):
    return openai.OpenAI(base_url=f"{http_base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local_engine(demo_assets):
    engine = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=3, max_lora_rank=16,
                                max_model_len=256, max_tokens_limit=64).engine_config())
    for name, path in demo_assets.adapters.items():
        engine.register_adapter(name, str(path))
    yield engine
    engine.shutdown()


def test_completion_logprobs_echo_and_scoring_a_prompt(client, local_engine):
    scored = client.completions.create(model="demo-1", prompt="score this", max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    direct = local_engine.generate_blocking(GenerateRequest(adapter="demo-1", prompt="score this", max_tokens=0,
                                                            prompt_logprobs=2))
    assert choice.text == "score this" and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in direct.prompt_logprobs[1:]], abs=1e-5)
    assert [len(t) for t in lp.top_logprobs[1:]] == [2] * (len(lp.tokens) - 1)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    made = client.completions.create(model="demo-1", prompt="go", max_tokens=5, temperature=0, logprobs=3, echo=True)
    direct = local_engine.generate_blocking(GenerateRequest(adapter="demo-1", prompt="go", max_tokens=5, logprobs=3))
    text, lp = made.choices[0].text, made.choices[0].logprobs
    assert text == "go" + direct.text
    assert lp.token_logprobs[-5:] == pytest.approx([e.logprob for e in direct.logprobs], abs=1e-5)
    assert lp.text_offset[-5] == len("go")  # generated offsets index the echoed text


def test_chat_n_samples_logprobs_and_stream_agree(client):
    args = dict(model="demo-3", messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3, seed=5,
                temperature=1.0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**args)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert full.usage.completion_tokens == 18
    for c in full.choices:
        assert len(c.logprobs.content) == 6 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    chunks = list(client.chat.completions.create(**args, stream=True))
    for c in full.choices:
        streamed = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert "".join(s.delta.content or "" for s in streamed) == c.message.content
        tokens = [t for s in streamed if s.logprobs for t in s.logprobs.content]
        assert [t.logprob for t in tokens] == pytest.approx([t.logprob for t in c.logprobs.content], abs=1e-5)


def test_structured_output_with_an_adapter(client):
    reply = client.chat.completions.create(
        model="demo-2", messages=[{"role": "user", "content": "json please"}], max_tokens=64, n=8,
        temperature=1.0, seed=1, response_format={"type": "json_schema",
                                                  "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}})
    assert len(reply.choices) == 8
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_null_means_default_served_name_and_context_window(fleet, http_base):
    body = {"model": "demo", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "temperature": None, "top_p": None, "n": None, "presence_penalty": None, "frequency_penalty": None,
            "stream": None, "seed": None, "max_tokens": None, "logprobs": None, "top_logprobs": None,
            "response_format": None, "stop": None, "stream_options": None, "user": None}
    reply = httpx.post(f"{http_base}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["model"] == "demo" and out["choices"][0]["logprobs"] is None
    assert out["usage"]["completion_tokens"] <= FLEET_ARGS["max_tokens_limit"]
    models = httpx.get(f"{http_base}/v1/models", timeout=30).json()["data"]
    assert models[0]["id"] == "demo"
    assert {m["max_model_len"] for m in models} == {FLEET_ARGS["max_model_len"]}


def test_the_same_parameters_through_a_deployment_handle(fleet):
    request = GenerateRequest(adapter="demo-4", prompt="handle", max_tokens=4, n=2, temperature=1.0, seed=2,
                              logprobs=1, response_format={"type": "json_object"}, repetition_penalty=1.1)
    result = fleet.generate.remote(request).result(timeout_s=60)
    assert [c.index for c in result.choices] == [0, 1] and result.completion_tokens == sum(
        len(c.token_ids) for c in result.choices)
    assert all(c.text.startswith("{") and len(c.logprobs) == len(c.token_ids) for c in result.choices)

    async def streamed():
        return [item async for item in fleet.options(stream=True).generate_stream.remote(request)]

    items = asyncio.run(streamed())
    assert {d.index for d in items[:-1]} == {0, 1} and items[-1].choices[1].token_ids == result.choices[1].token_ids
