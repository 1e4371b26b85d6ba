"""Start-up self-check: each fast path the engine would use runs once against the torch path; when it cannot be
imported, raises, or gives wrong numbers, the engine still starts, serves the same tokens on torch, and reports
which path it uses (``stats()["fast_paths"]``, which the worker's snapshot carries)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deployments.config import AppArgs
from engine import cpu_gemm, fast_paths
from engine.engine import LoRAEngine
from engine.tuning import EngineTuning
from small_engines import serve_together, small_engine
from triton_interpret import interpreted_lora_kernels, recorded_variants

PROMPT = [1, 40, 41, 42, 43]


def build(demo_assets, **tuning) -> LoRAEngine:
    return small_engine(demo_assets, "fast-paths", **tuning)


def serve_two_adapters(engine: LoRAEngine, demo_assets) -> list[list[int]]:
    """Greedy tokens of two adapters' requests in one batch (the kernels' case: two segments)."""
    return serve_together(engine, [(n, PROMPT) for n in list(demo_assets.adapters)[:2]], max_tokens=4)


@pytest.fixture(scope="module")
def torch_tokens(demo_assets) -> list[list[int]]:
    engine = build(demo_assets, attention="torch", lora_kernels="torch", cpu_gemm="torch", sparse_scores="torch")
    try:
        paths = engine.stats()["fast_paths"]
        assert paths["lora_kernels"]["used"] == paths["attention"]["used"] == paths["cpu_gemm"]["used"] == "torch"
        assert paths["sparse_scores"]["used"] == "torch" and not engine.runner.attention.sparse_scores
        assert engine.context.base_linear is cpu_gemm.module_linear
        assert paths["lora_kernels"]["reason"] == "set to torch"
        return serve_two_adapters(engine, demo_assets)
    finally:
        engine.shutdown()


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(fast_paths, "_logged", set())


def test_auto_on_the_cpu_tries_nothing_and_says_why(demo_assets, torch_tokens):
    engine = build(demo_assets)
    try:
        paths = engine.stats()["fast_paths"]
        assert paths["attention"]["used"] == "torch" and "FlashInfer takes CUDA" in paths["attention"]["reason"]
        assert paths["lora_kernels"]["used"] == "torch" and paths["lora_kernels"]["check_error"] is None
        assert serve_two_adapters(engine, demo_assets) == torch_tokens
    finally:
        engine.shutdown()


def test_kernels_that_pass_the_check_serve_the_same_tokens(demo_assets, torch_tokens):
    """The real kernels (interpreted on the CPU) pass the check at every BLOCK_R and serve."""
    with interpreted_lora_kernels():
        engine = build(demo_assets, lora_kernels="fast")
        try:
            lora = engine.stats()["fast_paths"]["lora_kernels"]
            assert lora["used"] == "triton" and lora["reason"] == "" and lora["check_error"] <= 1e-4
            assert engine.runner.kernel_device is not None
            assert serve_two_adapters(engine, demo_assets) == torch_tokens
        finally:
            engine.shutdown()


def test_serving_launches_no_kernel_variant_the_start_up_check_did_not(demo_assets, tmp_path):
    """Nothing compiles after ready: every launch while serving (prefills and decodes of two and three adapters of
    ranks 4 to 40, so BLOCK_R 16 and 64, adapters swapped into other slots) has a specialisation key the start-up
    check already launched, so on a GPU it finds its kernel compiled."""
    from transformers import AutoConfig

    from engine.demo import write_demo_adapter
    from pool.shapes import LoRAModelShape

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    shape = LoRAModelShape.from_hf_config(AutoConfig.from_pretrained(demo_assets.model_dir), modules)
    wide = write_demo_adapter(tmp_path / "rank40", shape, rank=40, target_modules=modules, alpha=40, seed=7)
    with interpreted_lora_kernels() as kernels, recorded_variants(kernels) as launched:
        engine = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=4, max_lora_rank=64,
                                    max_model_len=128, kv_cache_bytes=1 << 20).engine_config("variants"),
                            tuning=EngineTuning(lora_kernels="fast"))
        try:
            assert engine.stats()["fast_paths"]["lora_kernels"]["used"] == "triton"
            checked = set(launched)
            launched.clear()
            engine.register_adapter("wide", str(wide))
            for name in ("demo-0", "demo-1", "demo-2"):
                engine.register_adapter(name, str(demo_assets.adapters[name]))
            def batch(names, lengths):
                serve_together(engine, [(n, PROMPT * k) for n, k in zip(names, lengths)], max_tokens=3)

            batch(["demo-0", "wide", "demo-2"], [1, 3, 5])
            batch(["demo-1", "demo-0"], [4, 2])  # demo-1 takes another adapter's slot
            batch(["wide", "demo-1", "demo-2", "demo-0"], [2, 1, 6, 3])
        finally:
            engine.shutdown()
    assert {key[0] for key in launched} == {"_shrink_kernel", "_expand_kernel"}
    assert launched <= checked, sorted(launched - checked)


def _no_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # ``import triton`` raises ImportError
    monkeypatch.delitem(sys.modules, "engine.lora_triton", raising=False)
    monkeypatch.delattr(sys.modules["engine"], "lora_triton", raising=False)  # else ``from . import`` finds it


def _kernel_raises(monkeypatch):
    import engine.lora_triton as kernels

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(kernels, "add_lora_slices", broken)


def _wrong_numbers(monkeypatch):
    import engine.lora_triton as kernels

    def off_by_one(x, a_buffers, bt_buffers, plan, outs, target_programs=1):
        for out in outs:
            out += 1.0

    monkeypatch.setattr(kernels, "add_lora_slices", off_by_one)


@pytest.mark.parametrize("breakage, reason", [(_no_triton, "ModuleNotFoundError"), (_kernel_raises, "no kernel image"),
                                              (_wrong_numbers, "differs from torch")])
def test_a_broken_lora_kernel_falls_back_to_torch(demo_assets, torch_tokens, monkeypatch, fresh_log, caplog,
                                                  breakage, reason):
    breakage(monkeypatch)
    engine = build(demo_assets, lora_kernels="fast")
    try:
        lora = engine.stats()["fast_paths"]["lora_kernels"]
        assert lora["intended"] == "triton" and lora["used"] == "torch" and reason in lora["reason"]
        assert engine.runner.kernel_device is None
        assert serve_two_adapters(engine, demo_assets) == torch_tokens
        assert sum("lora_kernels:" in r.getMessage() for r in caplog.records) == 1  # logged once
    finally:
        engine.shutdown()


def _fake_flashinfer(run) -> types.ModuleType:
    """A stand-in ``flashinfer`` whose wrapper plans and then runs ``run`` (the fast path failing its way)."""
    class Wrapper:
        def __init__(self, workspace, layout):
            pass

        def plan(self, *args, **kwargs):
            pass

        def run(self, q, kv):
            return run(q)

    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = Wrapper
    return module


def _compile_fails(q):
    raise RuntimeError("Ninja build failed: nvcc: command not found")


@pytest.mark.parametrize("module, reason", [(None, "ModuleNotFoundError"), (_fake_flashinfer(_compile_fails), "nvcc"),
                                            (_fake_flashinfer(torch.zeros_like), "differs from torch")])
def test_a_broken_flashinfer_falls_back_to_torch(demo_assets, torch_tokens, monkeypatch, fresh_log, module, reason):
    monkeypatch.setitem(sys.modules, "flashinfer", module)  # None: ``import flashinfer`` raises ImportError
    engine = build(demo_assets, attention="fast")
    try:
        attention = engine.stats()["fast_paths"]["attention"]
        assert attention["intended"] == "flashinfer" and attention["used"] == "torch"
        assert reason in attention["reason"]
        assert engine.cache.layout == "head_major" and engine.runner.attention.name == "torch"
        assert serve_two_adapters(engine, demo_assets) == torch_tokens
    finally:
        engine.shutdown()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_auto_on_the_cpu_runs_the_base_gemms_on_onednn(demo_assets, torch_tokens):
    engine = build(demo_assets)
    try:
        gemm = engine.stats()["fast_paths"]["cpu_gemm"]
        assert gemm["intended"] == gemm["used"] == "onednn" and gemm["check_error"] <= 1e-5
        assert engine.context.base_linear is cpu_gemm.onednn_linear
        assert serve_two_adapters(engine, demo_assets) == torch_tokens
    finally:
        engine.shutdown()


def _onednn_raises(module, x):
    raise RuntimeError("could not create a primitive descriptor for an inner product forward propagation primitive")


def _onednn_wrong(module, x):
    return module(x) + 1.0


@pytest.mark.parametrize("broken, reason", [(_onednn_raises, "primitive descriptor"), (_onednn_wrong, "differs from torch")])
def test_a_broken_onednn_linear_falls_back_to_torch(demo_assets, torch_tokens, monkeypatch, fresh_log, caplog, broken,
                                                    reason):
    monkeypatch.setattr(cpu_gemm, "onednn_linear", broken)
    engine = build(demo_assets, cpu_gemm="fast")
    try:
        gemm = engine.stats()["fast_paths"]["cpu_gemm"]
        assert gemm["intended"] == "onednn" and gemm["used"] == "torch" and reason in gemm["reason"]
        assert engine.context.base_linear is cpu_gemm.module_linear
        assert serve_two_adapters(engine, demo_assets) == torch_tokens
        assert sum("cpu_gemm:" in r.getMessage() for r in caplog.records) == 1  # logged once
    finally:
        engine.shutdown()


def test_auto_on_the_cpu_scores_decode_rows_with_sampled_addmm(demo_assets, torch_tokens):
    engine = build(demo_assets)
    try:
        scores = engine.stats()["fast_paths"]["sparse_scores"]
        assert scores["intended"] == scores["used"] == "sampled_addmm" and scores["check_error"] <= 1e-5
        assert engine.runner.attention.sparse_scores
        assert serve_two_adapters(engine, demo_assets) == torch_tokens
    finally:
        engine.shutdown()


def test_a_failing_sampled_addmm_falls_back_to_gathered_keys(demo_assets, torch_tokens, monkeypatch, fresh_log, caplog):
    def raises(*args, **kwargs):
        raise RuntimeError("sampled_addmm: not implemented for this build")

    monkeypatch.setattr(torch.sparse, "sampled_addmm", raises)
    engine = build(demo_assets, sparse_scores="fast")
    try:
        scores = engine.stats()["fast_paths"]["sparse_scores"]
        assert scores["intended"] == "sampled_addmm" and scores["used"] == "torch" and "not implemented" in scores["reason"]
        assert not engine.runner.attention.sparse_scores
        assert serve_two_adapters(engine, demo_assets) == torch_tokens
        assert sum("sparse_scores:" in r.getMessage() for r in caplog.records) == 1  # logged once
    finally:
        engine.shutdown()


def test_unknown_tuning_values_are_refused():
    with pytest.raises(ValueError, match="lora_kernels"):
        EngineTuning(lora_kernels="cuda")
    with pytest.raises(ValueError, match="cpu_gemm"):
        EngineTuning(cpu_gemm="mkl")
    with pytest.raises(ValueError, match="sparse_scores"):
        EngineTuning(sparse_scores="csr")
    with pytest.raises(ValueError, match="lora_target_programs"):
        EngineTuning(lora_target_programs=0)
