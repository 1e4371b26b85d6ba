"""The segmented Triton LoRA kernels equal the torch segment loop (random shapes; Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from engine.lora_layers import LoRABatchContext, LoRALinear, LoRASegment
from triton_interpret import DEVICE, interpreted_lora_kernels


@st.composite
def batches(draw):
    """Pool buffers, segments over slot-sorted tokens (ranks up to the pool's, some segments empty) and inputs."""
    slots = draw(st.integers(2, 5))
    max_rank = draw(st.sampled_from([4, 8, 16, 32]))
    d_in, d_out = draw(st.integers(1, 80)), draw(st.integers(1, 100))
    lengths = draw(st.lists(st.integers(0, 24), min_size=1, max_size=5).filter(any))
    segments, start = [], 0
    for n in lengths:
        slot = draw(st.integers(1, slots - 1))
        rank = draw(st.integers(1, max_rank))
        segments.append(LoRASegment(slot, start, start + n, rank, draw(st.floats(0.1, 4.0))))
        start += n
    tokens = start + draw(st.integers(0, 3))  # tokens past the last segment: base model, untouched
    return slots, max_rank, d_in, d_out, segments, tokens, draw(st.integers(0, 2**31 - 1))


def loop_reference(x, a, bt, segments, out):
    for s in segments:
        out[s.start:s.end] += s.scaling * (x[s.start:s.end] @ a[s.slot, : s.rank].T) @ bt[s.slot, : s.rank]
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_segmented_kernels_equal_the_torch_loop(batch):
    slots, max_rank, d_in, d_out, segments, tokens, seed = batch
    g = torch.Generator().manual_seed(seed)
    a, bt = torch.randn(slots, max_rank, d_in, generator=g), torch.randn(slots, max_rank, d_out, generator=g)
    x, out = torch.randn(tokens, d_in, generator=g), torch.randn(tokens, d_out, generator=g)
    a, bt, x, out = (t.to(DEVICE) for t in (a, bt, x, out))
    expected = loop_reference(x, a, bt, segments, out.clone())
    live = [s for s in segments if s.end > s.start]
    with interpreted_lora_kernels() as kernels:
        got = out.clone()
        kernels.add_lora(x, a, bt, kernels.SegmentPlan.build(live, x.device), got)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # fp32: the two sum in different orders


def test_lora_linear_takes_the_kernels_for_several_adapters_and_matches_the_loop():
    g = torch.Generator().manual_seed(0)
    a, bt = torch.randn(4, 8, 24, generator=g), torch.randn(4, 8, 20, generator=g)
    base = nn.Linear(24, 20)
    x = torch.randn(30, 24, generator=g)
    a, bt, x, base = a.to(DEVICE), bt.to(DEVICE), x.to(DEVICE), base.to(DEVICE)
    segments = [LoRASegment(1, 0, 9, 8, 0.5), LoRASegment(3, 9, 25, 3, 2.0)]
    loop_ctx, kernel_ctx = LoRABatchContext(), LoRABatchContext()
    loop_ctx.set_segments(segments)
    with torch.no_grad(), interpreted_lora_kernels():
        kernel_ctx.set_segments(segments, DEVICE)
        assert loop_ctx.plan is None and kernel_ctx.plan is not None
        assert kernel_ctx.plan.ranks.tolist() == [8, 3] and kernel_ctx.plan.scales.tolist() == [0.5, 2.0]
        got = LoRALinear(base, a, bt, kernel_ctx)(x)
        expected = LoRALinear(base, a, bt, loop_ctx)(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_kernels_refuse_a_non_contiguous_feature_axis():
    with interpreted_lora_kernels() as kernels:
        plan = kernels.SegmentPlan.build([LoRASegment(1, 0, 2, 2, 1.0)], DEVICE)
        a = torch.randn(2, 8, 4, device=DEVICE).transpose(1, 2)  # features no longer contiguous
        with pytest.raises(ValueError, match="contiguous"):
            kernels.lora_shrink(torch.randn(2, 8, device=DEVICE), a, plan)
