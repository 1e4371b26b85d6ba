"""The systems the benchmark drives, each serving a list of ``WorkRequest``s and timing every token.

- ``run_engine``: our ``LoRAEngine``, every request submitted on arrival (all at once, or
  at Poisson offsets), token times taken in the engine's sink.
- ``run_transformers_cb``: transformers' continuous batching (the manager behind
  ``model.generate_batch``, used directly so each request keeps its own ``max_new_tokens``),
  with its per-token timestamps; base model only (it has no adapters).
- ``run_peft_static``: PEFT's ``generate(adapter_names=...)`` on static batches of the
  same requests in arrival order (left-padded, each batch runs to its longest request);
  a stopping criterion stamps every step, and a request's tokens are its first
  ``max_tokens`` of its batch's steps.

EOS is ignored everywhere, so every system produces exactly the requested tokens.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import torch

from engine.engine import LoRAEngine
from engine.request import GenerateRequest, GenerateResult, TokenDelta

from .workload import Served, WorkRequest

# ``transformers.ContinuousBatchingConfig`` fields for ``run_transformers_cb``; empty: transformers sizes its KV cache
# and batch itself, from the free memory (as a user's default run does; on the CPU that is ~90% of the RAM, and the
# attention mask it allocates and fills at start-up grows with it: about 20 s a run on a 24 GB machine)
TRANSFORMERS_CB: dict = {}


def run_engine(engine: LoRAEngine, requests: Sequence[WorkRequest], adapter_names: Sequence[str],
               offsets: Optional[Sequence[float]] = None, timeout_s: float = 600.0,
               sampling: Optional[dict] = None) -> tuple[list[Served], float]:
    """Serve ``requests`` (at ``offsets`` seconds from the start, else all at once); (served, start time).
    ``sampling``: ``GenerateRequest`` fields for every request (temperature, top_p); request i gets seed i."""
    done = threading.Semaphore(0)
    failures: list[BaseException] = []
    served = [Served(r, 0.0) for r in requests]

    def sink_for(record: Served):
        def sink(item) -> None:
            if isinstance(item, TokenDelta):
                record.token_times.append(time.perf_counter())
            elif isinstance(item, GenerateResult):
                done.release()
            else:
                failures.append(item)
                done.release()
        return sink

    started = time.perf_counter()
    for i, (record, req) in enumerate(zip(served, requests)):
        if offsets is not None:
            delay = started + offsets[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        record.arrival = time.perf_counter()
        name = None if req.adapter is None else adapter_names[req.adapter]
        extra = {} if sampling is None else {**sampling, "seed": i}
        engine.submit(GenerateRequest(adapter=name, token_ids=list(req.prompt_ids), max_tokens=req.max_tokens,
                                      **extra), sink_for(record))
    deadline = time.monotonic() + timeout_s
    for _ in requests:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"the engine did not finish {len(requests)} requests in {timeout_s:.0f}s")
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed; first: {failures[0]!r}")
    return served, started


def run_transformers_cb(model, requests: Sequence[WorkRequest], timeout_s: float = 600.0) -> tuple[list[Served], float, dict]:
    """transformers' continuous batching on the base model; (served, start, {kv_bytes, max_running})."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests), eos_token_id=-1,
                              pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_ids) for r in requests),
                          max_generated_length=max(r.max_tokens for r in requests), num_requests=len(requests))
    served = {f"r{r.index}": Served(r, 0.0) for r in requests}
    stats = {"kv_bytes": None, "max_running": 0}
    cb_config = ContinuousBatchingConfig(**TRANSFORMERS_CB) if TRANSFORMERS_CB else None
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=10,
                                                   continuous_batching_config=cb_config,
                                                   workload_hints=hints) as manager:
        sampling = threading.Event()
        watcher = threading.Thread(target=_watch_running, args=(manager, stats, sampling), daemon=True)
        watcher.start()
        started = time.perf_counter()
        for rid, record in served.items():
            record.arrival = time.perf_counter()
            manager.add_request(list(record.request.prompt_ids), request_id=rid,
                                max_new_tokens=record.request.max_tokens, record_timestamps=True, eos_token_id=-1)
        finished = 0
        deadline = time.monotonic() + timeout_s
        while finished < len(served):
            if time.monotonic() > deadline:
                raise TimeoutError(f"transformers did not finish {len(served)} requests in {timeout_s:.0f}s")
            result = manager.get_result(timeout=1)
            if result is None or not result.is_finished():
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers failed request {result.request_id}: {result.error}")
            served[result.request_id].token_times = list(result.timestamps)
            finished += 1
        sampling.set()
        watcher.join()
        cache = manager.batch_processor.cache
        stats["kv_bytes"] = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
    return list(served.values()), started, stats


def _watch_running(manager, stats: dict, stop: threading.Event) -> None:
    """Sample transformers' running-request count every 2 ms (it exposes no peak)."""
    while not stop.wait(0.002):
        processor = getattr(manager, "batch_processor", None)
        if processor is not None:
            stats["max_running"] = max(stats["max_running"], len(processor.scheduler.active_requests))


class _StepClock:
    """A stopping criterion that never stops: it stamps the time each generation step ends."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_peft_static(peft_model, requests: Sequence[WorkRequest], adapter_names: Sequence[str],
                    batch_size: int) -> tuple[list[Served], float, dict]:
    """PEFT ``generate`` with ``adapter_names`` over static batches; (served, start, {kv_bytes, max_running})."""
    from transformers import StoppingCriteriaList

    device = next(peft_model.parameters()).device
    cfg = peft_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * next(peft_model.parameters()).element_size()
    peak = 0
    served = []
    started = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        steps = max(r.max_tokens for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):  # left padding
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        names = ["__base__" if r.adapter is None else adapter_names[r.adapter] for r in batch]
        clock = _StepClock()
        with torch.inference_mode():
            peft_model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), adapter_names=names,
                                max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                                pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))
        if len(clock.times) != steps:
            raise RuntimeError(f"PEFT ran {len(clock.times)} steps, expected {steps}")
        for r in batch:
            served.append(Served(r, started, clock.times[:r.max_tokens]))
        peak = max(peak, len(batch) * (width + steps) * per_token)  # its DynamicCache at the last step
    return served, started, {"kv_bytes": peak, "max_running": min(batch_size, len(requests))}
