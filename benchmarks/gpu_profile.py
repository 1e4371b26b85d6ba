"""GPU-only measurements for ``benchmarks.gpu_check``: the LoRA kernels alone, and one profiled decode step.

- ``time_lora_kernels``: at a decode step's shape (one token per request, request i on
  adapter i % adapters), the fused q/k/v and gate/up kernel pairs and the single-module
  ones, against the torch segment loop, in GPU µs (CUDA events, median of repeats).
- ``profile_decode_step``: one engine decode step under ``torch.profiler``: kernel launches,
  host µs (the step's wall time on the CPU side up to its one sync) and GPU µs (the sum of
  its kernels' durations), with the ten costliest kernels by GPU time.
- ``compiled_lora_variants``: how many variants of the two LoRA kernels Triton has compiled
  in this process, read before and after serving: any growth is a compile after ready.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from engine.engine import LoRAEngine
from engine.lora_layers import LoRASegment, add_segment_loop, kernel_groups
from engine.lora_plan import SegmentPlan

from .throughput.roofline import decode_inputs


def compiled_lora_variants() -> Optional[int]:
    """The compiled variants of ``engine.lora_triton``'s two kernels in Triton's per-device kernel caches (the first
    element of each ``device_caches`` entry in Triton 3.x); None where this Triton keeps them elsewhere."""
    from engine import lora_triton

    total = 0
    for kernel in (lora_triton._shrink_kernel, lora_triton._expand_kernel):
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        total += sum(len(entry[0]) for entry in list(caches.values()))
    return total


def _gpu_us(fn, repeats: int) -> float:
    """Median GPU time of ``fn`` in µs (CUDA events around each call, after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def time_lora_kernels(engine: LoRAEngine, batch: int, adapters: int, repeats: int = 20) -> list[dict[str, Any]]:
    """Each projection group's kernel pair and torch loop at a decode step of ``batch`` rows over ``adapters``."""
    from engine import lora_triton

    pool, device, dtype = engine.pool, engine.device, engine.dtype
    rank = pool.max_lora_rank
    segments, start = [], 0
    for a in range(adapters):
        n = len(range(a, batch, adapters))
        segments.append(LoRASegment(1 + a % (pool.slots - 1), start, start + n, rank, 1.0))
        start += n
    plan = SegmentPlan.build(segments, device, batch)
    rows = []
    for group in kernel_groups(pool.shape.modules):
        shape = pool.shape.modules[group[0]]
        x = torch.randn(batch, shape.in_features, device=device, dtype=dtype)
        a = [pool.a_buffers[m][0] for m in group]
        bt = [pool.bt_buffers[m][0] for m in group]
        outs = [torch.zeros(batch, pool.shape.modules[m].out_features, device=device, dtype=dtype) for m in group]
        target = engine.tuning.lora_target_programs
        shrink_us = _gpu_us(lambda: lora_triton.lora_shrink(x, a, plan, target), repeats)
        y = lora_triton.lora_shrink(x, a, plan, target)
        expand_us = _gpu_us(lambda: lora_triton.lora_expand(y, bt, plan, outs), repeats)

        def loop():
            for a_i, bt_i, out in zip(a, bt, outs):
                add_segment_loop(x, a_i, bt_i, segments, out)

        rows.append({"group": "+".join(group), "batch": batch, "adapters": adapters,
                     "splits": lora_triton.split_k(plan, len(group), shape.in_features, target)[0],
                     "shrink_us": shrink_us, "expand_us": expand_us, "torch_loop_us": _gpu_us(loop, repeats)})
    return rows


def profile_decode_step(engine: LoRAEngine, adapter_names: Sequence[str], batch: int, context: int) -> dict[str, Any]:
    """Launches, host µs and GPU µs of one decode step (the engine idle: its step lock is held)."""
    from torch.profiler import ProfilerActivity, profile

    with decode_inputs(engine, adapter_names, batch, context) as seqs:
        for _ in range(2):  # warm: allocator and any lazy state
            engine.runner.forward(seqs).argmax(dim=-1).tolist()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            engine.runner.forward(seqs).argmax(dim=-1).tolist()
            host_us = (time.perf_counter() - started) * 1e6
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time_total
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"batch": batch, "context": context, "launches": len(kernels), "host_us": host_us,
            "gpu_us": sum(e.device_time_total for e in kernels), "top_kernels_us": [[n[:80], t] for n, t in top]}
