"""Decode steps through captured CUDA graphs (``engine.decode_graphs``). A graph replays its body on fixed-address,
padded inputs; on the CPU that body runs uncaptured on the same inputs (``capture=False``), so what a replay computes
is checked here against the eager step: padding rows, the fixed LoRA plan with empty segments (the Triton kernels
under the interpreter), the reordering. The capture itself needs a GPU (``benchmarks/gpu_check.py`` runs it); here
the engine's start-up decision is shown to fall back and serve when capture fails."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import fast_paths
from engine.check_graphs import check_batches, graph_error, random_adapters
from engine.decode_graphs import DecodeGraphs, bucket_sizes, graphs_unsupported
from engine.engine import LoRAEngine
from engine.lora_layers import LoRASegment, add_segment_loop
from engine.lora_plan import SegmentPlan
from engine.model_runner import SeqInput
from small_engines import serve_together, small_engine
from triton_interpret import interpreted_lora_kernels

PROMPT = [1, 40, 41, 42, 43]


def build(demo_assets, adapters: int = 0, **tuning) -> LoRAEngine:
    return small_engine(demo_assets, "graphs", slots=4, adapters=adapters, **tuning)


def serve(engine: LoRAEngine, demo_assets) -> list[list[int]]:
    """Greedy tokens of three requests in one batch (two adapters and the base model: bucket 4 with one pad row)."""
    return serve_together(engine, [(n, PROMPT) for n in list(demo_assets.adapters)[:2] + [None]], max_tokens=5)


@pytest.fixture(scope="module")
def eager_tokens(demo_assets) -> list[list[int]]:
    engine = build(demo_assets, adapters=2, lora_kernels="torch")
    try:
        return serve(engine, demo_assets)
    finally:
        engine.shutdown()


def install(engine: LoRAEngine, sizes=(2, 4)) -> DecodeGraphs:
    """The padded body (uncaptured) serving the engine's decode steps from its next step on."""
    def attach():
        engine.runner.graphs = DecodeGraphs(engine.runner, sizes, engine.max_model_len, capture=False)
        return engine.runner.graphs
    return engine.at_step_boundary(attach)


def test_bucket_sizes_stop_at_the_largest_batch_and_keep_a_full_one():
    assert bucket_sizes((1, 2, 4, 8, 16), 64) == (1, 2, 4, 8, 16)  # above 16 rows: eager
    assert bucket_sizes((1, 2, 4, 8, 16), 6) == (1, 2, 4, 6)        # a full batch of 6 still fits
    assert bucket_sizes((8, 16), 4) == (4,)
    assert check_batches((1, 2, 4, 8)) == [1, 7, 8]


def test_graphs_say_why_they_cannot_run():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "need CUDA" in graphs_unsupported(cpu, "flashinfer", True, True)
    assert "FlashInfer" in graphs_unsupported(cuda, "torch", True, True)
    assert "Triton" in graphs_unsupported(cuda, "flashinfer", False, True)
    assert graphs_unsupported(cuda, "flashinfer", False, False) is None  # no LoRA modules: no kernels needed
    assert graphs_unsupported(cuda, "flashinfer", True, True) is None


def test_a_fixed_plan_refills_at_its_address_and_refuses_what_it_cannot_hold():
    plan = SegmentPlan.fixed(3, 8, 16, torch.device("cpu"))
    address = plan.packed.data_ptr()
    plan.refill([LoRASegment(2, 0, 3, 16, 0.5), LoRASegment(1, 3, 4, 8, 2.0)])
    assert plan.packed.data_ptr() == address and plan.num_segments == 3
    assert plan.lengths.tolist() == [3, 1, 0] and plan.slots.tolist() == [2, 1, 0]
    assert plan.scales.tolist() == [0.5, 2.0, 0]
    assert (plan.max_length, plan.max_rank, plan.num_tokens) == (8, 16, 8)
    before = plan.packed.clone()
    with pytest.raises(ValueError, match="holds 3"):
        plan.refill([LoRASegment(i, i, i + 1, 4, 1.0) for i in range(4)])
    with pytest.raises(ValueError, match="rank 16"):
        plan.refill([LoRASegment(0, 0, 1, 32, 1.0)])
    assert torch.equal(plan.packed, before)  # a refused refill changes nothing
    plan.refill([])
    assert plan.lengths.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="only a fixed plan"):
        SegmentPlan.build([LoRASegment(0, 0, 1, 4, 1.0)], torch.device("cpu")).refill([])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2 ** -5)])
