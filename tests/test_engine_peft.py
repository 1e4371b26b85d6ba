"""Equivalence with PEFT, the reference: logits and greedy tokens, single and mixed batches."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import TEST_KV_FRACTION
from deployments.config import AppArgs
from engine.demo import ensure_demo_assets
from engine.engine import LoRAEngine
from engine.model_runner import SeqInput
from engine.request import GenerateRequest
from triton_interpret import interpreted_lora_kernels

import peft
from transformers import AutoModelForCausalLM  # noqa: E402

PROMPTS = [[1, *range(40, 52)], [1, *range(70, 79)], [1, 100, 101, 102, 103, 104, 105]]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def setup(request, tmp_path_factory):
    assets = ensure_demo_assets(tmp_path_factory.mktemp(request.param), num_adapters=6, arch=request.param)
    # fewer slots than adapters, so later checks run after evictions and reloads
    engine = LoRAEngine(AppArgs(base_model=str(assets.model_dir), max_loras_per_batch=4, max_lora_rank=16,
                                kv_cache_memory_fraction=TEST_KV_FRACTION).engine_config(request.param))
    # the reference runs where the engine runs (on a GPU machine, ours - ref must not mix devices)
    ref = AutoModelForCausalLM.from_pretrained(assets.model_dir).to(engine.device).eval()
    names = list(assets.adapters)
    peft_model = peft.PeftModel.from_pretrained(ref, assets.adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(assets.adapters[name], adapter_name=name)
    peft_model.eval()
    for name, path in assets.adapters.items():
        engine.register_adapter(name, str(path))
    yield assets, peft_model, engine
    engine.shutdown()


def peft_logits(peft_model, adapter, ids):
    x = torch.tensor([ids], device=peft_model.device)
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                return peft_model(x).logits[0]
        peft_model.set_adapter(adapter)
        return peft_model(x).logits[0]


def our_logits(engine, batch):
    """batch: list of (adapter name | None, ids); all-token logits per request from one forward."""
    with engine._step_lock:
        uids = [engine.adapters.resolve(a) for a, _ in batch]
        slots = engine.pool.prepare_lora_batch(set(uids))
        blocks = engine.cache.allocator
        tables = [[blocks.allocate() for _ in range(blocks.blocks_for(len(ids)))] for _, ids in batch]
        try:
            inputs = [SeqInput(t, ids, 0, slots[u]) for t, u, (_, ids) in zip(tables, uids, batch)]
            out = engine.runner.forward(inputs, all_logits=True)
        finally:
            for t in tables:
                blocks.free(t)
            engine.pool.release_batch()
    pieces, start = [], 0
    for _, ids in batch:
        pieces.append(out[start:start + len(ids)])
        start += len(ids)
    return pieces


def test_each_adapter_matches_peft(setup):
    assets, peft_model, engine = setup
    for name in [None, *assets.adapters]:
        for ids in PROMPTS[:2]:
            (ours,) = our_logits(engine, [(name, ids)])
            ref = peft_logits(peft_model, name, ids)
            assert (ours - ref).abs().max().item() <= 1e-4, name


def test_mixed_batch_matches_peft_and_survives_evictions(setup):
    assets, peft_model, engine = setup
    names = list(assets.adapters)
    # a batch needs at most 4 slots: run several mixed batches so adapters are evicted and reloaded
    batches = [[(None, PROMPTS[0]), (names[0], PROMPTS[1]), (names[1], PROMPTS[2]), (names[0], PROMPTS[0])],
               [(names[2], PROMPTS[0]), (names[3], PROMPTS[1]), (None, PROMPTS[2]), (names[4], PROMPTS[1])],
               [(names[5], PROMPTS[2]), (names[0], PROMPTS[1]), (names[1], PROMPTS[0]), (None, PROMPTS[1])]]
    evictions_before = engine.pool.counters.evictions
    for batch in batches * 2:
        for (name, ids), ours in zip(batch, our_logits(engine, batch)):
            assert (ours - peft_logits(peft_model, name, ids)).abs().max().item() <= 1e-4, name
    assert engine.pool.counters.evictions > evictions_before


def check_greedy_generation_matches_peft_generate(assets, peft_model, engine):
    requests = [(name, ids) for name in [None, *assets.adapters] for ids in PROMPTS[:2]]

    async def run_all():
        return await asyncio.gather(*(
            engine.generate(GenerateRequest(adapter=n, token_ids=ids, max_tokens=12)) for n, ids in requests))

    results = asyncio.run(run_all())  # concurrently: one mixed batch over more adapters than slots
    eos = engine.tokenizer.eos_token_id
    for (name, ids), result in zip(requests, results):
        x = torch.tensor([ids], device=peft_model.device)
        with torch.no_grad():
            if name is None:
                with peft_model.disable_adapter():
                    out = peft_model.generate(input_ids=x, max_new_tokens=12, do_sample=False, pad_token_id=0)
            else:
                peft_model.set_adapter(name)
                out = peft_model.generate(input_ids=x, max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected = out[0, len(ids):].tolist()
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert result.token_ids == expected, name
    return results


def test_greedy_generation_is_token_identical_to_peft_generate(setup):
    check_greedy_generation_matches_peft_generate(*setup)


def test_chunked_prefill_is_token_identical_to_peft_generate(setup):
    """A budget of 8 tokens a step (the engine's max_batch_size): prompts of 10 and 13 tokens are prefilled
    in chunks that share steps with the decodes of others, and every greedy output stays PEFT's."""
    assets, peft_model, engine = setup
    scheduler = engine.scheduler
    budget, chunks_before = scheduler.max_num_batched_tokens, scheduler.prefill_chunks
    scheduler.max_num_batched_tokens = scheduler.max_batch_size
    try:
        check_greedy_generation_matches_peft_generate(assets, peft_model, engine)
    finally:
        scheduler.max_num_batched_tokens = budget
    assert scheduler.prefill_chunks > chunks_before


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """Attention beyond the window is masked exactly as transformers does (prefill and decode)."""
    from engine.demo import write_tiny_model

    folder = write_tiny_model(tmp_path / "mistral", "mistral")
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.config.sliding_window = 4
    model.save_pretrained(tmp_path / "windowed")
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special", "chat")):
            (tmp_path / "windowed" / f.name).write_bytes(f.read_bytes())
    engine = LoRAEngine(AppArgs(base_model=str(tmp_path / "windowed"), max_loras_per_batch=2, max_lora_rank=8,
                                kv_cache_memory_fraction=TEST_KV_FRACTION).engine_config())
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "windowed").to(engine.device).eval()
    try:
        ids = PROMPTS[0]
        x = torch.tensor([ids], device=engine.device)
        (ours,) = our_logits(engine, [(None, ids)])
        with torch.no_grad():
            expected = ref(x).logits[0]
            full_context = AutoModelForCausalLM.from_pretrained(folder).to(engine.device).eval()(x).logits[0]
        assert (ours - expected).abs().max().item() <= 1e-4
        assert (expected - full_context).abs().max().item() > 1e-2  # the window really changes the result
        result = engine.generate_blocking(GenerateRequest(token_ids=ids, max_tokens=10))
        with torch.no_grad():
            out = ref.generate(input_ids=x, max_new_tokens=10, do_sample=False, pad_token_id=0)
        expected_tokens = out[0, len(ids):].tolist()
        eos = engine.tokenizer.eos_token_id
        if eos in expected_tokens:
            expected_tokens = expected_tokens[: expected_tokens.index(eos) + 1]
        assert result.token_ids == expected_tokens
        # chunks of 3 tokens: the later chunks attend to cached keys through the window's mask
        engine.scheduler.max_num_batched_tokens = 3
        chunked = engine.generate_blocking(GenerateRequest(token_ids=ids, max_tokens=10))
        assert chunked.token_ids == expected_tokens and engine.scheduler.prefill_chunks >= len(ids) // 3
    finally:
        engine.shutdown()


