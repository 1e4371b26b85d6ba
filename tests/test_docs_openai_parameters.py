"""docs/openai_parameters.md against the code: every row's test exists, every OpenAI parameter the
official client knows is documented, ignored on purpose, or refused by name; documented ones reach
the engine's request."""

from __future__ import annotations

import re
from pathlib import Path

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest

from deployments.openai_protocol import IGNORED, ChatCompletionRequest, CompletionRequest, UnsupportedParameter, \
    to_generate_request

ROOT = Path(__file__).parents[1]
DOC = (ROOT / "docs" / "openai_parameters.md").read_text()


def table_rows() -> list[tuple[list[str], str, str]]:
    """(parameter names, endpoints, test name) of the main table."""
    rows = []
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            names = [n.split(".")[0] for n in re.findall(r"`([a-z_.]+)`", cells[0])]
            rows.append((names, cells[1], cells[4]))
    return rows


def documented(endpoint: str) -> set[str]:
    return {n for names, where, _ in table_rows() if where in ("both", endpoint) for n in names}


def openai_parameters(module) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_every_row_names_a_test_that_exists():
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    rows = table_rows()
    assert len(rows) >= 20
    for names, _, test in rows:
        assert re.search(rf"def {re.escape(test)}\(", sources), (names, test)


def build(endpoint: str, **fields):
    if endpoint == "chat":
        return ChatCompletionRequest(model="demo-1", messages=[{"role": "user", "content": "x"}], **fields)
    return CompletionRequest(model="demo-1", prompt="x", **fields)


# a value OpenAI's client could send, for the parameters this server refuses
REFUSED_SAMPLES = {"best_of": 2, "logit_bias": {"5": 1}, "suffix": "!", "tools": [{"type": "function"}],
                   "tool_choice": "auto", "parallel_tool_calls": True, "functions": [{"name": "f"}],
                   "function_call": "auto", "audio": {"voice": "x"}, "modalities": ["audio"],
                   "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
                   "web_search_options": {}, "moderation": {}, "verbosity": "low", "prompt_cache_options": {},
                   "prompt_cache_retention": "24h"}


@pytest.mark.parametrize("endpoint, module", [("completions", completion_params), ("chat", chat_params)])
def test_every_openai_parameter_is_documented_ignored_or_refused_by_name(endpoint, module):
    for name in sorted(openai_parameters(module) - documented(endpoint) - set(IGNORED)):
        assert name in REFUSED_SAMPLES, f"{name}: neither documented nor refused"
        with pytest.raises(UnsupportedParameter) as err:
            to_generate_request(build(endpoint, **{name: REFUSED_SAMPLES[name]}), "demo-1")
        assert err.value.param == name


# documented parameter -> (a non-default value, the GenerateRequest field it must set, expected value);
# `stream` picks the worker's method (generate_stream), not a field: test_streaming_completions_and_chat covers it
EFFECTS = {
    "max_tokens": (7, "max_tokens", 7), "temperature": (0.5, "temperature", 0.5), "top_p": (0.5, "top_p", 0.5),
    "seed": (3, "seed", 3), "top_k": (5, "top_k", 5), "stop": (["x"], "stop", ["x"]), "n": (3, "n", 3),
    "presence_penalty": (1.0, "presence_penalty", 1.0), "frequency_penalty": (-1.0, "frequency_penalty", -1.0),
    "repetition_penalty": (1.2, "repetition_penalty", 1.2), "min_tokens": (2, "min_tokens", 2),
    "stop_token_ids": ([5], "stop_token_ids", [5]), "ignore_eos": (True, "ignore_eos", True),
    "response_format": ({"type": "json_object"}, "response_format", {"type": "json_object"}),
    "max_completion_tokens": (4, "max_tokens", 4),
}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_documented_parameters_reach_the_engine_request(endpoint):
    for name in sorted(documented(endpoint) & set(EFFECTS)):
        value, field, expected = EFFECTS[name]
        assert getattr(to_generate_request(build(endpoint, **{name: value}), "demo-1"), field) == expected, name
    if endpoint == "completions":
        scored = to_generate_request(build(endpoint, logprobs=3, echo=True, max_tokens=0), "demo-1")
        assert (scored.logprobs, scored.prompt_logprobs, scored.max_tokens) == (3, 3, 0)
    else:
        chat = to_generate_request(build(endpoint, logprobs=True, top_logprobs=4), "demo-1")
        assert chat.logprobs == 4 and chat.max_tokens is None  # the engine fills in what the context leaves


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_null_is_the_default_for_every_documented_parameter(endpoint):
    default = to_generate_request(build(endpoint), "demo-1")
    nullable = documented(endpoint) - {"model", "prompt", "messages"}
    nulled = to_generate_request(build(endpoint, **{n: None for n in nullable}), "demo-1")
    assert {k: v for k, v in vars(nulled).items() if k != "request_id"} == \
        {k: v for k, v in vars(default).items() if k != "request_id"}