def test_the_kernels_on_a_fixed_plan_add_only_its_segments(dtype, tolerance):
    """Two segments in a plan of five over 16 rows (rows 5..15 padding): the segments get their LoRA, the padding and
    the empty segments nothing."""
    g = torch.Generator().manual_seed(3)
    slots, rank, width, rows = 4, 16, 96, 16
    x = torch.randn(rows, width, generator=g).to(dtype)
    a = torch.randn(slots, rank, width, generator=g).to(dtype)
    bt = torch.randn(slots, rank, 80, generator=g).to(dtype)
    base = torch.randn(rows, 80, generator=g).to(dtype)
    segments = [LoRASegment(1, 0, 3, 16, 0.5), LoRASegment(3, 3, 5, 8, 2.0)]
    plan = SegmentPlan.fixed(5, rows, rank, torch.device("cpu"))
    plan.refill(segments)
    expected = base.clone()
    add_segment_loop(x, a, bt, segments, expected)
    with interpreted_lora_kernels() as kernels:
        got = base.clone()
        kernels.add_lora(x, a, bt, plan, got)
    assert torch.equal(got[5:], base[5:])
    assert (got.float() - expected.float()).abs().max().item() <= tolerance * expected.float().abs().max().item()


def test_the_padded_body_computes_what_the_eager_step_does(demo_assets):
    """The start-up check's comparison, on the uncaptured body: one row, a full bucket and a padded one, over random
    adapters of three ranks and the base model's rows; the pool's slots are zeros again after."""
    with interpreted_lora_kernels():
        engine = build(demo_assets, lora_kernels="fast")
        try:
            graphs = DecodeGraphs(engine.runner, (2, 4), engine.max_model_len, capture=False)
            error = engine.at_step_boundary(lambda: graph_error(graphs, seed=0))
            assert error <= 1e-4
            assert graphs.replays == len(check_batches(graphs.sizes))
            pool = engine.pool
            assert all(r == 0 for r in pool.slot_ranks)
            assert all(not buf.any() for buf in (*pool.a_buffers.values(), *pool.bt_buffers.values()))
            free = engine.cache.allocator.num_free
            graphs.release()
            assert engine.cache.allocator.num_free == free + 1  # the scratch block went back
        finally:
            engine.shutdown()


def test_padding_rows_write_only_the_graphs_own_block(demo_assets):
    """The same three rows eagerly, then padded to four: the cache is the same everywhere but the scratch block."""
    with interpreted_lora_kernels():
        engine = build(demo_assets, lora_kernels="fast")
        try:
            eager, padded, same, wrote_scratch = engine.at_step_boundary(lambda: _eager_then_padded(engine))
        finally:
            engine.shutdown()
    assert same and wrote_scratch
    assert padded.shape == eager.shape and torch.allclose(padded, eager, atol=1e-5)


