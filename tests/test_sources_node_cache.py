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
from waiting import wait_until

from testkit.local_s3 import LocalS3Server, s3_client, upload_folder

REPO = Path(__file__).parents[1]


def write_files(folder: Path) -> None:
    (folder / "adapter_config.json").write_text('{"r": 4}')


def open_handles(path: Path) -> int:
    """How many file descriptors of this process point at ``path`` (Linux: /proc/self/fd)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:  # closed meanwhile
            pass
    return count


def test_threads_download_an_entry_once(tmp_path):
    cache = NodeDownloadCache(tmp_path)
    key = ("s3", "b", "k", "v1")
    lock = cache.lock_path(key)
    calls: list[int] = []
    downloaded_at: list[float] = []

    def download_once_all_wait(folder: Path) -> None:
        calls.append(1)
        # hold the lock until every thread has the lock file open: all six are at the lock, none passed it
        wait_until(lambda: open_handles(lock) == 6, 30, "all six threads at the download lock")
        write_files(folder)
        downloaded_at.append(time.monotonic())

    results: list[tuple[object, float]] = []
    threads = [threading.Thread(target=lambda: results.append((cache.get(key, download_once_all_wait),
                                                               time.monotonic())))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fetches = [fetch for fetch, _ in results]
    assert len(calls) == 1 and sorted(f.downloaded for f in fetches) == [False] * 5 + [True]
    assert {f.folder for f in fetches} == {tmp_path / "s3" / "b" / "k" / "v1"}
    # the other five waited on the lock, then found the entry the first one wrote
    assert all(returned_at >= downloaded_at[0] for _, returned_at in results)


def test_a_failed_download_leaves_nothing_and_the_next_caller_retries(tmp_path):
    cache = NodeDownloadCache(tmp_path, key_parts=2)

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
    cache = NodeDownloadCache(tmp_path, lock_timeout_s=0.3, key_parts=2)
    with open(cache.lock_path(("k", "v")), "a+b") as held:
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
        wait_until(lambda: len(list(tmp_path.glob("go.ready-*"))) == len(procs), 120, "every process to be ready")
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
