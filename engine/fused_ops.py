"""RoPE and SiLU-times-up with fewer tensor ops than the textbook forms, for every layer of every step.

Why: a CPU decode step is a few large GEMMs and many tiny element-wise ops, each paying dispatch and an
allocation. ``x * cos + rotate_half(x) * sin`` is seven ops (two slices, a negation, a concatenation, two
products, a sum) per tensor; with the sign folded into the sine once per step it is four (a roll and
three arithmetic ops, two in place). ``act(gate) * up`` allocates two temporaries; SiLU in place on the gate
(the projection's fresh output) and the product in place allocate none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == x.roll(half, -1) * signed_sine(sin)``, exactly
    (a roll by half of the last dimension swaps its halves; a negation is exact)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' Llama rotation) in four ops, bit-identical: the same
    products and sum (``addcmul_`` would be three, but it rounds differently: logits moved by ~2e-6)."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(signed_sin))


def is_silu(act_fn: nn.Module) -> bool:
    """transformers' ``SiLUActivation`` (``hidden_act: silu``) or torch's ``nn.SiLU``: plain ``F.silu``."""
    return isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def act_mul(act_fn: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act_fn(gate) * up``; for SiLU in place on ``gate``, which the caller must own (a fresh projection)."""
    if is_silu(act_fn):
        return F.silu(gate, inplace=True).mul_(up)
    return act_fn(gate) * up
