"""Every per-adapter map stays at its stated bound through 10,000 registrations and removals (issue 28).

Each of these maps grows with names anyone can make up (an admin registration, a resolver lookup
of a bogus name), so each has a budget:

- a replica's staging handover: one adapter per slot (a batch loads no more), oldest out;
- its name and in-flight maps: the adapters registered there now;
- the node's object-store download cache and the hub cache's adapter snapshots: a byte budget
  (``adapter_cache_bytes``), least recently used out, with lock files in fixed stripes.

The directory's per-uid counts and the quota book have their own soaks (test_routing_directory,
test_quota_leases).

The hub soak runs in a subprocess of its own (``hub_soak``), started with the first in-process soak so that the
two run side by side on two cores; its test reads the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from pool.sources.node_cache import LOCK_STRIPES, LOCKS_DIR, NodeDownloadCache

CYCLES = 10_000
REGISTERED = 8   # adapters registered at once in the replica soak


@pytest.mark.usefixtures("hub_soak")  # started beside this soak (module docstring)
def test_replica_maps_stay_at_their_bounds_through_10000_registrations(demo_assets):
    """host_cache_bytes 0: the host tier keeps nothing, so every staged adapter waits in the handover."""
    from deployments.config import AppArgs
    from engine.engine import LoRAEngine

    engine = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=3, max_lora_rank=16,
                                max_batch_size=4, max_model_len=128, max_tokens_limit=8,
                                host_cache_bytes=0).engine_config())
    source = str(demo_assets.adapters["demo-0"])
    bounds = {"serving": REGISTERED, "inflight": REGISTERED, "handover": engine.pool.slots, "staging": 0}
    worst = dict.fromkeys(bounds, 0)
    try:
        for i in range(CYCLES):
            record = engine.register_adapter(f"soak-{i}", source)
            engine.adapters.stage(record.uid)
            if i >= REGISTERED:
                engine.unregister_adapter(f"soak-{i - REGISTERED}", timeout_s=5)
            sizes = engine.adapters.map_sizes()
            worst = {k: max(worst[k], sizes[k]) for k in bounds}
        assert all(worst[k] <= bounds[k] for k in bounds), (worst, bounds)
        assert worst["handover"] == bounds["handover"]   # the bound was reached, so the check had teeth
        assert len(engine.store.uids()) == REGISTERED and len(engine.store.host_cache.uids()) == 0
        for i in range(CYCLES - REGISTERED, CYCLES):
            engine.unregister_adapter(f"soak-{i}", timeout_s=5)
        assert engine.adapters.map_sizes() == dict.fromkeys(bounds, 0) and engine.store.uids() == []
    finally:
        engine.shutdown()


def one_kib(folder: Path) -> None:
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 1024)


@pytest.mark.usefixtures("hub_soak")
def test_node_cache_stays_within_its_byte_budget_through_10000_downloads(tmp_path):
    budget = 16 * 1024
    cache = NodeDownloadCache(tmp_path, max_bytes=budget, evict_grace_s=0)
    for i in range(CYCLES):
        fetch = cache.get(("s3", "bucket", f"{i % 97:016x}", f"v{i}"), one_kib)
        assert fetch.downloaded
        if i % 500 == 0:
            assert cache.total_bytes() <= budget
    entries = list(cache.entries())
    assert cache.total_bytes() <= budget and len(entries) == budget // 1024
    assert fetch.folder in entries                                    # the newest stays
    assert len(os.listdir(tmp_path / LOCKS_DIR)) <= LOCK_STRIPES + 1   # stripes and the pruner's lock, no more
    key_folders = [p for p in (tmp_path / "s3" / "bucket").iterdir()]
    assert len(key_folders) <= len(entries)                           # evicted keys leave no empty folders


def test_node_cache_keeps_an_entry_used_within_the_grace(tmp_path):
    """The budget is ``max_bytes`` plus what was used in the grace window: a replica that just found an entry
    reads it next, so the pruner must not take it away in between."""
    cache = NodeDownloadCache(tmp_path, max_bytes=1024, evict_grace_s=3600)
    first = cache.get(("s3", "b", "k", "v1"), one_kib).folder
    second = cache.get(("s3", "b", "k", "v2"), one_kib).folder
    assert first.is_dir() and second.is_dir() and cache.total_bytes() == 2048
    os.utime(first, (0, 0))                                            # used long ago: it may go now
    assert cache.prune() == [first] and not first.exists() and second.is_dir()


def test_node_cache_refuses_a_key_of_the_wrong_shape(tmp_path):
    cache = NodeDownloadCache(tmp_path)
    for key in [("s3", "b", "k"), ("s3", "b", "..", "v"), ("s3", "b", "k", ".locks")]:
        with pytest.raises(ValueError, match="plain folder names"):
            cache.get(key, one_kib)
    assert list(tmp_path.iterdir()) == []


HUB_SOAK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, "tests")
    from hub_cache import add_to_hub_cache
    from pool.sources import SourcePolicy, resolve_adapter_source
    from pool.sources.hub_budget import adapter_revisions
    cache, folder, base, cycles = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    policy = SourcePolicy.of(hub_orgs=["acme"], cache_bytes=4 * size, cache_grace_s=0)
    add_to_hub_cache(cache, "acme/base-model", base, "f" * 40)
    worst = 0
    for i in range(cycles):
        add_to_hub_cache(cache, f"acme/a{i % 101}", folder, f"{i:040x}")   # a repo's new commit, or a new repo
        resolved = resolve_adapter_source(f"acme/a{i % 101}", f"{i:040x}", policy)
        assert resolved.folder.is_dir()
        if i % 250 == 0 or i == cycles - 1:
            worst = max(worst, sum(r.nbytes for r in adapter_revisions(cache)))
    print(json.dumps({"worst": worst, "budget": 4 * size, "left": len(adapter_revisions(cache)),
                      "base": (cache / "models--acme--base-model" / "snapshots" / ("f" * 40)).is_dir()}))
""")


@pytest.fixture(scope="module")
def hub_soak(demo_assets, tmp_path_factory) -> Iterator[subprocess.Popen]:
    """HUB_SOAK's process, running from the first test that asks for it; stopped at the module's end if no test
    read it."""
    hub = tmp_path_factory.mktemp("soak") / "hub"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "HF_TOKEN": "hf_dummy"}
    proc = subprocess.Popen([sys.executable, "-c", HUB_SOAK, str(hub), str(demo_assets.adapters["demo-0"]),
                             str(demo_assets.model_dir), str(CYCLES)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_hub_adapter_snapshots_stay_within_the_budget_through_10000_registrations(hub_soak):
    """Offline (HF_HUB_OFFLINE=1), through huggingface_hub's real cache: the base model's snapshot is never
    counted or removed, and the adapter snapshots never exceed the budget."""
    stdout, stderr = hub_soak.communicate(timeout=1800)
    assert hub_soak.returncode == 0, stderr[-4000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["worst"] <= out["budget"] and out["left"] == 4 and out["base"], out
