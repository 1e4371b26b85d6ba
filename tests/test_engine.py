"""The engine end to end on the demo model: scheduling, streaming, stops, bad input, unload."""

from __future__ import annotations

import asyncio
import threading

import pytest

from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.errors import InvalidRequestError
from engine.request import GenerateRequest
from pool.errors import AdapterNotFoundError
from waiting import wait_until


@pytest.fixture(scope="module")
def engine(demo_assets):
    eng = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=3, max_lora_rank=16,
                             max_batch_size=8, max_model_len=256, max_tokens_limit=64).engine_config())
    for name, path in demo_assets.adapters.items():
        eng.register_adapter(name, str(path))
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_over_more_adapters_than_slots_match_solo_runs(engine, demo_assets):
    names = [None, *demo_assets.adapters]
    requests = [GenerateRequest(adapter=names[i % len(names)], prompt=f"request {i}", max_tokens=6 + i % 5)
                for i in range(28)]
    sizes = []
    original = engine.pool.prepare_lora_batch

    def recording_prepare(uids):
        uids = set(uids)
        sizes.append(len(uids))
        return original(uids)

    engine.pool.prepare_lora_batch = recording_prepare
    try:
        async def all_at_once():
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        batched = run(all_at_once())
    finally:
        del engine.pool.prepare_lora_batch
    assert max(sizes) <= engine.pool.slots
    assert max(sizes) > 1  # requests really shared batches
    for req, result in zip(requests, batched):
        solo = engine.generate_blocking(GenerateRequest(adapter=req.adapter, prompt=req.prompt,
                                                        max_tokens=req.max_tokens))
        assert result.token_ids == solo.token_ids
        assert result.finish_reason in ("length", "stop")
        assert result.usage["completion_tokens"] == len(result.token_ids)


def test_streaming_deltas_concatenate_to_the_final_text(engine):
    async def collect():
        deltas = []
        async for d in engine.generate_stream(GenerateRequest(adapter="demo-2", prompt="stream me", max_tokens=10)):
            deltas.append(d)
        return deltas

    deltas = run(collect())
    full = engine.generate_blocking(GenerateRequest(adapter="demo-2", prompt="stream me", max_tokens=10))
    assert "".join(d.text for d in deltas) == full.text
    assert [d.token_id for d in deltas] == full.token_ids
    assert deltas[-1].finish_reason == full.finish_reason and all(d.finish_reason is None for d in deltas[:-1])


