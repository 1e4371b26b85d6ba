"""Short requests' latency while long prompts arrive: what the per-step token budget protects.

Short requests (the main workload's lengths) arrive as a Poisson stream; in the second run
a few long prompts (``LONG_PROMPT`` tokens, a few output tokens each, on adapters) arrive
spread over the same window. Without a token budget a long prompt's prefill is one step
that every running decode and every new short prompt waits behind; with chunked prefill it
takes several steps, each shared with the decodes. The goal compares the short requests'
TTFT p99 with and without the long prompts (same short requests, same arrival times).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from engine.demo.tokenizer import printable_token_ids
from engine.engine import LoRAEngine

from .systems import run_engine
from .workload import NUM_ADAPTERS, Served, WorkRequest, make_workload, poisson_offsets

LONG_PROMPT = 4096   # tokens per long prompt
LONG_OUTPUT = 4      # tokens each long prompt generates


@dataclass(frozen=True)
class LongPromptWorkload:
    shorts: list[WorkRequest]
    short_offsets: list[float]
    longs: list[WorkRequest]
    long_offsets: list[float]


def make_long_prompt_workload(n_short: int, n_long: int, prompt_range: tuple[int, int],
                              output_range: tuple[int, int], rate: float, seed: int) -> LongPromptWorkload:
    """``n_short`` Poisson arrivals at ``rate`` per second, and ``n_long`` long prompts spread evenly over them."""
    shorts = make_workload(n_short, prompt_range, output_range, seed)
    offsets = poisson_offsets(n_short, rate, seed)
    rng = random.Random(seed + 1)
    vocab = printable_token_ids()
    longs = [WorkRequest(n_short + k, [1] + [rng.choice(vocab) for _ in range(LONG_PROMPT - 1)], LONG_OUTPUT,
                         k % NUM_ADAPTERS) for k in range(n_long)]
    span = offsets[-1]
    long_offsets = [span * (k + 0.25) / n_long for k in range(n_long)]
    return LongPromptWorkload(shorts, offsets, longs, long_offsets)


def latency_summary(system: str, served: Sequence[Served]) -> dict[str, Any]:
    ttft = np.array([s.ttft for s in served]) * 1e3
    tpot = np.array([t for t in (s.tpot for s in served) if t is not None]) * 1e3
    return {"system": system, "requests": len(served),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)), "tpot_p99_ms": float(np.percentile(tpot, 99))}


def long_prompt_rows(engine: LoRAEngine, names: Sequence[str],
                     works: Sequence[LongPromptWorkload]) -> list[dict[str, Any]]:
    """The short requests alone, then with the long prompts: each row the short requests' latencies, pooled over
    ``works`` (windows served one after the other, each alone then with its long prompts)."""
    alone: list[Served] = []
    shorts: list[Served] = []
    longs: list[Served] = []
    chunks = 0  # prefill inputs cut short while the long prompts ran (the alone runs cut none)
    for work in works:
        served, _ = run_engine(engine, work.shorts, names, work.short_offsets)
        alone += served
        merged = sorted(zip(work.short_offsets + work.long_offsets, work.shorts + work.longs), key=lambda p: p[0])
        offsets, requests = [o for o, _ in merged], [r for _, r in merged]
        chunks_before = engine.scheduler.prefill_chunks
        served, _ = run_engine(engine, requests, names, offsets)
        chunks += engine.scheduler.prefill_chunks - chunks_before
        shorts += [s for s in served if s.request.index < len(work.shorts)]
        longs += [s for s in served if s.request.index >= len(work.shorts)]
    budget, cap = engine.scheduler.max_num_batched_tokens, engine.scheduler.long_prefill_tokens
    chunk = engine.scheduler.long_prefill_chunk_tokens
    per_window = f"{len(longs) // len(works)} prompts" + (f" in each of {len(works)} windows" if len(works) > 1 else "")
    with_long = latency_summary(f"short requests + {per_window} of {LONG_PROMPT} tokens "
                                f"(budget {budget} tokens/step, long above {cap or budget}, chunks {chunk or budget})",
                                shorts)
    with_long["long_ttft_p50_ms"] = float(np.percentile([s.ttft for s in longs], 50)) * 1e3
    with_long["prefill_chunks"] = chunks
    return [latency_summary("short requests alone, Poisson", alone), with_long]
