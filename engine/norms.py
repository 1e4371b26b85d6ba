"""RMSNorm with fewer tensor ops where the module is a known Llama-family RMSNorm.

Why: transformers' ``LlamaRMSNorm.forward`` is seven tensor ops (cast, pow, mean, add, rsqrt, mul,
mul) and a decode step runs two per layer. In fp32 on the CPU ``rms_norm_fp32`` makes three passes
over the rows (a batched dot product for the sums of squares, two products), equal to the module up
to the order of the sums (a few ulps). Elsewhere ``torch.nn.functional.rms_norm`` (one call, bit-
identical in fp32; 1.4x faster than the module at 32 rows, 1.9x at 1024 on 2 CPU cores); in half
precision it normalises in fp32 and casts back before the weight, as transformers does.
Any other norm (Gemma's ``1 + weight``, a subclass with its own forward) runs its own module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# classes whose forward is x * rsqrt(mean(x^2) + eps) (in fp32), cast back, times weight
LLAMA_STYLE = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def is_llama_style(norm: nn.Module) -> bool:
    return type(norm).__name__ in LLAMA_STYLE and hasattr(norm, "variance_epsilon") and hasattr(norm, "weight")


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` with fewer ops for the Llama-style norms, the module itself otherwise."""
    if not is_llama_style(norm):
        return norm(x)
    shape = (x.shape[-1],)
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        if x.device.type == "cpu":
            return rms_norm_fp32(x, norm.weight, norm.variance_epsilon)
        return F.rms_norm(x, shape, norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), shape, None, norm.variance_epsilon).to(x.dtype)


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` in fp32 in three passes over ``x``: ``eps + sum(x^2) / width`` of every
    row as one ``baddbmm`` (each row's dot product with itself), then the root and two products.

    Why not ``F.rms_norm``: on the CPU it is a composite of seven ops (pow, sum, div, add, rsqrt, mul, mul: five passes
    and a squared temporary), a decode step runs nine, and inside the step each small op costs several times its
    isolated time (the GEMMs between them stream the weights through the caches). In-process A/B on the engine
    thread (``benchmarks.throughput.roofline``'s decode step, batch 32 over 8 adapters, 6 alternating rounds of 15
    repeats each, 2 cores): step over its GEMMs 1.547 -> 1.525 for a first version of this (six ops), 1.519 ->
    1.512 for this one against it. Not bit-identical to ``F.rms_norm``: the dot product sums in another order (a few
    ulps, ``tests/test_norms.py``)."""
    width = x.shape[-1]
    rows = x.reshape(-1, 1, width)
    scale = torch.baddbmm(x.new_full((1, 1, 1), eps), rows, rows.transpose(1, 2), alpha=1.0 / width).rsqrt_()
    return torch.mul(x, scale.view(*x.shape[:-1], 1)).mul_(weight)