def test_stop_string_ends_generation_and_is_not_returned(engine):
    full = engine.generate_blocking(GenerateRequest(adapter="demo-0", prompt="stop test", max_tokens=20))
    assert len(full.text) >= 4
    stop = full.text[2:4]
    cut = engine.generate_blocking(GenerateRequest(adapter="demo-0", prompt="stop test", max_tokens=20, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text


def test_sampling_is_reproducible_with_a_seed(engine):
    req = dict(adapter="demo-1", prompt="sample", max_tokens=12, temperature=1.0, top_p=0.9)
    a = engine.generate_blocking(GenerateRequest(seed=7, **req))
    b = engine.generate_blocking(GenerateRequest(seed=7, **req))
    c = engine.generate_blocking(GenerateRequest(seed=8, **req))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_chat_messages_use_the_template(engine):
    msgs = [{"role": "user", "content": "Hi"}]
    r = engine.generate_blocking(GenerateRequest(messages=msgs, max_tokens=4))
    ids = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert r.prompt_tokens == len(ids)


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", max_tokens=65), "max_tokens"),
    (dict(prompt="x " * 120, max_tokens=64), "max_tokens"),  # beyond the 256-token window
    (dict(prompt="x", temperature=-0.1), "temperature"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages"),
    (dict(token_ids=[10 ** 9]), "prompt"),
])
def test_bad_input_is_refused_before_any_work(engine, kwargs, field):
    steps, tokens = engine.steps, engine.tokens_generated
    with pytest.raises(InvalidRequestError) as err:
        engine.generate_blocking(GenerateRequest(**kwargs))
    assert err.value.field == field and field in str(err.value)
    assert (engine.steps, engine.tokens_generated) == (steps, tokens)


def test_unknown_adapter_is_named(engine):
    with pytest.raises(AdapterNotFoundError, match="no-such-adapter"):
        engine.generate_blocking(GenerateRequest(adapter="no-such-adapter", prompt="x"))


def test_unregister_refuses_new_requests_at_once_and_drains_in_flight(engine, demo_assets):
    engine.register_adapter("temp", str(demo_assets.adapters["demo-3"]))
    results = []
    worker = threading.Thread(target=lambda: results.append(
        engine.generate_blocking(GenerateRequest(adapter="temp", prompt="long", max_tokens=60))))
    worker.start()
    wait_until(lambda: engine.adapters.inflight(engine.current_uid("temp")) > 0, 60, "the request to be in flight",
               interval_s=0.001)
    uid = engine.unregister_adapter("temp", timeout_s=30)
    worker.join()
    assert results[0].finish_reason in ("length", "stop")  # it finished, it was not cancelled
    assert not engine.pool.is_resident(uid) and uid not in engine.store
    with pytest.raises(AdapterNotFoundError):
        engine.generate_blocking(GenerateRequest(adapter="temp", prompt="x"))


def test_pin_survives_a_flood_of_other_adapters(engine, demo_assets):
    engine.pin_adapter("demo-5")
    try:
        for name in list(demo_assets.adapters) * 2:
            engine.generate_blocking(GenerateRequest(adapter=name, prompt="flood", max_tokens=2))
            assert engine.is_resident(engine.current_uid("demo-5"))
    finally:
        engine.unpin_adapter("demo-5")


def test_live_settings_apply_only_when_all_are_valid(engine):
    before = (engine.pool.eviction_policy.name, engine.scheduler.max_batch_size, engine.config.max_tokens_limit)
    for bad in [{"eviction_policy": "mru"}, {"max_batch_size": 999}, {"max_tokens_limit": 0},
                {"max_lora_rank": 64}, {"eviction_policy": "fifo", "max_batch_size": 0}]:
        with pytest.raises(ValueError):
            engine.apply_settings(bad)
        assert (engine.pool.eviction_policy.name, engine.scheduler.max_batch_size,
                engine.config.max_tokens_limit) == before
    engine.apply_settings({"eviction_policy": "fifo", "max_batch_size": 4, "max_tokens_limit": 32})
    try:
        assert engine.pool.eviction_policy.name == "fifo"
        assert set(engine.pool.eviction_policy.order()) == {u for u in engine.pool.uid_to_slot if u is not None}
        with pytest.raises(InvalidRequestError, match="32"):
            engine.generate_blocking(GenerateRequest(prompt="x", max_tokens=33))
        assert engine.generate_blocking(GenerateRequest(adapter="demo-1", prompt="x", max_tokens=3)).completion_tokens == 3
    finally:
        engine.apply_settings({"eviction_policy": before[0], "max_batch_size": before[1],
                               "max_tokens_limit": before[2]})


def test_unregister_timeout_fails_in_flight_requests_clearly(engine, demo_assets):
    from engine.errors import AdapterUnregisteredError

    engine.register_adapter("slow", str(demo_assets.adapters["demo-4"]))
    errors = []

    def run():
        try:
            engine.generate_blocking(GenerateRequest(adapter="slow", prompt="long", max_tokens=64))
        except AdapterUnregisteredError as exc:
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    wait_until(lambda: engine.adapters.inflight(engine.current_uid("slow")) > 0, 60, "the request to be in flight",
               interval_s=0.001)
    uid = engine.unregister_adapter("slow", timeout_s=0.0)
    worker.join(timeout=30)
    assert errors and "unregistered" in str(errors[0])
    assert not engine.pool.is_resident(uid) and engine.adapters.inflight(uid) == 0


def test_stats_count_rows_per_step_and_the_engine_threads_cpu(engine, demo_assets):
    """``rows_stepped / steps`` is the mean batch and ``engine_cpu_s`` the engine thread's CPU: what a benchmark
    prices a live step by (``benchmarks.sim.live_check``)."""
    before = engine.stats()
    names = list(demo_assets.adapters)[:2]

    async def four_at_once():
        return await asyncio.gather(*(engine.generate(GenerateRequest(adapter=names[i % 2], prompt=f"row {i}",
                                                                      max_tokens=8)) for i in range(4)))
    results = run(four_at_once())
    after = engine.stats()
    steps = after["steps"] - before["steps"]
    rows = after["rows_stepped"] - before["rows_stepped"]
    assert steps >= 8  # every request decoded 8 tokens
    assert rows >= sum(r.completion_tokens for r in results)  # one row per token sampled (and prefill chunks)
    assert steps < rows <= 4 * steps  # the requests shared steps, never more than 4 at once
    assert after["engine_cpu_s"] > before["engine_cpu_s"]
