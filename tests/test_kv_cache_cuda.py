"""The GPU path: paged attention on CUDA (torch and, when installed, FlashInfer) and the engine in bf16.

Skipped without CUDA; ``benchmarks/gpu_check.sh`` runs these on a GPU machine.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import TorchPagedAttention, choose_backend
from engine.attention_flashinfer import FlashInferPagedAttention
from engine.attention_layout import StepLayout
from engine.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def _filled_cache(layout: str, shapes, H=8, KV=2, hd=128, bs=16, dtype=torch.bfloat16):
    """A cache with each sequence's first ``c`` positions written; the step's layout, q and new K/V."""
    torch.manual_seed(0)
    rng = random.Random(0)
    cache = PagedKVCache(1, 64, bs, KV, hd, device=CUDA, dtype=dtype, layout=layout)
    free = list(range(64))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in shapes]
    for (c, _), table in zip(shapes, tables):
        if c:
            pre = StepLayout([table], [0], [c], bs, CUDA)
            cache.write(0, pre.write_blocks, pre.write_offsets, torch.randn(c, KV, hd, device=CUDA, dtype=dtype),
                        torch.randn(c, KV, hd, device=CUDA, dtype=dtype))
    layout_ = StepLayout(tables, [c for c, _ in shapes], [n for _, n in shapes], bs, CUDA)
    q = torch.randn(layout_.num_tokens, H, hd, device=CUDA, dtype=dtype)
    k = torch.randn(layout_.num_tokens, KV, hd, device=CUDA, dtype=dtype)
    v = torch.randn(layout_.num_tokens, KV, hd, device=CUDA, dtype=dtype)
    cache.write(0, layout_.write_blocks, layout_.write_offsets, k, v)
    return cache, layout_, q, k, v


SHAPES = [(40, 1), (3, 1), (0, 30), (33, 7), (17, 1)]  # decodes, a fresh prefill, a prefill after a cached prefix


@pytest.mark.parametrize("window", [None, 12])
def test_torch_attention_on_cuda_matches_the_cpu(window):
    cache, layout, q, k, v = _filled_cache("head_major", SHAPES, dtype=torch.float32)
    out = TorchPagedAttention(cache, 8, 2, 128)(0, q, k, v, layout, window, 0.09)
    cpu = PagedKVCache(1, 64, 16, 2, 128, device=torch.device("cpu"), dtype=torch.float32)
    cpu.k.copy_(cache.k.cpu())
    cpu.v.copy_(cache.v.cpu())
    cpu_layout = StepLayout(layout.tables, layout.starts, layout.counts, 16, torch.device("cpu"))
    expected = TorchPagedAttention(cpu, 8, 2, 128)(0, q.cpu(), k.cpu(), v.cpu(), cpu_layout, window, 0.09)
    assert (out.cpu() - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("window", [None, 12])
def test_flashinfer_matches_the_torch_path(window):
    pytest.importorskip("flashinfer")
    assert choose_backend(CUDA, torch.bfloat16) == "flashinfer"
    cache, layout, q, k, v = _filled_cache("page_major", SHAPES)
    fi = FlashInferPagedAttention(cache, 8, 2, 128)
    fi.begin_step(layout, [window], 0.09)
    out = fi(0, q, k, v, layout, window, 0.09)
    ref = TorchPagedAttention(cache, 8, 2, 128)(0, q, k, v, layout, window, 0.09)  # reads page_major too
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


def test_engine_generates_in_bf16_on_cuda(demo_assets):
    from conftest import TEST_KV_FRACTION
    from deployments.config import AppArgs
    from engine.engine import LoRAEngine
    from engine.request import GenerateRequest

    engine = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), dtype="bfloat16", max_loras_per_batch=3,
                                max_batch_size=8, kv_cache_memory_fraction=TEST_KV_FRACTION).engine_config("cuda-check"))
    try:
        assert engine.device.type == "cuda" and engine.cache.k.is_cuda
        names = list(demo_assets.adapters)[:3]
        for name in names:
            engine.register_adapter(name, str(demo_assets.adapters[name]))
        results = [engine.generate_blocking(GenerateRequest(adapter=n, prompt=f"gpu {i}", max_tokens=12))
                   for i, n in enumerate([None, *names])]
        assert all(r.completion_tokens >= 1 for r in results)
        again = engine.generate_blocking(GenerateRequest(adapter=names[0], prompt="gpu 1", max_tokens=12))
        assert again.token_ids == results[1].token_ids  # greedy is deterministic through the paged cache
    finally:
        engine.shutdown()
