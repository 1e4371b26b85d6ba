"""oneDNN's linear for the base projections on the CPU (``engine.cpu_gemm``): the same numbers as ``F.linear`` within
fp32's summation-order differences, only plain ``nn.Linear``s routed through it, and the LoRA layers adding their
deltas on top of it as on ``F.linear``."""

import pytest
import torch
from torch import nn

from engine import cpu_gemm
from engine.lora_layers import LoRABatchContext, LoRALinear, LoRASegment, fused_projections

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows, fan_in, fan_out, bias", [(1, 64, 48, False), (7, 96, 80, True), (300, 256, 130, True)])
def test_onednn_linear_equals_f_linear(rows, fan_in, fan_out, bias):
    torch.manual_seed(rows)
    module = nn.Linear(fan_in, fan_out, bias=bias)
    x = torch.randn(rows, fan_in)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_gemm.onednn_linear(module, x), module(x), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_the_start_up_check_measures_float32_error():
    assert cpu_gemm.gemm_error(torch.float32, seed=0) <= 1e-5


def test_only_float32_on_the_cpu_takes_it_by_default():
    assert "for the CPU" in cpu_gemm.unsupported(torch.device("cuda"), torch.float32)
    assert "float32 only" in cpu_gemm.unsupported(torch.device("cpu"), torch.bfloat16)
    if torch.backends.mkldnn.is_available():
        assert cpu_gemm.unsupported(torch.device("cpu"), torch.float32) is None


def test_project_routes_plain_linears_only():
    calls = []

    def linear(module, x):
        calls.append(module)
        return module(x)

    plain, norm = nn.Linear(4, 3), nn.LayerNorm(4)
    x = torch.randn(2, 4)
    cpu_gemm.project(plain, x, linear)
    cpu_gemm.project(norm, x, linear)
    assert calls == [plain]


@needs_onednn
def test_lora_layers_add_their_delta_on_the_onednn_base():
    """Decode (padded), prefill (segment loop) and base-only steps: the LoRA layers on oneDNN's base equal them on
    ``F.linear``'s, also through ``fused_projections``."""
    torch.manual_seed(0)
    slots, rank, d_in, d_out = 4, 8, 32, 24
    bases = [nn.Linear(d_in, d_out) for _ in range(2)]
    buffers = [(torch.randn(slots, rank, d_in), torch.randn(slots, rank, d_out)) for _ in bases]
    for a, bt in buffers:
        a[0], bt[0] = 0, 0
    steps = {
        "decode": ([LoRASegment(1, 0, 2, 8, 0.5), LoRASegment(2, 2, 3, 4, 2.0)], 3, True),
        "prefill": ([LoRASegment(3, 0, 9, 8, 1.5), LoRASegment(1, 9, 20, 2, 0.5)], 20, False),
        "base only": ([], 5, False),
    }
    for name, (segments, tokens, decode) in steps.items():
        x = torch.randn(tokens, d_in)
        outs = {}
        for linear in (cpu_gemm.module_linear, cpu_gemm.onednn_linear):
            ctx = LoRABatchContext(base_linear=linear)
            ctx.set_segments(segments, decode_on=torch.device("cpu") if decode else None)
            layers = [LoRALinear(b, a, bt, ctx) for b, (a, bt) in zip(bases, buffers)]
            with torch.inference_mode():
                outs[linear] = fused_projections(layers, x, linear)
        for fast, plain in zip(outs[cpu_gemm.onednn_linear], outs[cpu_gemm.module_linear]):
            torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5, msg=name)


@needs_onednn
def test_a_hooked_module_runs_itself():
    """A forward hook (the lifecycle tests park the engine at the LM head with one) still fires."""
    module, seen = nn.Linear(8, 4), []
    module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    cpu_gemm.onednn_linear(module, torch.randn(3, 8))
    assert seen == [torch.Size([3, 8])]
