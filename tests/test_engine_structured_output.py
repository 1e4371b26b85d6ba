"""``response_format`` through the engine: sampled outputs (temperature 1, with an adapter) all parse and
validate against their schema; grammars are compiled once per schema; json_object gives an object."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.request import GenerateRequest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"]},
    },
    "required": ["name", "age", "colour", "tags", "address"],
}


@pytest.fixture(scope="module")
def engine(demo_assets):
    eng = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=3, max_lora_rank=16,
                             max_batch_size=32, max_model_len=256, max_tokens_limit=160).engine_config())
    for name, path in demo_assets.adapters.items():
        eng.register_adapter(name, str(path))
    yield eng
    eng.shutdown()


def test_every_sampled_output_validates_against_the_schema(engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    requests = [GenerateRequest(adapter=f"demo-{i % 3}", prompt=f"person {i}:", max_tokens=160, temperature=1.0,
                                seed=i, n=4, response_format=fmt) for i in range(25)]
    compiled_before = engine.grammar.compiled

    async def together():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    outputs = [c for result in asyncio.run(together()) for c in result.choices]
    assert len(outputs) == 100
    for choice in outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert len({c.text for c in outputs}) > 50  # really sampled
    assert engine.grammar.compiled - compiled_before <= 1  # one schema, compiled once (or cached already)


def test_unconstrained_sampling_does_not_give_json(engine):
    """The control: the same requests without the grammar do not parse (so the grammar did the work)."""
    results = [engine.generate_blocking(GenerateRequest(adapter="demo-0", prompt=f"person {i}:", max_tokens=40,
                                                        temperature=1.0, seed=i)) for i in range(3)]
    for result in results:
        with pytest.raises(json.JSONDecodeError):
            json.loads(result.text)


def test_json_object_gives_an_object_and_mixes_with_free_requests(engine):
    requests = [GenerateRequest(adapter="demo-1", prompt="obj", max_tokens=160, temperature=0.0,
                                response_format={"type": "json_object"}),
                GenerateRequest(adapter="demo-1", prompt="obj", max_tokens=20, temperature=0.0)]

    async def together():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    constrained, free = asyncio.run(together())
    assert constrained.finish_reason == "stop" and isinstance(json.loads(constrained.text), dict)
    alone = engine.generate_blocking(GenerateRequest(adapter="demo-1", prompt="obj", max_tokens=20))
    assert free.token_ids == alone.token_ids  # the mask touched only its own row
