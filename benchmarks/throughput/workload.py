"""The seeded workload every system serves, and what each request saw (timestamps -> tok/s, TTFT, TPOT).

Requests have mixed prompt and output lengths over ``NUM_ADAPTERS`` adapters plus the base
model; prompt tokens are drawn from the demo tokenizer's printable bytes. Every system is
given the same requests; latency is measured from each request's own arrival (all at
once: the start of the run; Poisson: its arrival time).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from engine.demo.tokenizer import printable_token_ids

NUM_ADAPTERS = 8


@dataclass(frozen=True)
class WorkRequest:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    adapter: Optional[int]  # 0..NUM_ADAPTERS-1, or None for the base model


@dataclass
class Served:
    """One request as a system served it: arrival and per-token times (perf_counter seconds)."""

    request: WorkRequest
    arrival: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first (None for one-token outputs)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int,
                  base_share: float = 1 / (NUM_ADAPTERS + 1)) -> list[WorkRequest]:
    rng = random.Random(seed)
    vocab = printable_token_ids()
    requests = []
    for i in range(n):
        prompt = [1] + [rng.choice(vocab) for _ in range(rng.randint(*prompt_range) - 1)]  # <s> first
        adapter = None if rng.random() < base_share else rng.randrange(NUM_ADAPTERS)
        requests.append(WorkRequest(i, prompt, rng.randint(*output_range), adapter))
    return requests


def base_only(requests: list[WorkRequest]) -> list[WorkRequest]:
    return [WorkRequest(r.index, r.prompt_ids, r.max_tokens, None) for r in requests]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process of ``rate`` requests per second."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist()


def summarize(served: list[Served], started: float) -> dict[str, Any]:
    """Output tok/s over the whole run (first arrival to last token) and latency percentiles in ms."""
    tokens = sum(len(s.token_times) for s in served)
    end = max(s.token_times[-1] for s in served)
    ttft = np.array([s.ttft for s in served]) * 1e3
    tpot = np.array([t for t in (s.tpot for s in served) if t is not None]) * 1e3
    return {
        "requests": len(served),
        "output_tokens": tokens,
        "seconds": end - started,
        "tok_per_s": tokens / (end - started),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "tpot_p50_ms": float(np.percentile(tpot, 50)) if len(tpot) else None,
        "tpot_p99_ms": float(np.percentile(tpot, 99)) if len(tpot) else None,
    }