def test_the_segmented_lora_kernels_match_peft_too(setup):
    """The Triton kernels CUDA uses for multi-adapter steps, forced on here (interpreted on the CPU): same logits,
    same tokens."""
    assets, peft_model, engine = setup
    names = list(assets.adapters)
    kernel_device = engine.runner.kernel_device
    with interpreted_lora_kernels():
        engine.runner.kernel_device = engine.device
        try:
            batch = [(names[0], PROMPTS[0][:3]), (None, PROMPTS[1][:3]), (names[1], PROMPTS[2][:3]),
                     (names[2], [1, 9])]
            for (name, ids), ours in zip(batch, our_logits(engine, batch)):
                assert (ours - peft_logits(peft_model, name, ids)).abs().max().item() <= 1e-4, name

            async def run_all():
                return await asyncio.gather(*(
                    engine.generate(GenerateRequest(adapter=n, token_ids=PROMPTS[0], max_tokens=6))
                    for n in [None, *names[:3]]))

            results = asyncio.run(run_all())
            for name, result in zip([None, *names[:3]], results):
                solo = our_logits(engine, [(name, PROMPTS[0] + result.token_ids[:-1])])[0]
                assert solo[len(PROMPTS[0]) - 1:].argmax(-1).tolist() == result.token_ids
        finally:
            engine.runner.kernel_device = kernel_device
