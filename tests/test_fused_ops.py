"""RoPE and SiLU-times-up in fewer ops (``engine.fused_ops``): bit-identical to the textbook forms."""

import torch
from torch import nn

from engine.fused_ops import act_mul, apply_rope, signed_sine


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_rope_equals_the_rotate_half_form_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, 64, generator=g)
    angles = torch.randn(7, 1, 32, generator=g)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    assert torch.equal(apply_rope(x, cos, signed_sine(sin)), x * cos + rotate_half(x) * sin)


def test_act_mul_equals_the_module_times_up_and_keeps_other_activations():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(5, 48, generator=g), torch.randn(5, 48, generator=g)
    for act in (nn.SiLU(), nn.GELU()):
        assert torch.equal(act_mul(act, gate.clone(), up), act(gate) * up)
