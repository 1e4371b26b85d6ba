"""The base model's projections on the CPU through oneDNN's linear instead of ``F.linear`` (MKL's sgemm).

Why: a CPU step is mostly these GEMMs (a decode step at batch 32 ~70% of its time, a 1024-token prefill ~85%), and
on this project's 2-core machine (AMD EPYC, AVX-512, torch 2.13's MKL 2024.2 and oneDNN 3.12) oneDNN's fp32 linear
ran them faster at every shape a step has (GFLOPS, torch.utils.benchmark-style alternating repeats, one process):
M=32 rows 131-141 vs MKL's 85-97, M=5 32-49 vs 20-34, M=953 207 vs 180 (both sides slower when the machine is
busy, the gap kept). In the engine (in-process A/B on the engine thread): the decode step at batch 32 over 8
adapters 57.0 -> 44.2 ms, the benchmark's mixed workload 213 -> 257 tok/s. It is still fp32 with fp32 sums (not
bf16 or TF32): logits moved by ~3e-6 against MKL's, which sums in another order.

``torch.ops.mkldnn._linear_pointwise`` is the op torch's own CPU compiler (inductor) lowers ``nn.Linear`` to; on
plain dense weights it reorders them per call (prepacking would be faster at small batches but keeps a second copy
of every weight, so it is not used). It is an internal op: the engine checks it once at start against
``F.linear`` (``engine.fast_paths``, ``gemm_error``) and serves on ``F.linear`` if it is missing, raises or
disagrees. Only fp32 on the CPU takes it by default (``EngineTuning.cpu_gemm``); CUDA never does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

Linear = Callable[[nn.Linear, torch.Tensor], torch.Tensor]
# (rows, in, out, bias) the start-up check runs: a decode row, a few rows, a prefill-sized block; with and without bias
CHECK_SHAPES = ((1, 64, 48, False), (5, 96, 80, True), (70, 128, 160, False))


def module_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The plain path: the module's own forward (``F.linear``)."""
    return module(x)


def onednn_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` (an ``nn.Linear``) through oneDNN's linear; a module with forward hooks (a test's gate, a
    profiler's) runs itself, so its hooks still fire."""
    if module._forward_pre_hooks or module._forward_hooks:
        return module(x)
    return torch.ops.mkldnn._linear_pointwise(x, module.weight, module.bias, "none", [], "")


def gemm_error(dtype: torch.dtype, seed: int) -> float:
    """The largest relative difference of ``onednn_linear`` from ``F.linear`` over ``CHECK_SHAPES`` (raises where
    the op is missing)."""
    from .fast_paths import relative_error

    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for rows, fan_in, fan_out, bias in CHECK_SHAPES:
        module = nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype)
        with torch.no_grad():
            module.weight.copy_(torch.randn(fan_out, fan_in, generator=g))
            if bias:
                module.bias.copy_(torch.randn(fan_out, generator=g))
        x = torch.randn(rows, fan_in, generator=g).to(dtype)
        with torch.inference_mode():
            worst = max(worst, relative_error(onednn_linear(module, x), module(x)))
    return worst


def unsupported(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None where oneDNN's linear is tried by default (``auto``), else why not."""
    if device.type != "cpu":
        return "oneDNN's linear is for the CPU: the device runs its own GEMMs"
    if dtype != torch.float32:
        return f"oneDNN's linear is measured and checked in float32 only: this engine is {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


def project(module: nn.Module, x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """``module(x)``, a plain ``nn.Linear`` through ``linear`` (LoRA layers and other modules run themselves)."""
    if type(module) is nn.Linear:
        return linear(module, x)
    return module(x)

