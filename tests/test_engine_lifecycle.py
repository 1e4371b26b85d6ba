"""A request's life in the engine under cancellation, odd parameters, broken adapters and failing steps."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.errors import EngineOverloadedError, EngineUnhealthyError
from engine.request import GenerateRequest
from waiting import wait_until


def make_engine(demo_assets, **overrides) -> LoRAEngine:
    settings = dict(base_model=str(demo_assets.model_dir), max_loras_per_batch=3, max_lora_rank=16, max_batch_size=4,
                    max_model_len=256, max_tokens_limit=200)
    engine = LoRAEngine(AppArgs(**{**settings, **overrides}).engine_config())
    for name in ("demo-1", "demo-2"):
        engine.register_adapter(name, str(demo_assets.adapters[name]))
    return engine


@pytest.fixture(scope="module")
def engine(demo_assets):
    eng = make_engine(demo_assets)
    yield eng
    eng.shutdown()


def test_a_cancelled_stream_leaves_the_engine_within_a_step(engine):
    async def scenario():
        streams = [engine.generate_stream(GenerateRequest(adapter="demo-1", prompt=f"long {i}", max_tokens=200))
                   for i in range(4)]
        for stream in streams:
            await stream.__anext__()  # every request is running and has produced a token
        steps_at_cancel = engine.steps
        for stream in streams:
            await stream.aclose()  # the caller goes away
        return steps_at_cancel

    before = engine.stats()["cancelled"]
    steps_at_cancel = asyncio.run(scenario())
    wait_until(lambda: engine.queue_len() == 0, 30, "cancelled sequences to leave the engine")
    assert engine.steps - steps_at_cancel <= 2  # gone at the next step boundary, not after 200 tokens
    assert engine.stats()["cancelled"] - before == 4
    assert engine.stats()["max_steps_after_cancel"] <= 1
    assert engine.cache.allocator.num_used == 0  # their KV blocks are free


class ForwardGate:
    """Parks the engine thread in its next forward (at the LM head) until released: the batch cannot advance.

    Submitting and cancelling take only the engine's queue lock, never the step, so a test can
    change the queue while the batch is held exactly as it was: no guess of how long a step takes.
    """

    def __init__(self, head: torch.nn.Module):
        self.parked, self._go, self._armed = threading.Event(), threading.Event(), False
        self._hook = head.register_forward_pre_hook(self._maybe_park)

    def _maybe_park(self, *_) -> None:
        if self._armed:
            self._armed = False
            self.parked.set()
            self._go.wait(120)

    def hold(self, timeout_s: float = 30) -> None:
        self.arm()
        self.wait_parked(timeout_s)

    def arm(self) -> None:
        """Park the next forward, without waiting for it (a request submitted after this cannot finish first)."""
        self._armed = True

    def wait_parked(self, timeout_s: float = 30) -> None:
        assert self.parked.wait(timeout_s), "the engine did not reach its next forward"

    def release(self) -> None:
        self._go.set()
        self._hook.remove()


def test_a_cancelled_waiting_request_never_runs(engine):
    wait_until(lambda: engine.queue_len() == 0, 30, "the engine to be idle")
    tokens_at_start, cancelled_before = engine.tokens_generated, engine.stats()["cancelled"]
    gate = ForwardGate(engine.model.lm_head)

    async def scenario():
        busy = [engine.generate_stream(GenerateRequest(prompt=f"busy {i}", max_tokens=40), with_result=True)
                for i in range(4)]  # fill the batch of 4
        for stream in busy:
            await stream.__anext__()  # each is running: it has its first token
        try:
            gate.hold()  # the batch stays as it is until release()
            assert engine.stats()["running"] == 4, engine.stats()
            queued = asyncio.ensure_future(engine.generate(GenerateRequest(prompt="queued", max_tokens=40)))
            while engine.stats()["waiting"] < 1:  # submitted off the loop; the held batch cannot admit it
                assert not queued.done(), queued
                await asyncio.sleep(0.01)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            held = engine.stats()
        finally:
            gate.release()
        results = [[item async for item in stream][-1] for stream in busy]
        return held, results

    held, results = asyncio.run(scenario())
    assert held["waiting"] == 0 and held["cancelled"] - cancelled_before == 1  # dropped before any step
    wait_until(lambda: engine.queue_len() == 0, 30, "the batch to drain")
    assert [r.completion_tokens for r in results] == [40] * 4
    # every token since the start belongs to the four busy requests: none to the cancelled one
    assert engine.tokens_generated - tokens_at_start == sum(r.completion_tokens for r in results)


def test_a_near_zero_temperature_is_greedy_and_harms_nobody(engine):
    async def scenario():
        tiny = engine.generate(GenerateRequest(adapter="demo-1", prompt="same", max_tokens=12, temperature=1e-50))
        others = [engine.generate(GenerateRequest(adapter="demo-1", prompt=f"other {i}", max_tokens=12,
                                                  temperature=0.8, seed=i)) for i in range(6)]
        return await asyncio.gather(tiny, *others)

    tiny, *others = asyncio.run(scenario())
    greedy = engine.generate_blocking(GenerateRequest(adapter="demo-1", prompt="same", max_tokens=12))
    assert tiny.token_ids == greedy.token_ids
    assert all(r.completion_tokens == 12 for r in others)


def test_an_adapter_with_non_finite_weights_fails_only_its_own_requests(engine, demo_assets, tmp_path):
    broken = Path(shutil.copytree(demo_assets.adapters["demo-2"], tmp_path / "nan-adapter"))
    weights = load_file(broken / "adapter_model.safetensors")
    for key in weights:
        if "lora_B" in key:
            weights[key] = torch.full_like(weights[key], float("nan"))
    save_file(weights, broken / "adapter_model.safetensors")
    engine.register_adapter("nan-adapter", str(broken))

    async def scenario():
        bad = engine.generate(GenerateRequest(adapter="nan-adapter", prompt="x", max_tokens=8))
        good = [engine.generate(GenerateRequest(adapter=name, prompt="x", max_tokens=8))
                for name in (None, "demo-1", None)]
        return await asyncio.gather(bad, *good, return_exceptions=True)

    bad, *good = asyncio.run(scenario())
    assert isinstance(bad, FloatingPointError) and "non-finite" in str(bad)
    assert all(r.completion_tokens == 8 for r in good)
    assert engine.healthy()  # a sequence's failure is not a failed step
    engine.unregister_adapter("nan-adapter")


def test_the_waiting_queue_is_bounded(demo_assets):
    engine = make_engine(demo_assets, max_batch_size=1, max_waiting_requests=2)
    try:
        async def scenario():
            calls = [engine.generate(GenerateRequest(prompt=f"q {i}", max_tokens=30)) for i in range(6)]
            return await asyncio.gather(*calls, return_exceptions=True)

        outcomes = asyncio.run(scenario())
        refused = [o for o in outcomes if isinstance(o, EngineOverloadedError)]
        served = [o for o in outcomes if not isinstance(o, BaseException)]
        assert refused and served and len(refused) + len(served) == 6
        assert "limit 2" in str(refused[0])
    finally:
        engine.shutdown()


def test_repeated_step_failures_make_the_engine_unhealthy(demo_assets):
    engine = make_engine(demo_assets)
    try:
        def broken_head(*_):
            raise RuntimeError("device fault")

        hook = engine.model.lm_head.register_forward_hook(broken_head)
        for i in range(3):
            with pytest.raises(RuntimeError, match="device fault"):
                engine.generate_blocking(GenerateRequest(prompt=f"x {i}", max_tokens=4))
        assert not engine.healthy()
        hook.remove()
        with pytest.raises(EngineUnhealthyError):
            engine.generate_blocking(GenerateRequest(prompt="after", max_tokens=4))
    finally:
        engine.shutdown()


def test_without_a_host_tier_slot_loads_still_never_read_files_on_the_engine_thread(demo_assets):
    """host_cache_bytes=0: every adapter re-read is handed over from the submitting thread."""
    engine = make_engine(demo_assets, host_cache_bytes=0, max_loras_per_batch=2)
    try:
        for name in ("demo-3", "demo-4"):
            engine.register_adapter(name, str(demo_assets.adapters[name]))
        engine_thread = engine._thread
        reads_on_engine_thread = []
        original_fetch = engine.store.fetch

        def recording_fetch(uid):
            import threading

            if threading.current_thread() is engine_thread:
                reads_on_engine_thread.append(uid)
            return original_fetch(uid)

        engine.store.fetch = recording_fetch
        names = ["demo-1", "demo-2", "demo-3", "demo-4"] * 3  # more adapters than the 2 slots: reloads

        async def scenario():
            return await asyncio.gather(*[engine.generate(GenerateRequest(adapter=n, prompt=f"p {i}", max_tokens=5))
                                          for i, n in enumerate(names)])

        results = asyncio.run(scenario())
        assert [r.completion_tokens for r in results] == [5] * len(names)
        assert engine.pool_snapshot().counters.loads >= 4
        assert reads_on_engine_thread == []
    finally:
        engine.shutdown()


class LoadWatch:
    """Records each pool load: on which thread, and whether a forward was running at that moment."""

    def __init__(self, engine: LoRAEngine):
        self.loads: list[tuple[str, threading.Thread, bool]] = []
        self._in_forward = False
        engine.model.register_forward_pre_hook(lambda *_: setattr(self, "_in_forward", True))
        engine.model.register_forward_hook(lambda *_: setattr(self, "_in_forward", False))
        engine.subscribe_pool_events(self._seen)

    def _seen(self, event) -> None:
        if event.kind == "load":
            self.loads.append((event.uid, threading.current_thread(), self._in_forward))


def test_load_into_slot_loads_between_steps_with_no_request_and_counts_one_load(demo_assets):
    """A warm-up is an engine call, not a fake request: the slot copy runs on the engine thread between two
    forwards (idle or busy), counts one load and no hit or miss, and no request is queued or counted."""
    engine = make_engine(demo_assets, max_loras_per_batch=4)
    try:
        watch = LoadWatch(engine)
        uids = {name: engine.current_uid(name) for name in ("demo-1", "demo-2")}
        before = engine.pool_snapshot().counters
        slot = engine.load_into_slot(uids["demo-1"])  # an idle engine: its loop wakes for the change alone
        assert engine.pool.get_slot(uids["demo-1"]) == slot
        assert watch.loads == [(uids["demo-1"], engine._thread, False)]
        after = engine.pool_snapshot().counters
        assert after.loads == before.loads + 1 and (after.hits, after.misses) == (before.hits, before.misses)
        assert engine.stats()["waiting"] == engine.stats()["running"] == 0 and engine.steps == 0
        assert engine.adapters.inflight(uids["demo-1"]) == 0
        assert engine.load_into_slot(uids["demo-1"]) == slot  # resident already: no second load
        assert engine.pool_snapshot().counters.loads == after.loads

        busy = threading.Thread(target=engine.generate_blocking,
                                args=(GenerateRequest(prompt="busy", max_tokens=150, ignore_eos=True),))
        busy.start()
        wait_until(lambda: engine.steps > 0, 60, "the base-model request to be stepping")
        engine.load_into_slot(uids["demo-2"])  # while a batch is running: between two of its steps
        busy.join(timeout=120)
        assert watch.loads[-1] == (uids["demo-2"], engine._thread, False)
        assert engine.pool_snapshot().counters.loads == after.loads + 1  # demo-2 (the base slot is no load)
    finally:
        engine.shutdown()


def test_retiring_an_adapter_in_use_waits_for_its_requests_and_refuses_slot_loads(demo_assets):
    """Today's semantics: unregistering refuses new requests at once, and the unload waits until the adapter's
    requests end; meanwhile the pool refuses to unload it and ``load_into_slot`` refuses the retiring uid."""
    from engine.errors import AdapterUnregisteredError
    from pool.errors import AdapterInUseError

    engine = make_engine(demo_assets)
    try:
        uid = engine.current_uid("demo-2")
        results = []
        request = threading.Thread(target=lambda: results.append(engine.generate_blocking(
            GenerateRequest(adapter="demo-2", prompt="in use", max_tokens=40, ignore_eos=True))))
        gate = ForwardGate(engine.model.lm_head)
        gate.arm()  # before the request exists: 40 tokens cannot finish before the test looks
        request.start()
        gate.wait_parked(60)  # demo-2 is in the running batch, parked in its first forward, until release()
        assert engine.stats()["running"] == 1, engine.stats()
        retired = []
        retiring = threading.Thread(target=lambda: retired.append(engine.unregister_adapter("demo-2", timeout_s=60)))
        try:
            retiring.start()
            wait_until(lambda: engine.current_uid("demo-2") is None, 30, "new requests to be refused")
            with pytest.raises(AdapterInUseError):
                engine.pool.remove(uid)  # the running batch uses it
            with pytest.raises(AdapterUnregisteredError, match="retiring"):
                engine.load_into_slot(uid)
            assert engine.is_resident(uid) and not retired
        finally:
            gate.release()
        retiring.join(timeout=60)
        request.join(timeout=60)
        assert retired == [uid] and results[0].completion_tokens == 40  # it finished; it was not cancelled
        assert not engine.is_resident(uid) and uid not in engine.store
    finally:
        engine.shutdown()


def test_a_refused_slot_load_leaves_the_pool_whole_and_the_engine_serving(demo_assets):
    """Two slots, one pinned, one holding the running batch's adapter: a warm-up has no slot to take. It is
    refused with the pool's error, the pool's invariants hold, and the running request is unharmed."""
    from pool.errors import NoEvictableSlotError
    from pool_helpers import check_invariants

    engine = make_engine(demo_assets, max_loras_per_batch=2)
    try:
        engine.register_adapter("demo-3", str(demo_assets.adapters["demo-3"]))
        engine.pin_adapter("demo-1")
        results = []
        request = threading.Thread(target=lambda: results.append(engine.generate_blocking(
            GenerateRequest(adapter="demo-2", prompt="running", max_tokens=150, ignore_eos=True))))
        request.start()
        wait_until(lambda: engine.steps > 0, 60, "the demo-2 request to be stepping")
        loads = engine.pool_snapshot().counters.loads
        with pytest.raises(NoEvictableSlotError):
            engine.load_into_slot(engine.current_uid("demo-3"))
        engine.at_step_boundary(lambda: check_invariants(engine.pool))
        snap = engine.pool_snapshot()
        assert set(snap.resident) == {engine.current_uid("demo-1"), engine.current_uid("demo-2")}
        assert snap.pinned == {engine.current_uid("demo-1")} and snap.counters.loads == loads
        request.join(timeout=120)
        assert results[0].completion_tokens == 150 and engine.healthy() and engine.failed_steps_in_row == 0
        assert engine.load_into_slot(engine.current_uid("demo-3")) is not None  # the batch ended: demo-2 may go
        engine.at_step_boundary(lambda: check_invariants(engine.pool))
    finally:
        engine.shutdown()