def _eager_then_padded(engine: LoRAEngine):
    runner, alloc = engine.runner, engine.cache.allocator

    graphs = DecodeGraphs(runner, (4,), engine.max_model_len, capture=False)
    tables = [[alloc.allocate() for _ in range(2)] for _ in range(3)]
    runner.forward([SeqInput(t, PROMPT * (i + 1), 0, 0) for i, t in enumerate(tables)])
    seqs = [SeqInput(t, [7 + i], len(PROMPT) * (i + 1), 0) for i, t in enumerate(tables)]
    eager = runner.forward(seqs)
    k, v = engine.cache.k.clone(), engine.cache.v.clone()
    padded = graphs.forward(seqs)
    scratch = graphs.padding_table[0]
    keep = torch.ones(engine.cache.k.shape[2], dtype=torch.bool)  # head_major: [layers, kv_heads, blocks, ...]
    keep[scratch] = False
    same = torch.equal(engine.cache.k[:, :, keep], k[:, :, keep]) and torch.equal(engine.cache.v[:, :, keep],
                                                                                  v[:, :, keep])
    wrote_scratch = not torch.equal(engine.cache.k[:, :, scratch], k[:, :, scratch])
    for t in tables:
        alloc.free(t)
    graphs.release()
    return eager, padded, same, wrote_scratch


def test_served_through_the_padded_body_the_tokens_are_the_eager_ones(demo_assets, eager_tokens):
    with interpreted_lora_kernels():
        engine = build(demo_assets, adapters=2, lora_kernels="fast")
        try:
            graphs = install(engine)
            assert serve(engine, demo_assets) == eager_tokens
            assert graphs.replays >= 4  # every decode step of the three (four tokens after the prefill)
            assert engine.stats()["graph_replays"] == graphs.replays
        finally:
            engine.shutdown()
        assert engine.runner.graphs is None and not graphs.statics  # shut down: the graphs' memory went with them


