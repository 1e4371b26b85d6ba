"""Per-request sampling parameters on the demo model, against transformers' own logits processors
(repetition penalty, min_new_tokens, several EOS ids) or a per-token reference loop (presence and
frequency penalties); ``n`` samples forked after one prefill; the checks that refuse bad values."""

from __future__ import annotations

import asyncio

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.errors import InvalidRequestError
from engine.request import GenerateRequest

PROMPT = [1, *range(40, 52)]


def engine_for(model_dir, model=None, tokenizer=None, **args) -> LoRAEngine:
    settings = dict(base_model=str(model_dir), max_loras_per_batch=3, max_lora_rank=16, max_batch_size=8,
                    max_model_len=256, max_tokens_limit=64)
    return LoRAEngine(AppArgs(**{**settings, **args}).engine_config(), model=model, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def engine(demo_assets):
    eng = engine_for(demo_assets.model_dir)
    for name, path in demo_assets.adapters.items():
        eng.register_adapter(name, str(path))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(demo_assets):
    """transformers + PEFT with the demo-0 adapter (the engine's equal, checked by test_engine_peft)."""
    base = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir).eval()
    return peft.PeftModel.from_pretrained(base, demo_assets.adapters["demo-0"], adapter_name="demo-0").eval()


def run_together(engine, requests):
    async def together():
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    return asyncio.run(together())


def reference_penalised_greedy(model, prompt, steps, presence, frequency):
    """One token at a time: the full forward's last logits minus OpenAI's penalties, then argmax."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
    return out


def test_penalties_match_the_references_in_one_batch(engine, reference):
    requests = [GenerateRequest(adapter="demo-0", token_ids=PROMPT, max_tokens=24, repetition_penalty=1.4),
                GenerateRequest(adapter="demo-0", token_ids=PROMPT, max_tokens=24, presence_penalty=1.5,
                                frequency_penalty=0.7),
                GenerateRequest(adapter="demo-0", token_ids=PROMPT, max_tokens=24)]
    repetition, presence, plain = run_together(engine, requests)
    with torch.no_grad():
        expected = reference.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                                      repetition_penalty=1.4, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert repetition.token_ids == expected
    assert presence.token_ids == reference_penalised_greedy(reference, PROMPT, 24, 1.5, 0.7)
    assert plain.token_ids != repetition.token_ids and plain.token_ids != presence.token_ids  # they did act


def test_min_tokens_stop_token_ids_and_ignore_eos(demo_assets):
    """A model with a second EOS id (as Llama 3 has): it ends generation unless ignore_eos; min_tokens
    holds it back as transformers' min_new_tokens does; stop_token_ids end generation as EOS does."""
    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    with torch.no_grad():
        free = model.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
    second_eos = free[3]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, second_eos]
    eng = engine_for(demo_assets.model_dir, model=model, tokenizer=tokenizer)
    try:
        ends = eng.generate_blocking(GenerateRequest(token_ids=PROMPT, max_tokens=12))
        assert ends.token_ids == free[:free.index(second_eos) + 1] and ends.finish_reason == "stop"
        ignored = eng.generate_blocking(GenerateRequest(token_ids=PROMPT, max_tokens=12, ignore_eos=True))
        assert ignored.token_ids == free and ignored.finish_reason == "length"
        held = eng.generate_blocking(GenerateRequest(token_ids=PROMPT, max_tokens=12, min_tokens=6))
        with torch.no_grad():
            expected = model.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                      min_new_tokens=6, pad_token_id=0)[0, len(PROMPT):].tolist()
        assert held.token_ids == expected and second_eos not in held.token_ids[:6]
        stopped = eng.generate_blocking(GenerateRequest(token_ids=PROMPT, max_tokens=12, ignore_eos=True,
                                                        stop_token_ids=[free[1]]))
        assert stopped.token_ids == free[:2] and stopped.finish_reason == "stop"
    finally:
        eng.shutdown()


def test_n_samples_fork_after_one_prefill_and_reproduce_with_a_seed(engine):
    prompt = [1, *range(60, 100)]  # 41 tokens: two full KV blocks and a partial one
    before = engine.prompt_tokens_computed
    result = engine.generate_blocking(GenerateRequest(adapter="demo-1", token_ids=prompt, max_tokens=8, n=4,
                                                      temperature=1.0, seed=11, logprobs=1))
    assert engine.prompt_tokens_computed - before == len(prompt)  # the prompt was prefilled once for all four
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.completion_tokens == sum(len(c.token_ids) for c in result.choices) == 32
    assert result.prompt_tokens == len(prompt)
    assert len({tuple(c.token_ids) for c in result.choices}) > 1
    assert all(len(c.logprobs) == len(c.token_ids) for c in result.choices)
    again = engine.generate_blocking(GenerateRequest(adapter="demo-1", token_ids=prompt, max_tokens=8, n=4,
                                                     temperature=1.0, seed=11))
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in result.choices]
    # choice i is the sample seed + i gives alone
    solo = engine.generate_blocking(GenerateRequest(adapter="demo-1", token_ids=prompt, max_tokens=8,
                                                    temperature=1.0, seed=13))
    assert solo.token_ids == result.choices[2].token_ids
    assert engine.cache.allocator.num_used == 0  # every fork gave its blocks back


