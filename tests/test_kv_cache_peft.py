"""PEFT equivalence through the paged KV cache when it runs short: preemption and recompute, prefix reuse.

A cache of a few small blocks forces the scheduler to preempt running requests in a mixed
batch (more adapters than pool slots, so adapters are evicted and reloaded too); every
request's greedy tokens must still be PEFT's. Prefix reuse must give the same tokens as a
cold run, and a re-registered adapter (a new uid under the same name) must never reuse the
old one's KV. Mistral runs with a sliding window shorter than the requests.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from deployments.config import AppArgs
from engine.demo import ensure_demo_assets
from engine.engine import LoRAEngine
from engine.kv_cache import kv_bytes_per_token
from engine.request import GenerateRequest

import peft
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

BLOCK = 4
BLOCKS = 14           # 56 token positions for the whole batch: a few requests at a time
MAX_TOKENS = 14
PROMPTS = [[1, *range(40, 40 + n)] for n in (5, 9, 12, 7, 15, 10, 6, 11)]


def windowed(model_dir, dest, window):
    """The demo model with a sliding window shorter than the requests (tokenizer files copied along)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.sliding_window = window
    model.save_pretrained(dest)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special", "chat")):
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"kv-{request.param}")
    assets = ensure_demo_assets(root, num_adapters=5, arch=request.param)
    model_dir = assets.model_dir
    if request.param == "mistral":
        model_dir = windowed(model_dir, root / "windowed", window=6)
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    names = list(assets.adapters)
    peft_model = peft.PeftModel.from_pretrained(ref, assets.adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(assets.adapters[name], adapter_name=name)
    peft_model.eval()
    mc = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    per_token = kv_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, torch.float32)
    engine = LoRAEngine(AppArgs(base_model=str(model_dir), max_loras_per_batch=3, max_lora_rank=16, max_batch_size=8,
                                kv_cache_bytes=BLOCKS * BLOCK * per_token, kv_block_size=BLOCK)
                        .engine_config(request.param))
    for name, path in assets.adapters.items():
        engine.register_adapter(name, str(path))
    yield assets, peft_model, engine
    engine.shutdown()


def peft_tokens(peft_model, adapter, ids, max_tokens, eos):
    x = torch.tensor([ids])
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                out = peft_model.generate(input_ids=x, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        else:
            peft_model.set_adapter(adapter)
            out = peft_model.generate(input_ids=x, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    tokens = out[0, len(ids):].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def run_all(engine, requests):
    async def go():
        return await asyncio.gather(*(engine.generate(GenerateRequest(adapter=n, token_ids=ids, max_tokens=MAX_TOKENS))
                                      for n, ids in requests))
    return asyncio.run(go())


def test_preempted_requests_in_a_mixed_batch_still_match_peft(setup):
    assets, peft_model, engine = setup
    names = [None, *assets.adapters]
    requests = [(names[i % len(names)], ids) for i, ids in enumerate(PROMPTS)]
    before = engine.stats()
    results = run_all(engine, requests)
    after = engine.stats()
    assert after["preemptions"] > before["preemptions"], "the cache was sized to force preemption"
    assert engine.pool.counters.evictions > 0
    eos = engine.tokenizer.eos_token_id
    for (name, ids), result in zip(requests, results):
        assert result.token_ids == peft_tokens(peft_model, name, ids, MAX_TOKENS, eos), name
    assert after["kv_blocks_used"] == 0 and engine.cache.peak_blocks_used <= BLOCKS


def test_prefix_reuse_gives_the_tokens_of_a_cold_run(setup):
    assets, peft_model, engine = setup
    name = list(assets.adapters)[1]
    ids = [1, *range(60, 75)]        # 16 tokens: 3 full blocks may be reused
    eos = engine.tokenizer.eos_token_id
    expected = peft_tokens(peft_model, name, ids, MAX_TOKENS, eos)
    first = engine.generate_blocking(GenerateRequest(adapter=name, token_ids=ids, max_tokens=MAX_TOKENS))
    hits = engine.stats()["kv_prefix_hit_blocks"]
    again = engine.generate_blocking(GenerateRequest(adapter=name, token_ids=ids, max_tokens=MAX_TOKENS))
    assert engine.stats()["kv_prefix_hit_blocks"] > hits
    assert first.token_ids == again.token_ids == expected


def test_a_re_registered_adapter_never_reuses_the_old_uids_kv(setup):
    assets, peft_model, engine = setup
    names = list(assets.adapters)
    ids = [1, *range(80, 95)]
    eos = engine.tokenizer.eos_token_id
    engine.register_adapter("swap", str(assets.adapters[names[2]]), uid="swap@1")
    old = engine.generate_blocking(GenerateRequest(adapter="swap", token_ids=ids, max_tokens=MAX_TOKENS))
    assert old.token_ids == peft_tokens(peft_model, names[2], ids, MAX_TOKENS, eos)
    engine.register_adapter("swap", str(assets.adapters[names[3]]), uid="swap@2")
    hits = engine.stats()["kv_prefix_hit_blocks"]
    new = engine.generate_blocking(GenerateRequest(adapter="swap", token_ids=ids, max_tokens=MAX_TOKENS))
    assert engine.stats()["kv_prefix_hit_blocks"] == hits   # same name and prompt, new uid: nothing shared
    assert new.token_ids == peft_tokens(peft_model, names[3], ids, MAX_TOKENS, eos)
