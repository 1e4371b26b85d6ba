"""The node-local download cache: one download per entry per node, across threads and processes."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pool.errors import SourceUnavailableError
from pool.sources import NodeDownloadCache

from benchmarks.local_s3 import LocalS3Server, s3_client, upload_folder

REPO = Path(__file__).parents[1]


def write_files(folder: Path) -> None:
    (folder / "adapter_config.json").write_text('{"r": 4}')


def test_threads_download_an_entry_once(tmp_path):
    cache = NodeDownloadCache(tmp_path)
    calls: list[int] = []

    def slow_download(folder: Path) -> None:
        calls.append(1)
        time.sleep(0.2)
        write_files(folder)

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(("s3", "b", "k", "v1"), slow_download)))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sum(r.downloaded for r in results) == 1
    assert {r.folder for r in results} == {tmp_path / "s3" / "b" / "k" / "v1"}
    assert max(r.waited_s for r in results) >= 0.1   # the others waited on the lock, then found the entry


def test_a_failed_download_leaves_nothing_and_the_next_caller_retries(tmp_path):
    cache = NodeDownloadCache(tmp_path)

    def dies_halfway(folder: Path) -> None:
        write_files(folder)
        raise SourceUnavailableError("connection reset")

    with pytest.raises(SourceUnavailableError):
        cache.get(("k", "v"), dies_halfway)
    assert not cache.entry("k", "v").exists()
    assert list(tmp_path.glob("k/v.partial-*")) == []
    (tmp_path / "k" / "v.partial-999-dead").mkdir()      # left by a process that was killed mid-download
    fetch = cache.get(("k", "v"), write_files)
    assert fetch.downloaded and (fetch.folder / "adapter_config.json").exists()
    assert list(tmp_path.glob("k/v.partial-*")) == []


def test_a_held_lock_times_out_as_unavailable(tmp_path):
    cache = NodeDownloadCache(tmp_path, lock_timeout_s=0.3)
    (tmp_path / "k").mkdir()
    with open(tmp_path / "k" / "v.lock", "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SourceUnavailableError, match="download lock"):
            cache.get(("k", "v"), write_files)
    assert cache.get(("k", "v"), write_files).downloaded


REPLICA = textwrap.dedent("""
    import json, os, sys, time
    from pool.sources import SourcePolicy, resolve_adapter_source
    go = sys.argv[2]
    open(f"{go}.ready-{os.getpid()}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    r = resolve_adapter_source(sys.argv[1], policy=SourcePolicy.of(cache_dir=os.environ["LORAFLEET_TEST_CACHE"]))
    print(json.dumps({"folder": str(r.folder), "version": r.version, "downloaded": r.downloaded}))
""")


def test_replica_processes_on_a_node_download_once(demo_assets, tmp_path):
    """Four processes ask for the same s3 adapter at the same moment: one GET per file in all."""
    server = LocalS3Server().start()
    try:
        client = s3_client(server)
        client.create_bucket(Bucket="fleet")
        upload_folder(client, demo_assets.adapters["demo-2"], "fleet", "adapters/demo-2")
        go = tmp_path / "go"
        env = {**os.environ, **server.env(), "LORAFLEET_TEST_CACHE": str(tmp_path / "node-cache")}
        procs = [subprocess.Popen([sys.executable, "-c", REPLICA, "s3://fleet/adapters/demo-2", str(go)], cwd=REPO,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(4)]
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("go.ready-*"))) < len(procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        go.touch()   # every process has imported everything: they ask at the same moment
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
        assert sum(o["downloaded"] for o in outs) == 1
        assert len({o["folder"] for o in outs}) == 1 and len({o["version"] for o in outs}) == 1
        assert server.gets("fleet", "adapters/demo-2/adapter_model.safetensors") == 1
        assert server.gets("fleet", "adapters/demo-2/adapter_config.json") == 1
    finally:
        server.stop()
