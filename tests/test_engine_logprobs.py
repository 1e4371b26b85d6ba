"""Log-probabilities against the reference: ``log_softmax`` of transformers + PEFT logits, within 1e-4 (fp32).

Generated tokens' and their top-k, and echo's prompt log-probabilities, on Llama-, Mistral- and
Qwen2-shaped models, with and without adapters, from requests that share one mixed batch.
"""

from __future__ import annotations

import asyncio

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from deployments.config import AppArgs
from engine.demo import ensure_demo_assets
from engine.engine import LoRAEngine
from engine.request import GenerateRequest

TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def setup(request, tmp_path_factory):
    assets = ensure_demo_assets(tmp_path_factory.mktemp(f"lp-{request.param}"), num_adapters=3, arch=request.param)
    names = list(assets.adapters)
    ref = AutoModelForCausalLM.from_pretrained(assets.model_dir).eval()
    peft_model = peft.PeftModel.from_pretrained(ref, assets.adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(assets.adapters[name], adapter_name=name)
    peft_model.eval()
    engine = LoRAEngine(AppArgs(base_model=str(assets.model_dir), max_loras_per_batch=4, max_lora_rank=16,
                                max_batch_size=8, max_model_len=128).engine_config(request.param))
    for name, path in assets.adapters.items():
        engine.register_adapter(name, str(path))
    yield names, peft_model, engine
    engine.shutdown()


def reference_logprobs(peft_model, adapter, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row j is log P(next token | ids[:j + 1]) under transformers (+ PEFT)."""
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                logits = peft_model(torch.tensor([ids])).logits[0]
        else:
            peft_model.set_adapter(adapter)
            logits = peft_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches(entries, ref_rows: torch.Tensor, tokens: list[int], k: int) -> None:
    """Each entry scores ``tokens[j]`` as ``ref_rows[j]`` does, and its top k are the reference's top k."""
    assert len(entries) == len(tokens)
    for entry, row, token in zip(entries, ref_rows, tokens):
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) <= TOL
        values, ids = row.topk(k)
        assert len(entry.top) == k
        assert [v for _, _, v in entry.top] == pytest.approx(values.tolist(), abs=TOL)
        # ties aside, the same tokens in the same order
        for (tid, _, v), rid, rv in zip(entry.top, ids.tolist(), values.tolist()):
            assert tid == rid or abs(v - row[tid].item()) <= TOL


def test_generated_and_prompt_logprobs_match_peft_in_a_mixed_batch(setup):
    names, peft_model, engine = setup
    prompts = [[1, *range(40, 52)], [1, *range(70, 79)], [1, 100, 101, 102, 103, 104, 105], [1, *range(20, 37)]]
    requests = [
        GenerateRequest(adapter=None, token_ids=prompts[0], max_tokens=6, logprobs=5),
        GenerateRequest(adapter=names[0], token_ids=prompts[1], max_tokens=6, logprobs=3, temperature=1.0, seed=3),
        GenerateRequest(adapter=names[1], token_ids=prompts[2], max_tokens=5, logprobs=2, prompt_logprobs=4,
                        top_p=0.9, temperature=0.7, seed=5),
        GenerateRequest(adapter=names[2], token_ids=prompts[3], max_tokens=4, prompt_logprobs=1),
        GenerateRequest(adapter=None, token_ids=prompts[1], max_tokens=4, logprobs=0, prompt_logprobs=0,
                        presence_penalty=1.5, repetition_penalty=1.2),  # penalties change sampling, not logprobs
    ]
    steps_before = engine.steps

    async def together():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    results = asyncio.run(together())
    assert engine.steps - steps_before < sum(r.max_tokens for r in requests)  # they shared steps
    for request, result in zip(requests, results):
        prompt = request.token_ids
        ref = reference_logprobs(peft_model, request.adapter, prompt + result.token_ids)
        if request.logprobs is not None:
            assert_matches(result.logprobs, ref[len(prompt) - 1:-1], result.token_ids, request.logprobs)
        else:
            assert result.logprobs is None
        if request.prompt_logprobs is not None:
            first, *rest = result.prompt_logprobs
            assert first.token_id == prompt[0] and first.logprob is None  # nothing predicts the first token
            assert_matches(rest, ref[:len(prompt) - 1], prompt[1:], request.prompt_logprobs)
        else:
            assert result.prompt_logprobs is None


def test_echo_with_no_tokens_scores_the_prompt_alone(setup):
    names, peft_model, engine = setup
    prompt = [1, *range(30, 61)]  # longer than two KV blocks: scored across blocks
    engine.generate_blocking(GenerateRequest(adapter=names[0], token_ids=prompt, max_tokens=2))  # cache its prefix
    result = engine.generate_blocking(GenerateRequest(adapter=names[0], token_ids=prompt, max_tokens=0,
                                                      prompt_logprobs=2))
    assert result.token_ids == [] and result.finish_reason == "length" and result.completion_tokens == 0
    ref = reference_logprobs(peft_model, names[0], prompt)
    assert_matches(result.prompt_logprobs[1:], ref[:-1], prompt[1:], 2)  # a cached prefix is scored too


def test_streamed_deltas_carry_the_same_logprobs(setup):
    names, _, engine = setup
    request = dict(adapter=names[1], token_ids=[1, *range(50, 60)], max_tokens=6, logprobs=2)

    async def collect():
        return [d async for d in engine.generate_stream(GenerateRequest(**request))]

    deltas = asyncio.run(collect())
    full = engine.generate_blocking(GenerateRequest(**request))
    assert [d.logprob.logprob for d in deltas] == pytest.approx([e.logprob for e in full.logprobs], abs=TOL)
    assert [d.logprob.top for d in deltas][0][0][0] == full.logprobs[0].top[0][0]
    offsets = [e.text_offset for e in full.logprobs]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(full.text)
