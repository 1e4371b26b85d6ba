"""The fast RMSNorm equals transformers' own norm modules (fp32 to a few ulps: the sums run in another order; bf16
to one rounding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from engine.norms import is_llama_style, rms_norm


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_equals_the_module(cls, dtype):
    torch.manual_seed(0)
    norm = cls(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(7, 64) * 3).to(dtype)
    assert is_llama_style(norm)
    if dtype == torch.float32:
        torch.testing.assert_close(rms_norm(norm, x), norm(x), atol=1e-6, rtol=1e-6)
        heads = x.view(7, 4, 16)[..., :16].repeat(1, 1, 4)  # a Qwen3-style per-head input: [tokens, heads, dim]
        torch.testing.assert_close(rms_norm(norm, heads), norm(heads), atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(rms_norm(norm, x), norm(x), atol=2 ** -7, rtol=2 ** -7)


def test_other_norms_run_their_own_forward():
    layer = nn.LayerNorm(8)
    x = torch.randn(3, 8)
    assert not is_llama_style(layer)
    assert torch.equal(rms_norm(layer, x), layer(x))
