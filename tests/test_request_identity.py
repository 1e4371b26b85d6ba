"""A request's adapter identity on one engine: the uid it was resolved to is served or refused, never
swapped for a re-registered name's new weights; requests and results are never changed in place.

The fleet's half (one name look-up per request through the real Serve app, and a worker refusing
a stale uid) is in ``tests/test_front_door.py``.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.errors import AdapterUnregisteredError
from engine.request import AdapterRef, GenerateRequest
from waiting import wait_until

PROMPT = "the same prompt for every adapter"
TOKENS = 24


@pytest.fixture(scope="module")
def engine(demo_assets):
    eng = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=3, max_lora_rank=16,
                             max_batch_size=4, max_model_len=256, max_tokens_limit=64).engine_config())
    for name in ("demo-1", "demo-2"):
        eng.register_adapter(name, str(demo_assets.adapters[name]))
    yield eng
    eng.shutdown()


def greedy(engine: LoRAEngine, name: str, **fields) -> list[int]:
    request = GenerateRequest(adapter=name, prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True, **fields)
    return engine.generate_blocking(request).token_ids


def test_a_request_resolved_before_a_reregistration_is_refused_by_uid(engine, demo_assets):
    """``swap`` is registered from demo-1, then again from demo-2 while a request on the first uid runs.
    The running request finishes on demo-1's weights; a request still carrying the first uid is refused;
    the new uid serves demo-2's weights."""
    old_weights, new_weights = greedy(engine, "demo-1"), greedy(engine, "demo-2")
    assert old_weights != new_weights  # the two adapters answer differently: the check below has teeth
    first = engine.register_adapter("swap", str(demo_assets.adapters["demo-1"]), uid="swap@00000001")
    old_ref = AdapterRef("swap", first.uid)
    finished = []
    running = threading.Thread(target=lambda: finished.append(engine.generate_blocking(GenerateRequest(
        adapter="swap", resolved=old_ref, prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True))))
    running.start()
    try:
        wait_until(lambda: engine.adapters.inflight(first.uid) > 0, 60, "the first uid's request to be in flight",
                   interval_s=0.001)
        second = engine.register_adapter("swap", str(demo_assets.adapters["demo-2"]), uid="swap@00000002")
        assert not engine.serves(first.uid) and engine.serves(second.uid)
        with pytest.raises(AdapterUnregisteredError, match="swap@00000001"):
            greedy(engine, "swap", resolved=old_ref)
        assert greedy(engine, "swap", resolved=AdapterRef("swap", second.uid)) == new_weights
    finally:
        running.join(timeout=60)
    assert finished and finished[0].token_ids == old_weights  # in flight at the swap: its own weights to the end
    wait_until(lambda: first.uid not in engine.store, 60, "the replaced uid to be unloaded once drained")
    engine.unregister_adapter("swap", timeout_s=10)


def test_a_request_that_carries_its_uid_costs_the_engine_no_name_lookup(engine):
    uid = engine.current_uid("demo-1")
    before = engine.adapters.name_lookups
    with_uid = greedy(engine, "demo-1", resolved=AdapterRef("demo-1", uid))
    assert engine.adapters.name_lookups == before
    assert greedy(engine, "demo-1") == with_uid  # a name alone (an engine-only caller) is looked up here, once
    assert engine.adapters.name_lookups == before + 1


def test_requests_and_results_are_never_changed_in_place(engine):
    request = GenerateRequest(adapter="demo-2", prompt="fill in max_tokens", max_tokens=None)
    result = engine.generate_blocking(request)
    assert request.max_tokens is None and result.completion_tokens > 0  # the engine filled in its own copy
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.adapter = "demo-1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.replica_id = "r1"
    named = dataclasses.replace(result, replica_id="r1")
    assert (named.replica_id, result.replica_id, named.token_ids) == ("r1", None, result.token_ids)
