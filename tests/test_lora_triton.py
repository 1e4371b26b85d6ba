"""The segmented Triton LoRA kernels (split-K shrink, fused slices) equal the torch segment loop: random shapes,
prefill and decode, 1-16 segments, fp32 and bf16 (Triton's interpreter on the CPU, compiled on CUDA).

Tolerances: fp32 1e-4 of the largest output magnitude (the two paths sum in different orders; outputs reach
a few hundred, where fp32 keeps about 5 decimals after the point). bf16: the largest difference is at most
``BF16_TOL`` (2^-5, 8 bf16 ulps) of the largest output magnitude: bf16 keeps 8 significant bits, both paths
round the shrink result to bf16 before expanding it and torch's CPU path rounds its product again before adding
it, so they differ by a few roundings of sums of that size (the worst of 60 random cases measured 3.2 ulps). A
wrong slot, slice, rank or split is off by the size of the LoRA term itself.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("hypothesis")  # benchmarks/gpu_check runs this file on a bare python3: skip there, never fail
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine.lora_layers import LoRABatchContext, LoRALinear, LoRASegment  # noqa: E402
from engine.lora_plan import SegmentPlan  # noqa: E402
from triton_interpret import DEVICE, interpreted_lora_kernels  # noqa: E402

BF16_TOL = 2 ** -5


@st.composite
def batches(draw):
    """Pool buffers for 1-3 slices sharing an input, segments over slot-sorted tokens (prefill: up to 40 tokens
    each; decode: 1 token each, up to 16 segments; some empty), ranks up to the pool's, inputs."""
    slots = draw(st.integers(2, 17))
    max_rank = draw(st.sampled_from([4, 8, 16, 32, 64]))
    d_in = draw(st.integers(1, 160))
    widths = draw(st.lists(st.integers(1, 100), min_size=1, max_size=3))
    decode = draw(st.booleans())
    lengths = draw(st.lists(st.integers(1, 1) if decode else st.integers(0, 40), min_size=1, max_size=16)
                   .filter(any))
    segments, start = [], 0
    for n in lengths:
        slot = draw(st.integers(1, slots - 1))
        rank = draw(st.integers(1, max_rank))
        segments.append(LoRASegment(slot, start, start + n, rank, draw(st.floats(0.1, 4.0))))
        start += n
    tokens = start + draw(st.integers(0, 3))  # tokens past the last segment: base model, untouched
    target = draw(st.sampled_from([1, 64, 4096]))  # split-K off, some, as many splits as K chunks
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return slots, max_rank, d_in, widths, segments, tokens, target, dtype, draw(st.integers(0, 2**31 - 1))


def torch_path(x, a_buffers, bt_buffers, segments, outs):
    """What ``LoRALinear`` does without the kernels, one slice at a time."""
    for a, bt, out in zip(a_buffers, bt_buffers, outs):
        for s in segments:
            shrink = x[s.start:s.end] @ a[s.slot, : s.rank].t()
            out[s.start:s.end].addmm_(shrink, bt[s.slot, : s.rank], alpha=s.scaling)
    return outs


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:  # 1e-4 of the output's scale: at |out| ~ 100 a different summation order alone
        scale = max(1.0, expected.abs().max().item())  # moves the 6th digit (1.4e-4 seen at one element)
        torch.testing.assert_close(got, expected, atol=1e-4 * scale, rtol=1e-4)
        return
    worst = (got.float() - expected.float()).abs().max().item()
    assert worst <= BF16_TOL * max(1.0, expected.float().abs().max().item()), worst


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_split_k_fused_kernels_equal_the_torch_path(batch):
    slots, max_rank, d_in, widths, segments, tokens, target, dtype, seed = batch
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(slots, max_rank, d_in, generator=g).to(DEVICE, dtype) for _ in widths]
    bt = [torch.randn(slots, max_rank, w, generator=g).to(DEVICE, dtype) for w in widths]
    x = torch.randn(tokens, d_in, generator=g).to(DEVICE, dtype)
    outs = [torch.randn(tokens, w, generator=g).to(DEVICE, dtype) for w in widths]
    expected = torch_path(x, a, bt, segments, [o.clone() for o in outs])
    live = [s for s in segments if s.end > s.start]
    with interpreted_lora_kernels() as kernels:
        got = [o.clone() for o in outs]
        kernels.add_lora_slices(x, a, bt, SegmentPlan.build(live, x.device, tokens), got, target)
    for g_out, e_out, o in zip(got, expected, outs):
        assert_matches(g_out, e_out, dtype)
        assert torch.equal(g_out[live[-1].end:], o[live[-1].end:])  # base-model rows untouched


def test_split_k_covers_every_input_feature_once():
    """Splits are whole BLOCK_K chunks, cover the input, and grow with the programs wanted (decode: few tiles)."""
    pytest.importorskip("triton")
    from engine import lora_triton

    plan = SegmentPlan.build([LoRASegment(1, i, i + 1, 16, 1.0) for i in range(8)], torch.device("cpu"))
    assert lora_triton.split_k(plan, 1, 4096, 1) == (1, 4096)
    splits, per_split = lora_triton.split_k(plan, 1, 4096, 264)
    assert per_split % lora_triton.BLOCK_K == 0 and splits * per_split >= 4096 > (splits - 1) * per_split
    assert 264 // 2 <= 8 * splits <= 264  # near the target: whole chunks per split round the count down
    assert lora_triton.split_k(plan, 3, 4096, 264)[0] < splits  # fused slices already add programs


def test_the_plan_aligns_every_field_to_16_bytes():
    """Triton compiles one variant per pointer-alignment class: the plan's fields never change class."""
    for n in range(1, 10):
        plan = SegmentPlan.build([LoRASegment(1, i, i + 1, 4, 0.5) for i in range(n)], torch.device("cpu"))
        assert all(t.data_ptr() % 16 == 0 for t in (plan.starts, plan.lengths, plan.slots, plan.ranks, plan.scales))
        assert plan.scales.tolist() == [0.5] * n and plan.num_tokens == n


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
        kernel_ctx.set_segments(segments, DEVICE, num_tokens=30)
        assert loop_ctx.plan is None and kernel_ctx.plan is not None
        assert kernel_ctx.plan.ranks.tolist() == [8, 3] and kernel_ctx.plan.scales.tolist() == [0.5, 2.0]
        got = LoRALinear(base, a, bt, kernel_ctx)(x)
        expected = LoRALinear(base, a, bt, loop_ctx)(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_kernels_refuse_a_non_contiguous_feature_axis():
    with interpreted_lora_kernels() as kernels:
        plan = SegmentPlan.build([LoRASegment(1, 0, 2, 2, 1.0)], DEVICE)
        a = torch.randn(2, 8, 4, device=DEVICE).transpose(1, 2)  # features no longer contiguous
        with pytest.raises(ValueError, match="contiguous"):
            kernels.lora_shrink(torch.randn(2, 8, device=DEVICE), [a], plan)