def test_top_k_reaches_the_sampler_of_its_own_row(engine):
    """In one batch: top_k 1 at temperature 2 is the greedy continuation; its neighbour without top_k samples."""
    async def both():
        return await asyncio.gather(*(engine.generate(GenerateRequest(
            adapter="demo-0", token_ids=PROMPT, max_tokens=8, temperature=2.0, seed=5, top_k=k, ignore_eos=True))
            for k in (1, 0)))

    greedy = engine.generate_blocking(GenerateRequest(adapter="demo-0", token_ids=PROMPT, max_tokens=8,
                                                      ignore_eos=True))
    top1, free = asyncio.run(both())
    assert top1.token_ids == greedy.token_ids and free.token_ids != greedy.token_ids


def test_n_samples_stream_with_their_index_and_free_their_blocks(engine):
    async def collect():
        return [d async for d in engine.generate_stream(
            GenerateRequest(adapter="demo-2", prompt="fork me", max_tokens=5, n=3, temperature=1.0, seed=1),
            with_result=True)]

    items = asyncio.run(collect())
    result, deltas = items[-1], items[:-1]
    for choice in result.choices:
        assert [d.token_id for d in deltas if d.index == choice.index] == choice.token_ids
    held = sum(1 for b in range(engine.cache.num_blocks) if engine.cache.allocator.refs(b))
    assert held == 0


def test_chat_without_max_tokens_gets_what_the_context_leaves(demo_assets):
    eng = engine_for(demo_assets.model_dir, max_model_len=64, max_tokens_limit=48)
    try:
        messages = [{"role": "user", "content": "x" * 30}]
        prompt_len = len(eng.inputs.prompt_ids(GenerateRequest(messages=messages)))
        result = eng.generate_blocking(GenerateRequest(messages=messages, max_tokens=None, ignore_eos=True))
        assert result.completion_tokens == 64 - prompt_len < 48
        short = eng.generate_blocking(GenerateRequest(messages=[{"role": "user", "content": "x"}], max_tokens=None,
                                                      ignore_eos=True))
        assert short.completion_tokens == 48  # capped by max_tokens_limit
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(n=17), "n"), (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(stop_token_ids=[10 ** 9]), "stop_token_ids"),
    (dict(stop_token_ids="2"), "stop_token_ids"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-1), "top_k"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}),
     "response_format"),
])
def test_bad_output_parameters_are_refused_by_name_before_any_work(engine, kwargs, field):
    steps = engine.steps
    with pytest.raises(InvalidRequestError) as err:
        engine.generate_blocking(GenerateRequest(prompt="x", **{"max_tokens": 4, **kwargs}))
    assert err.value.field == field and field in str(err.value)
    assert engine.steps == steps


def test_n_samples_without_batch_room_queue_and_still_match(demo_assets):
    """Samples that find no batch place wait as plain sequences: same choices, the prompt's full blocks reused."""
    eng = engine_for(demo_assets.model_dir, max_batch_size=2)
    try:
        prompt = [1, *range(60, 100)]
        request = dict(token_ids=prompt, max_tokens=6, n=4, temperature=1.0, seed=21, logprobs=0, prompt_logprobs=1)
        hits_before = eng.cache.allocator.prefix_hits
        queued = eng.generate_blocking(GenerateRequest(**request))
        assert len(queued.choices) == 4 and len(queued.prompt_logprobs) == len(prompt)
        assert eng.cache.allocator.prefix_hits > hits_before  # the queued samples took the prompt's blocks
        for choice in queued.choices:
            solo = eng.generate_blocking(GenerateRequest(token_ids=prompt, max_tokens=6, temperature=1.0,
                                                         seed=21 + choice.index))
            assert choice.token_ids == solo.token_ids
        assert eng.cache.allocator.num_used == 0
    finally:
        eng.shutdown()


def test_prefill_heavy_steps_are_timed_for_the_routers_prefill_rate(engine):
    """A 201-token prompt's prefill step is timed (prompt tokens and seconds, what the worker reports as seconds
    per token); a short prompt's step, mostly decode overhead, is not. On the CPU the 201 tokens are fed in chunks of
    ``long_prefill_chunk_tokens`` (64), each step only its chunk: every one of them is timed."""
    from engine.step_loop import PREFILL_TIMED_MIN_TOKENS

    tokens, seconds = engine.prefill_timed
    engine.generate_blocking(GenerateRequest(adapter="demo-0", token_ids=PROMPT, max_tokens=2))
    assert engine.prefill_timed == (tokens, seconds)  # 13 prompt tokens: not a prefill-heavy step
    engine.generate_blocking(GenerateRequest(adapter="demo-0", token_ids=[1, *range(40, 240)], max_tokens=2))
    after_tokens, after_seconds = engine.prefill_timed
    assert after_tokens - tokens >= PREFILL_TIMED_MIN_TOKENS and after_seconds > seconds
