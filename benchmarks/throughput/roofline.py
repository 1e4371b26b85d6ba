"""A decode step at batch B with every request on its own adapter, against the floors of that step.

- step: ``ModelRunner.forward`` of B one-token requests (request i on adapter i % 8) over a
  cached context, plus the greedy argmax the engine takes: the engine's device work per step.
- GEMM floor: the same step's dense matmuls alone (base weights: q/k/v/o/gate/up/down per
  layer and lm_head, B tokens), in the same process and threads, run as the engine runs them
  (``LoRABatchContext.base_linear``: oneDNN's linear on the CPU when its start-up check passed,
  ``engine.cpu_gemm``): what the hardware needs at the least for that step, with no attention,
  LoRA, norms or bookkeeping. ``gemm_floor_torch_ms`` times the same matmuls with ``F.linear`` (MKL on the
  CPU): the floor of earlier rounds, when the engine ran its GEMMs that way.
- bandwidth floor: the bytes of those weights over the machine's copy bandwidth (bytes read
  and written per second by a large ``Tensor.copy_``): reading the weights once.
The three take turns each repeat, so drift hits them alike, on the engine thread (between two of its steps), as
served: a step timed on another thread would run beside the engine thread's OpenMP team (``engine.openmp_team``).
``step_over_gemms`` is the median over repeats of each step over the GEMM pass timed right after it: a slower
stretch of the machine slows both sides of a pair, so the pairs' ratios scatter less than the two medians'
ratio (``step_ms`` and ``gemm_floor_ms`` are each side's median; their quotient can differ slightly).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from engine.engine import LoRAEngine
from engine.model_runner import SeqInput
from engine.openmp_team import release_thread_team

from benchmarks import common

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def base_weights(model) -> list[torch.Tensor]:
    """The dense weights a decode step multiplies by (from a model without LoRA), lm_head last."""
    weights = []
    for layer in model.model.layers:
        for path in PROJECTIONS:
            module = layer.get_submodule(path)
            weights.append(module.weight.detach())
    weights.append(model.lm_head.weight.detach())
    return weights


def _as_linear(weight: torch.Tensor) -> torch.nn.Linear:
    """An ``nn.Linear`` holding ``weight`` (no copy), for the engine's ``base_linear``."""
    module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    return module


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes moved (read + written) per second by ``dst.copy_(src)`` of ``nbytes``."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = common.time_repeats(lambda: dst.copy_(src), repeats=repeats, warmup=1, sync=sync)
    return 2 * nbytes / common.median(times)


@contextmanager
def decode_inputs(engine: LoRAEngine, adapter_names: Sequence[str], batch: int, context: int,
                  hold_lock: bool = True) -> Iterator[list]:
    """``batch`` one-token inputs (request i on adapter i % len) over ``context`` cached random tokens, ready for
    ``engine.runner.forward``; the engine's step lock is held throughout (``hold_lock`` False: the caller runs on the
    engine thread between steps, which holds it) and the blocks and slots freed after."""
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    alloc = engine.cache.allocator
    with engine._step_lock if hold_lock else nullcontext():
        uids = [engine.current_uid(adapter_names[i % len(adapter_names)]) for i in range(batch)]
        slots = engine.pool.prepare_lora_batch(set(uids))
        tables = [[alloc.allocate() for _ in range(alloc.blocks_for(context + 1))] for _ in range(batch)]
        try:
            prompts = torch.randint(3, vocab, (batch, context), generator=gen).tolist()
            engine.runner.forward([SeqInput(t, p, 0, slots[u]) for t, p, u in zip(tables, prompts, uids)])
            tokens = torch.randint(3, vocab, (batch,), generator=gen).tolist()
            yield [SeqInput(t, [tok], context, slots[u]) for t, tok, u in zip(tables, tokens, uids)]
        finally:
            for t in tables:
                alloc.free(t)
            engine.pool.release_batch()


def measure_decode(engine: LoRAEngine, weights: Sequence[torch.Tensor], adapter_names: Sequence[str], batch: int,
                   context: int, repeats: int) -> dict:
    """Median step and floors in ms, timed on the engine thread between two of its steps (the engine must be idle)."""
    release_thread_team()  # the caller's OpenMP team would throttle the engine thread's (engine.openmp_team)
    return engine.at_step_boundary(lambda: _measure_decode(engine, weights, adapter_names, batch, context, repeats))


def _measure_decode(engine: LoRAEngine, weights: Sequence[torch.Tensor], adapter_names: Sequence[str], batch: int,
                    context: int, repeats: int) -> dict:
    device = engine.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with decode_inputs(engine, adapter_names, batch, context, hold_lock=False) as seqs:
        def step():
            engine.runner.forward(seqs).argmax(dim=-1).tolist()

        xs = {w.shape[1]: torch.randn(batch, w.shape[1], device=device, dtype=w.dtype) for w in weights}
        modules = [_as_linear(w) for w in weights]
        linear = engine.context.base_linear

        def gemms():
            for m in modules:
                linear(m, xs[m.weight.shape[1]])

        def torch_gemms():
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        times = common.time_alternating({"step": step, "gemms": gemms, "torch_gemms": torch_gemms}, repeats=repeats,
                                        warmup=2, sync=sync)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth = copy_bandwidth(device)
    step_ms = common.median(times["step"]) * 1e3
    gemm_ms = common.median(times["gemms"]) * 1e3
    paired = common.median(step / gemms for step, gemms in zip(times["step"], times["gemms"]))
    over_torch = common.median(step / gemms for step, gemms in zip(times["step"], times["torch_gemms"]))
    return {"batch": batch, "context": context, "step_ms": step_ms, "gemm_floor_ms": gemm_ms,
            "gemm_floor_torch_ms": common.median(times["torch_gemms"]) * 1e3, "step_over_torch_gemms": over_torch,
            "bandwidth_floor_ms": weight_bytes / bandwidth * 1e3, "weight_mb": weight_bytes / 2**20,
            "copy_gb_s": bandwidth / 1e9, "step_over_gemms": paired}
