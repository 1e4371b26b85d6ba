"""The decoder's norms and RoPE (``engine.decoder_ops``): torch's on the CPU; FlashInfer's fused kernels on CUDA where
the start-up check passes them. FlashInfer does not run here, so a stand-in that implements its documented contract
(``rmsnorm``; ``fused_add_rmsnorm`` in place: ``residual += x``, ``x = norm(residual)``; neox-style
``apply_rope_with_cos_sin_cache_inplace`` over a table of cosines then sines) shows that the engine's wiring of those
calls (the in-place residual, the table built from the model's rotary embedding) serves what torch's ops serve, and
that a kernel with other numbers is caught at start."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from engine import fast_paths
from engine.decoder_ops import cos_sin_table, fused_ops_unsupported
from engine.engine import LoRAEngine
from small_engines import serve_together, small_engine

PROMPT = [1, 40, 41, 42, 43, 44, 45]
# the stand-in replaces FlashInfer: on a GPU machine the real one is what the engine's start-up check tries
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in for FlashInfer where it cannot run")


def _rms(x, weight, eps):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def stand_in(rope_sign: float = 1.0) -> types.ModuleType:
    """``flashinfer.norm`` and ``flashinfer.rope`` as documented, in torch (``rope_sign`` -1: a wrong kernel)."""
    def rmsnorm(x, weight, eps=1e-6):
        return _rms(x, weight, eps)

    def fused_add_rmsnorm(x, residual, weight, eps=1e-6):
        residual.add_(x)
        x.copy_(_rms(residual, weight, eps))

    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
        assert is_neox and query.is_contiguous() and key.is_contiguous()
        half = cos_sin_cache.shape[1] // 2
        cos, sin = cos_sin_cache[positions, :half][:, None, :], cos_sin_cache[positions, half:][:, None, :]
        for t in (query, key):
            heads = t.view(t.shape[0], -1, head_size)
            a, b = heads[..., :half].clone(), heads[..., half:].clone()
            heads[..., :half] = a * cos - rope_sign * b * sin
            heads[..., half:] = b * cos + rope_sign * a * sin

    module = types.ModuleType("flashinfer")
    module.norm = types.SimpleNamespace(rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm)
    module.rope = types.SimpleNamespace(
        apply_rope_with_cos_sin_cache_inplace=apply_rope_with_cos_sin_cache_inplace)
    return module


def install(monkeypatch, module: types.ModuleType) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.norm", module.norm)
    monkeypatch.setitem(sys.modules, "flashinfer.rope", module.rope)


def build(demo_assets, **tuning) -> LoRAEngine:
    return small_engine(demo_assets, "decoder-ops", **tuning)


def serve(engine: LoRAEngine, demo_assets) -> list[list[int]]:
    names = list(demo_assets.adapters)[:2] + [None]
    return serve_together(engine, [(n, PROMPT[:4 + i]) for i, n in enumerate(names)], max_tokens=6)


@pytest.fixture(scope="module")
def torch_tokens(demo_assets) -> list[list[int]]:
    engine = build(demo_assets)
    try:
        ops = engine.stats()["fast_paths"]["fused_ops"]
        assert ops["used"] == "torch" and "run on CUDA" in ops["reason"] and engine.runner.ops.name == "torch"
        return serve(engine, demo_assets)
    finally:
        engine.shutdown()


def test_auto_tries_them_on_cuda_in_half_precision_only():
    assert fused_ops_unsupported(torch.device("cpu"), torch.float32) is not None
    assert "half precision" in fused_ops_unsupported(torch.device("cuda"), torch.float32)
    assert fused_ops_unsupported(torch.device("cuda"), torch.bfloat16) is None


def test_the_table_holds_each_position_s_cosines_then_sines(demo_assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir)
    table = cos_sin_table(model.model.rotary_emb, 50, torch.device("cpu"))
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.tensor([[0, 17, 49]]))
    half = cos.shape[-1] // 2
    assert table.shape == (50, 2 * half) and table.dtype == torch.float32
    assert torch.equal(table[[0, 17, 49], :half], cos[0, :, :half]) and torch.equal(table[[0, 17, 49], half:],
                                                                                    sin[0, :, :half])


def test_flashinfer_s_contract_serves_what_torch_s_ops_serve(demo_assets, torch_tokens, monkeypatch):
    install(monkeypatch, stand_in())
    engine = build(demo_assets, fused_ops="fast")
    try:
        ops = engine.stats()["fast_paths"]["fused_ops"]
        assert ops["used"] == "flashinfer" and ops["check_error"] <= 1e-4 and engine.runner.ops.name == "flashinfer"
        assert serve(engine, demo_assets) == torch_tokens
    finally:
        engine.shutdown()


@pytest.mark.parametrize("module, reason", [(None, "ModuleNotFoundError"), (stand_in(rope_sign=-1.0),
                                                                           "differs from torch")])
def test_a_missing_or_wrong_flashinfer_falls_back_to_torch_s_ops(demo_assets, torch_tokens, monkeypatch, module,
                                                                 reason):
    monkeypatch.setattr(fast_paths, "_logged", set())
    if module is None:
        monkeypatch.setitem(sys.modules, "flashinfer", None)  # ``import flashinfer`` raises
    else:
        install(monkeypatch, module)
    engine = build(demo_assets, fused_ops="fast")
    try:
        ops = engine.stats()["fast_paths"]["fused_ops"]
        assert ops["intended"] == "flashinfer" and ops["used"] == "torch" and reason in ops["reason"]
        assert engine.runner.ops.name == "torch"
        assert serve(engine, demo_assets) == torch_tokens
    finally:
        engine.shutdown()