def test_a_failing_replay_drops_the_graphs_and_the_step_runs_eagerly(demo_assets, eager_tokens, monkeypatch,
                                                                    caplog):
    def broken(seqs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with interpreted_lora_kernels():
        engine = build(demo_assets, adapters=2, lora_kernels="fast")
        try:
            graphs = install(engine)
            monkeypatch.setattr(graphs, "forward", broken)
            with caplog.at_level(logging.ERROR, logger="engine.model_runner"):
                assert serve(engine, demo_assets) == eager_tokens
            assert engine.runner.graphs is None
            assert sum("run eagerly from now on" in r.getMessage() for r in caplog.records) == 1
        finally:
            engine.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the engine captures for real")
def test_on_the_cpu_auto_captures_nothing_and_a_forced_capture_falls_back(demo_assets, eager_tokens, monkeypatch):
    monkeypatch.setattr(fast_paths, "_logged", set())
    engine = build(demo_assets, adapters=2)
    try:
        graphs = engine.stats()["fast_paths"]["cuda_graphs"]
        assert graphs["used"] == "torch" and "need CUDA" in graphs["reason"] and engine.runner.graphs is None
    finally:
        engine.shutdown()
    engine = build(demo_assets, adapters=2, cuda_graphs="fast")
    try:
        graphs = engine.stats()["fast_paths"]["cuda_graphs"]
        assert graphs["intended"] == "cuda_graphs" and graphs["used"] == "torch"
        assert "failed its start-up check" in graphs["reason"] and engine.runner.graphs is None
        assert serve(engine, demo_assets) == eager_tokens
        assert engine.cache.allocator.num_used == 0  # the failed capture gave its scratch block back
    finally:
        engine.shutdown()


def test_the_graph_check_refuses_a_pool_that_holds_adapters(demo_assets):
    engine = build(demo_assets, adapters=1)
    try:
        uid = engine.current_uid(list(demo_assets.adapters)[0])
        engine.at_step_boundary(lambda: engine.pool.prepare_lora_batch({uid}))
        engine.at_step_boundary(engine.pool.release_batch)
        with pytest.raises(RuntimeError, match="empty slots only"):
            with random_adapters(engine.pool, 0):
                pass
    finally:
        engine.shutdown()


def test_a_replay_s_indices_are_the_eager_layout_s():
    """What a replay copies to its fixed buffers (token ids, positions, write blocks and offsets) is what the eager
    step's layout computes for the same rows, padding included."""
    from engine.attention_layout import StepLayout
    from engine.decode_graphs import DecodeRows, _host_indices

    tables, starts = [[5, 9], [3], [7, 2, 4], [11]], [17, 0, 40, 0]
    rows = DecodeRows(tables, starts, 16)
    layout = StepLayout(tables, starts, [1] * 4, 16, torch.device("cpu"))
    host = _host_indices([8, 9, 10, 0], rows)
    assert host[0].tolist() == [8, 9, 10, 0]
    assert host[1].tolist() == layout.positions.tolist()
    assert host[2].tolist() == layout.write_blocks.tolist() and host[3].tolist() == layout.write_offsets.tolist()
    assert rows.kv_lens == layout.kv_lens and rows.counts == layout.counts
    with pytest.raises(ValueError, match="cannot hold position 16"):
        DecodeRows([[1]], [16], 16)


def test_flashinfer_plans_a_graph_step_on_its_graph_wrappers(monkeypatch):
    """FlashInfer is not on this machine: a recording stand-in shows which wrapper each step plans and runs on, and
    that a graph bucket's wrappers are built in CUDA-graph mode with buffers of its size."""
    import sys
    import types
    from types import SimpleNamespace

    from engine.attention_flashinfer import FlashInferPagedAttention
    from engine.decode_graphs import DecodeRows

    made = []

    class Wrapper:
        def __init__(self, workspace, layout, use_cuda_graph=False, **buffers):
            self.graph, self.buffers, self.plans, self.runs = use_cuda_graph, buffers, [], 0
            made.append(self)

        def plan(self, qo, kv_indptr, indices, last, *args, **kwargs):
            self.plans.append((qo.tolist(), kv_indptr.tolist(), indices.tolist(), last.tolist()))

        def run(self, q, kv):
            self.runs += 1
            return q

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=Wrapper))
    cache = SimpleNamespace(k=torch.zeros(1, 1), v=torch.zeros(1, 1))
    attention = FlashInferPagedAttention(cache, num_heads=2, num_kv_heads=1, head_dim=4)
    attention.prepare_graph(4, 4 * 8, [None])
    graph_wrapper = made[-1]
    assert graph_wrapper.graph and graph_wrapper.buffers["qo_indptr_buf"].shape == (5,)
    assert graph_wrapper.buffers["paged_kv_indices_buf"].shape == (32,)
    rows = DecodeRows([[5, 9], [3], [11], [11]], [17, 0, 0, 0], 16)  # two real rows, two padding rows on block 11
    attention.begin_step(rows, [None], 0.5, graph_rows=4)
    q = torch.zeros(4, 2, 4)
    attention(0, q, None, None, rows, None, 0.5)
    assert graph_wrapper.plans == [([0, 1, 2, 3, 4], [0, 2, 3, 4, 5], [5, 9, 3, 11, 11], [2, 1, 1, 1])]
    assert graph_wrapper.runs == 1
    attention.begin_step(rows, [None], 0.5)  # an eager step: its own wrapper, not the graph's
    attention(0, q, None, None, rows, None, 0.5)
    eager_wrapper = made[-1]
    assert not eager_wrapper.graph and eager_wrapper.runs == 1 and graph_wrapper.runs == 1


def test_a_check_that_replays_nothing_passes_nothing(demo_assets):
    """A KV cache with no room for the check's batches: the check raises (the engine then serves eagerly) instead of
    reporting an error of 0 for batches it never replayed."""
    with interpreted_lora_kernels():
        engine = build(demo_assets, lora_kernels="fast")
        try:
            def starved():
                graphs = DecodeGraphs(engine.runner, (2,), engine.max_model_len, capture=False)
                alloc = engine.cache.allocator
                held = [alloc.allocate() for _ in range(alloc.num_free)]
                try:
                    with pytest.raises(RuntimeError, match="nothing was replayed"):
                        graph_error(graphs, seed=0)
                finally:
                    alloc.free(held)
                    graphs.release()
            engine.at_step_boundary(starved)
        finally:
            engine.shutdown()
