"""The engine thread stays the process's only OpenMP team: the thread that builds an engine or registers an adapter
gives its team back once done (``engine.openmp_team``), so a CPU decode step after serving runs as fast as before
(two teams on 2 cores made libgomp throttle its idle workers' spinning: the step 15-20% slower once served)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from deployments.config import AppArgs
from engine import engine as engine_module
from engine import openmp_team
from engine.engine import LoRAEngine
from engine.request import GenerateRequest
from engine.tuning import EngineTuning


def team_threads() -> set[int]:
    """The process's threads that can be OpenMP workers: not Python threads (another test's feed or executor thread
    may start or end meanwhile) and named as the process is (Ray's and gRPC's native threads name themselves)."""
    python = {t.native_id for t in threading.enumerate()}
    main = _comm(os.getpid())
    return {tid for tid in map(int, os.listdir("/proc/self/task")) if tid not in python and _comm(tid) == main}


def _comm(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # ended meanwhile
        return ""


def parallel_op() -> None:
    """Large enough for torch to split over its threads (its grain is 32768 elements)."""
    torch.ones(1 << 20).mul_(2.0)


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.skipif(openmp_team.loaded_libgomp() is None, reason="torch does not run on GNU OpenMP here")
def test_release_frees_the_calling_threads_team_and_the_next_op_makes_one(two_threads):
    result: dict[str, int] = {}

    def work():  # a fresh thread: its team is its own, nothing else in the process touches it
        before = team_threads()
        parallel_op()
        result["with_team"] = len(team_threads() - before)
        assert openmp_team.release_thread_team()
        deadline = time.monotonic() + 10.0  # a released worker leaves /proc/self/task once the OS has reaped it
        while team_threads() - before and time.monotonic() < deadline:
            time.sleep(0.01)
        result["released"] = len(team_threads() - before)
        parallel_op()
        result["again"] = len(team_threads() - before)
        openmp_team.release_thread_team()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert result == {"with_team": 1, "released": 0, "again": 1}


def test_release_without_a_team_or_libgomp_is_harmless(monkeypatch, tmp_path):
    assert isinstance(openmp_team.release_thread_team(), bool)  # twice in a row: nothing to free the second time
    assert isinstance(openmp_team.release_thread_team(), bool)
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 00:00 0 \n7f01-7f02 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n")
    assert openmp_team.loaded_libgomp(maps) is None
    assert openmp_team.loaded_libgomp(tmp_path / "absent") is None


def small_engine(demo_assets, **tuning) -> LoRAEngine:
    return LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=3, max_lora_rank=16,
                              max_model_len=128, kv_cache_bytes=1 << 20).engine_config("openmp"),
                      tuning=EngineTuning(**tuning))


@pytest.mark.parametrize("free", [True, False])
def test_the_engine_frees_its_callers_team_after_start_up_and_each_registration(demo_assets, monkeypatch, free):
    """The fast state after a warm-up: the building/registering thread gives its team back (unless tuned off),
    and the engine thread, which runs every step, never does."""
    calls: list[str] = []
    monkeypatch.setattr(engine_module, "release_thread_team", lambda: calls.append(threading.current_thread().name))
    engine = small_engine(demo_assets, free_caller_openmp_teams=free)
    try:
        assert calls == ([threading.current_thread().name] if free else [])
        name = next(iter(demo_assets.adapters))
        engine.register_adapter(name, str(demo_assets.adapters[name]))
        assert len(calls) == (2 if free else 0)
        serve(engine, name)
        assert engine._thread.name not in calls
    finally:
        engine.shutdown()


def serve(engine: LoRAEngine, name: str) -> None:
    import asyncio

    result = asyncio.run(engine.generate(GenerateRequest(adapter=name, token_ids=[1, 40, 41], max_tokens=3)))
    assert len(result.token_ids) == 3
