"""A small engine on the demo model for the fast-path tests (a 1 MiB KV cache, rank-16 slots, the first ``adapters``
demo adapters registered, ``tuning`` choosing which fast paths to try), and greedy requests served together on it."""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.request import GenerateRequest
from engine.tuning import EngineTuning


def small_engine(demo_assets, name: str, *, slots: int = 3, adapters: int = 2, **tuning) -> LoRAEngine:
    engine = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=slots, max_lora_rank=16,
                                max_model_len=128, kv_cache_bytes=1 << 20).engine_config(name),
                        tuning=EngineTuning(**tuning))
    for adapter in list(demo_assets.adapters)[:adapters]:
        engine.register_adapter(adapter, str(demo_assets.adapters[adapter]))
    return engine


def serve_together(engine: LoRAEngine, requests: Sequence[tuple[Optional[str], list[int]]],
                   max_tokens: int) -> list[list[int]]:
    """Greedy tokens of ``(adapter, prompt ids)`` requests submitted at once (so they share the engine's steps)."""
    async def together():
        return await asyncio.gather(*(engine.generate(GenerateRequest(adapter=adapter, token_ids=ids,
                                                                      max_tokens=max_tokens))
                                      for adapter, ids in requests))

    return [r.token_ids for r in asyncio.run(together())]
