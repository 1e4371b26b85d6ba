"""LoRALinear: the segment loop equals the per-token reference; when the segmented kernels are used."""

import torch
from torch import nn

from engine.lora_layers import LoRABatchContext, LoRALinear, LoRASegment


def make_layer(slots=4, max_rank=8, d_in=12, d_out=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(slots, max_rank, d_in)
    bt = torch.zeros(slots, max_rank, d_out)
    ranks = [0, 2, 8, 4]  # slot 0 is the base model's zero slot
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, d_in, generator=g)
        bt[s, :r] = torch.randn(r, d_out, generator=g)
    base = nn.Linear(d_in, d_out)
    return base, a, bt, ranks


def reference(x, base, a, bt, token_slots, ranks, scales):
    out = base(x)
    for t, s in enumerate(token_slots):
        r = ranks[s]
        if r:
            out[t] += scales[s] * (x[t] @ a[s, :r].T) @ bt[s, :r]
    return out


def test_the_segment_loop_equals_the_per_token_reference():
    base, a, bt, ranks = make_layer()
    scales = [0.0, 0.5, 2.0, 1.5]
    token_slots = [1, 1, 0, 2, 2, 2, 3]
    x = torch.randn(len(token_slots), 12)
    segments, start = [], 0
    for s in [1, 0, 2, 3]:
        n = token_slots.count(s)
        segments.append(LoRASegment(s, start, start + n, ranks[s], scales[s]))
        start += n
    expected = reference(x, base, a, bt, token_slots, ranks, scales)
    with torch.no_grad():
        ctx = LoRABatchContext()
        ctx.set_segments(segments)
        assert ctx.plan is None  # no device: the torch loop
        got = LoRALinear(base, a, bt, ctx)(x)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_single_adapters_and_base_only_batches_use_no_kernel():
    ctx = LoRABatchContext()
    ctx.set_segments([LoRASegment(1, 0, 65, 4, 1.0)], torch.device("cpu"))
    assert ctx.plan is None  # one adapter: a plain matmul pair is already one kernel each
    ctx.set_segments([LoRASegment(0, 0, 3, 0, 0.0)], torch.device("cpu"))
    assert ctx.segments == [] and ctx.plan is None  # base model only: no LoRA work
