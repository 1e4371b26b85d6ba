"""q/k/v (and gate/up) of one layer as one base GEMM: the projections of one input share one weight.

Why: on the CPU a GEMM costs less per output the wider it is and each call is a parallel
region of its own (a fork/join of the threads), so three GEMMs of 1024/512/512 outputs cost
more than one of 2048; vLLM merges them the same way (``QKVParallelLinear``). The merged
weight is built once and each module's own weight becomes a view into it, so the weights are
not held twice and every other reader of the modules (the LoRA kernels' path, PEFT checks)
sees the same numbers. LoRA is added per module into its slice of the merged output.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .lora_layers import LoRALinear, add_segment_loop


def _base(module: nn.Module) -> nn.Linear:
    return module.base if isinstance(module, LoRALinear) else module


class MergedLinear:
    """``modules`` (plain or LoRA-wrapped ``nn.Linear``s of one input) computed by one GEMM."""

    def __init__(self, modules: Sequence[nn.Module]):
        bases = [_base(m) for m in modules]
        self.modules = list(modules)
        self.sizes = [b.weight.shape[0] for b in bases]
        with torch.no_grad():
            self.weight = torch.cat([b.weight.detach() for b in bases])
            biased = [b.bias is not None for b in bases]
            self.bias: Optional[torch.Tensor] = None
            if any(biased):
                self.bias = torch.cat([b.bias.detach() if b.bias is not None
                                       else torch.zeros(n, dtype=self.weight.dtype, device=self.weight.device)
                                       for b, n in zip(bases, self.sizes)])
        at = 0
        for b, n in zip(bases, self.sizes):  # the modules now read the merged storage: one copy of the weights
            b.weight.data = self.weight[at:at + n]
            if b.bias is not None:
                b.bias.data = self.bias[at:at + n]
            at += n

    @classmethod
    def mergeable(cls, modules: Sequence[nn.Module]) -> bool:
        """Plain ``nn.Linear`` bases of one dtype and device and the same input size (a quantized or otherwise
        special linear is left alone)."""
        bases = [_base(m) for m in modules]
        if not all(type(b) is nn.Linear for b in bases):
            return False
        w = bases[0].weight
        return all(b.weight.dtype == w.dtype and b.weight.device == w.device and b.weight.shape[1] == w.shape[1]
                   for b in bases)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each module's output (column slices of one GEMM's output), its LoRA added by the torch segment loop."""
        out = F.linear(x, self.weight, self.bias)
        outs = list(out.split(self.sizes, dim=-1))
        flat_x = x.reshape(-1, x.shape[-1])
        for module, o in zip(self.modules, outs):
            if isinstance(module, LoRALinear) and module.context.segments:
                add_segment_loop(flat_x, module.a_buffer, module.bt_buffer, module.context.segments,
                                 o.view(-1, o.shape[-1]))  # a view: the sum lands in ``out``
        return outs
