"""The engine around its paged KV cache: sizing from the budget, a context window that must fit, streams
that survive preemption, KV statistics."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.kv_cache import kv_bytes_per_token
from engine.request import GenerateRequest


@pytest.fixture(scope="module")
def per_token(demo_assets):
    from transformers import AutoConfig

    mc = AutoConfig.from_pretrained(demo_assets.model_dir)
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    return kv_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, torch.float32)


def make(demo_assets, **kwargs) -> LoRAEngine:
    return LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=3, **kwargs).engine_config())


def test_default_budget_is_the_contiguous_rows_footprint(demo_assets, per_token):
    engine = make(demo_assets, max_batch_size=4, max_model_len=128)
    try:
        assert engine.cache.total_bytes == 4 * 128 * per_token
        assert engine.cache.num_blocks == 4 * 128 // 16 and engine.max_model_len == 128
    finally:
        engine.shutdown()


def test_a_context_window_the_cache_cannot_hold_is_refused_or_clamped(demo_assets, per_token):
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        make(demo_assets, max_model_len=256, kv_cache_bytes=10 * 16 * per_token)
    engine = make(demo_assets, kv_cache_bytes=10 * 16 * per_token)  # window left to the model: clamped
    try:
        assert engine.max_model_len == 160
        with pytest.raises(Exception, match="context window of 160"):
            engine.generate_blocking(GenerateRequest(token_ids=[1] * 150, max_tokens=11))
    finally:
        engine.shutdown()


def test_streams_survive_preemption_without_repeating_tokens(demo_assets, per_token):
    """Preempted requests are recomputed, but what a caller already received is never sent again."""
    engine = make(demo_assets, max_batch_size=8, kv_cache_bytes=12 * 4 * per_token, kv_block_size=4,
                  max_model_len=48)
    names = [None, *demo_assets.adapters][:4]
    try:
        for name in names[1:]:
            engine.register_adapter(name, str(demo_assets.adapters[name]))
        async def stream(i):
            deltas = []
            request = GenerateRequest(adapter=names[i % 4], token_ids=[1, *range(30 + i, 40 + i)], max_tokens=16)
            async for item in engine.generate_stream(request, with_result=True):
                deltas.append(item)
            return deltas

        async def all_streams():
            return await asyncio.gather(*(stream(i) for i in range(8)))

        outputs = asyncio.run(all_streams())
        stats = engine.stats()
        assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0
        assert stats["max_running"] <= 8 and stats["kv_bytes_peak"] <= stats["kv_bytes_total"]
        for i, items in enumerate(outputs):
            *deltas, result = items
            assert [d.token_id for d in deltas] == result.token_ids
            assert "".join(d.text for d in deltas) == result.text
            solo = engine.generate_blocking(GenerateRequest(adapter=names[i % 4], token_ids=[1, *range(30 + i, 40 + i)],
                                                            max_tokens=16))
            assert solo.token_ids == result.token_ids
    finally:
        engine.shutdown()
