"""LoRALinear: the segment loop equals the per-token reference; when the segmented kernels are used."""

import torch
from torch import nn

from engine.lora_layers import LoRABatchContext, LoRALinear, LoRASegment


def make_layer(slots=4, max_rank=8, d_in=12, d_out=10, seed=0, ranks=(0, 2, 8, 4)):
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(slots, max_rank, d_in)
    bt = torch.zeros(slots, max_rank, d_out)
    ranks = list(ranks)  # slot 0 is the base model's zero slot
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


# A decode step's segments as one padded bmm pair (``engine.lora_padded``): the same numbers as the loop.

def decode_segments(slot_rows: list[tuple[int, int]], ranks, scales) -> list[LoRASegment]:
    """(slot, rows) in slot order, laid out one after another."""
    segments, start = [], 0
    for slot, n in slot_rows:
        segments.append(LoRASegment(slot, start, start + n, ranks[slot], scales[slot]))
        start += n
    return segments


def run_both(segments, x, base, a, bt):
    """(padded path output, segment loop output, the padded grouping)."""
    with torch.no_grad():
        padded_ctx, loop_ctx = LoRABatchContext(), LoRABatchContext()
        padded_ctx.set_segments(segments, decode_on=x.device)
        loop_ctx.set_segments(segments)
        return LoRALinear(base, a, bt, padded_ctx)(x), LoRALinear(base, a, bt, loop_ctx)(x), padded_ctx.padded


def test_equal_decode_segments_run_as_views_and_equal_the_loop():
    base, a, bt, _ = make_layer(slots=5, max_rank=8)
    ranks, scales = [0, 8, 8, 8, 8], [0.0, 2.0, 2.0, 2.0, 2.0]
    segments = decode_segments([(0, 2), (1, 3), (2, 3), (3, 3)], ranks, scales)  # the base rows first
    x = torch.randn(11, 12)
    got, loop, padded = run_both(segments, x, base, a, bt)
    assert padded is not None and padded.gather is None  # tiled: no gather
    assert [(t.first_slot, t.num_slots, t.rows, t.first_row) for t in padded.tiles] == [(1, 3, 3, 2)]
    torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)  # bmm and mm may sum in another order


def test_segments_split_by_a_slot_without_rows_run_as_two_tiles_and_equal_the_loop():
    base, a, bt, ranks = make_layer()  # ranks 0, 2, 8, 4
    scales = [0.0, 0.5, 2.0, 1.5]
    segments = decode_segments([(1, 1), (3, 4)], ranks, scales)  # slot 2 between them has no rows
    x = torch.randn(5, 12)
    got, loop, padded = run_both(segments, x, base, a, bt)
    assert padded is not None and padded.gather is None
    assert [(t.first_slot, t.num_slots, t.rows, t.first_row, t.scale) for t in padded.tiles] == [
        (1, 1, 1, 0, 0.5), (3, 1, 4, 1, 1.5)]
    torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)
    token_slots = [1, 3, 3, 3, 3]
    torch.testing.assert_close(got, reference(x, base, a, bt, token_slots, ranks, scales), atol=1e-5, rtol=1e-5)


def test_uneven_decode_segments_with_a_gap_and_mixed_ranks_are_gathered_and_equal_the_loop():
    ranks, scales = (0, 2, 8, 4, 0, 6), [0.0, 0.5, 2.0, 1.5, 0.0, 1.0]
    base, a, bt, ranks = make_layer(slots=6, ranks=ranks)
    segments = decode_segments([(1, 1), (2, 3), (3, 2), (5, 2)], ranks, scales)  # slot 4 has no rows
    x = torch.randn(8, 12)
    got, loop, padded = run_both(segments, x, base, a, bt)
    assert padded is not None and padded.tiles == () and padded.gather is not None and padded.num_slots == 5
    torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)
    token_slots = [1, 2, 2, 2, 3, 3, 5, 5]
    torch.testing.assert_close(got, reference(x, base, a, bt, token_slots, ranks, scales), atol=1e-5, rtol=1e-5)


def test_sparse_slots_one_adapter_and_prefill_steps_keep_the_loop():
    ranks, scales = [0] + [4] * 7, [0.0] + [1.0] * 7
    ctx = LoRABatchContext()
    ctx.set_segments(decode_segments([(1, 2), (4, 1), (7, 2)], ranks, scales), decode_on=torch.device("cpu"))
    assert ctx.padded is None  # 3 tiles, 7 slots for 3 adapters: padding blocks would cost more than the loop saves
    ctx.set_segments(decode_segments([(1, 2), (7, 2)], ranks, scales), decode_on=torch.device("cpu"))
    assert ctx.padded is not None and len(ctx.padded.tiles) == 2  # two tiles: no padding block
    ctx.set_segments(decode_segments([(2, 4)], ranks, scales), decode_on=torch.device("cpu"))
    assert ctx.padded is None  # one adapter: already one matmul pair
    ctx.set_segments(decode_segments([(1, 2), (2, 2)], ranks, scales))
    assert ctx.padded is None  # not a decode step



def test_kept_views_follow_the_steps_slots_and_ranks():
    """One layer over several decode steps whose runs of slots and largest ranks change: its kept A/Bt views
    (``RunViews``) are rebuilt when they do, and every step equals the segment loop."""
    base, a, bt, ranks = make_layer(slots=4, max_rank=8)  # ranks 0, 2, 8, 4
    scales = [0.0, 0.5, 2.0, 1.5]
    ctx, loop_ctx = LoRABatchContext(), LoRABatchContext()
    layer = LoRALinear(base, a, bt, ctx)
    steps = [[(1, 2), (2, 2), (3, 2)], [(1, 1), (3, 4)], [(1, 3), (3, 1)], [(2, 2), (3, 2)], [(1, 1), (2, 3), (3, 2)],
             [(1, 2), (2, 2), (3, 2)]]
    with torch.no_grad():
        for slot_rows in steps:
            segments = decode_segments(slot_rows, ranks, scales)
            x = torch.randn(segments[-1].end, 12)
            ctx.set_segments(segments, decode_on=x.device)
            loop_ctx.set_segments(segments)
            assert ctx.padded is not None
            torch.testing.assert_close(layer(x), LoRALinear(base, a, bt, loop_ctx)(x), atol=1e-5, rtol=1e-5)
            p = ctx.padded
            runs = [(t.first_slot, t.num_slots) for t in p.tiles] or [(p.first_slot, p.num_slots)]
            assert all((*run, p.rank) in layer.padded_views.views for run in runs)
