"""The fleet benchmarks' workload: a real trace's arrivals and lengths, Zipf adapters, an offered load.

Why one module: ``benchmarks.fleet_live`` (the live fleet) and the simulator replay the
same requests, so their results can be compared request for request. The arrivals and
prompt/output lengths come from the Azure LLM inference trace 2023 (code service, vendored
in ``benchmarks/data`` with its attribution) or, for the burstiness axis, from gamma gaps of
a chosen CV; adapters are Zipf-popular over ``num_adapters`` with ranks 8-64. Time is
rescaled so the mean arrival rate is ``offered_load`` times the fleet's capacity, which the
cost model gives (``capacity_req_s``).
"""

from __future__ import annotations

import csv
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

from .sim.costs import CostModel
from .traces import Popularity, Trace, adapter_ranks, gamma_arrivals, rngs

TRACE_PATH = Path(__file__).parent / "data" / "azure_llm_code_2023.csv"
ARRIVALS = ("trace", "gamma")


@lru_cache(maxsize=2)
def azure_trace(path: str = str(TRACE_PATH)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(seconds since the first request, prompt tokens, output tokens)`` of the vendored trace."""
    times, prompts, outputs = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            stamp = row["TIMESTAMP"]
            head, _, frac = stamp.partition(".")
            t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (frac or "0"))
            times.append(t)
            prompts.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
    t = np.asarray(times)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order][0]
    return t, np.asarray(prompts)[order], np.asarray(outputs)[order]


def service_share_s(costs: CostModel, prompt: np.ndarray, output: np.ndarray, rows: int) -> np.ndarray:
    """Replica-seconds each request takes when the batch is full: its prefill alone, its decode
    steps shared by ``rows`` rows (a step serves every row at once)."""
    return prompt * costs.prefill_s_per_token + output * costs.decode_s_per_token / rows


def capacity_req_s(costs: CostModel, prompt: np.ndarray, output: np.ndarray, replicas: int, rows: int) -> float:
    """Requests per second the fleet completes at full batches (no loads): the offered load's unit."""
    return replicas / float(np.mean(service_share_s(costs, prompt, output, rows)))


def fleet_workload(n: int, *, num_adapters: int, zipf_s: float, offered_load: float, arrivals: str,
                   costs: CostModel, replicas: int, rows: int, seed: int = 0, offset: int = 0,
                   max_prompt: int = 8192, max_output: int = 512, gamma_cv: float = 2.0) -> Trace:
    """``n`` requests from the trace (starting at request ``offset``), time rescaled to ``offered_load``.

    ``arrivals``: ``trace`` keeps the trace's own gaps (rescaled), ``gamma`` draws gaps of CV
    ``gamma_cv`` at the same mean rate. Prompts and outputs are the trace's, capped at
    ``max_prompt`` / ``max_output`` (at least one output token)."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"unknown arrivals {arrivals!r}; choose one of {ARRIVALS}")
    if not 0 < offered_load:
        raise ValueError(f"offered load must be > 0, got {offered_load}")
    t, prompt, output = azure_trace()
    if n < 1 or offset < 0 or offset + n > len(t):
        raise ValueError(f"the trace has {len(t)} requests; asked for {n} from {offset}")
    sl = slice(offset, offset + n)
    prompt = np.clip(prompt[sl], 1, max_prompt)
    output = np.clip(output[sl], 1, max_output)
    rate = offered_load * capacity_req_s(costs, prompt, output, replicas, rows)
    g = rngs(seed)
    if arrivals == "trace":
        gaps = np.diff(t[sl], prepend=t[sl][0])
        gaps = gaps / max(gaps[1:].mean() if n > 1 else 1.0, 1e-9) / rate
        gaps[0] = 0.0
        times = np.cumsum(gaps)
    else:
        times = gamma_arrivals(n, rate, gamma_cv, g["arrivals"])
        times -= times[0]
    popularity = Popularity("zipf", zipf_s)
    return Trace(adapters=popularity.sample(n, num_adapters, g["adapters"]), arrivals=times,
                 input_lens=prompt.astype(np.int64), output_lens=output.astype(np.int64),
                 ranks=adapter_ranks(num_adapters, g["ranks"]), num_adapters=num_adapters, popularity=popularity,
                 meta={"rate": rate, "offered_load": offered_load, "arrivals": arrivals, "seed": seed,
                       "offset": offset, "family": "zipf", "param": zipf_s,
                       "source": "Azure LLM inference trace 2023 (code), CC-BY 4.0"})


def describe(trace: Trace, duration: Optional[float] = None) -> str:
    span = duration if duration is not None else float(trace.arrivals[-1] - trace.arrivals[0])
    return (f"{len(trace)} requests over {span:.1f} s ({trace.meta['rate']:.1f} req/s, load "
            f"{trace.meta['offered_load']:g}, {trace.meta['arrivals']} arrivals), {trace.num_adapters} adapters "
            f"zipf s={trace.meta['param']:g}, prompt mean {trace.input_lens.mean():.0f} tokens, "
            f"output mean {trace.output_lens.mean():.0f}")
