"""MergedLinear: one GEMM for q/k/v (gate/up) equals the modules run one by one, LoRA and biases included,
and the modules' weights become views of the merged weight (no second copy)."""

from __future__ import annotations

import torch
from torch import nn

from engine.lora_layers import LoRABatchContext, LoRALinear, LoRASegment
from engine.merged_linear import MergedLinear


def lora(base: nn.Linear, context: LoRABatchContext, slots: int = 3, rank: int = 4, seed: int = 0) -> LoRALinear:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, rank, base.in_features, generator=g)
    bt = torch.randn(slots, rank, base.out_features, generator=g)
    a[0], bt[0] = 0, 0  # slot 0: the base model
    return LoRALinear(base, a, bt, context)


def test_merged_outputs_equal_each_module_alone_with_lora_biases_and_an_untargeted_module():
    torch.manual_seed(0)
    context = LoRABatchContext()
    q = lora(nn.Linear(16, 12, bias=True), context, seed=1)
    k = nn.Linear(16, 8, bias=False)                      # not targeted: a plain linear between two LoRA ones
    v = lora(nn.Linear(16, 8, bias=True), context, seed=2)
    x = torch.randn(9, 16)
    context.set_segments([LoRASegment(1, 0, 4, 4, 0.5), LoRASegment(2, 4, 7, 2, 2.0)])   # tokens 7-8: base
    with torch.no_grad():
        expected = [q(x), k(x), v(x)]
        merged = MergedLinear([q, k, v])
        got = merged(x)
        for e, o in zip(expected, got):
            torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
        assert q.base.weight.data_ptr() == merged.weight.data_ptr()                # views, not copies
        assert v.base.bias.data_ptr() == merged.bias.data_ptr() + (12 + 8) * merged.bias.element_size()
        torch.testing.assert_close(q(x), expected[0])        # the module alone still reads the same numbers


def test_special_linears_are_not_merged():
    class Quantized(nn.Linear):
        pass

    assert MergedLinear.mergeable([nn.Linear(4, 4), nn.Linear(4, 2)])
    assert not MergedLinear.mergeable([nn.Linear(4, 4), Quantized(4, 2)])
    assert not MergedLinear.mergeable([nn.Linear(4, 4), nn.Linear(4, 2).double()])
    assert not MergedLinear.mergeable([nn.Linear(4, 4), nn.Linear(5, 2)])
