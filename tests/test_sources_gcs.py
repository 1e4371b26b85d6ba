"""gs:// adapter sources against a real GCS JSON-API server on 127.0.0.1 (gcp-storage-emulator).

gcsfs and google-auth read their endpoint and credential settings when first imported, so
the client side runs in a fresh process with the emulator's environment; metadata-server
lookups are switched off and pointed at loopback, so nothing leaves this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).parents[1]

CLIENT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import fsspec
    from pool.errors import AdapterNotFoundError, SourceNotAllowedError
    from pool.sources import SourcePolicy, resolve_adapter_source

    adapters, cache = Path(sys.argv[1]), sys.argv[2]
    fs = fsspec.filesystem("gcs", skip_instance_cache=True)
    fs.mkdir("ft-adapters")
    def upload(name):
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            fs.pipe(f"ft-adapters/support/{f}", (adapters / name / f).read_bytes())
        fs.pipe("ft-adapters/support/training_args.bin", b"never fetched")
    policy = SourcePolicy.of(object_store_prefixes=["gs://ft-adapters/support"], cache_dir=cache)
    out = {}
    upload("demo-0")
    first = resolve_adapter_source("gs://ft-adapters/support", policy=policy)
    again = resolve_adapter_source("gs://ft-adapters/support", policy=policy)
    upload("demo-1")
    second = resolve_adapter_source("gs://ft-adapters/support", policy=policy)
    out["first"] = [str(first.folder), first.version, first.downloaded, first.kind]
    out["again"] = [str(again.folder), again.version, again.downloaded]
    out["second"] = [str(second.folder), second.version, second.downloaded]
    out["files"] = sorted(p.name for p in first.folder.iterdir())
    try:
        resolve_adapter_source("gs://ft-adapters/support", first.version, policy)
    except AdapterNotFoundError as e:
        out["old_revision"] = str(e)
    try:
        resolve_adapter_source("gs://ft-adapters/other", policy=policy)
    except SourceNotAllowedError as e:
        out["refused"] = str(e)
    print(json.dumps(out))
""")


def test_gs_adapter_end_to_end_through_the_node_cache(demo_assets, tmp_path):
    from gcp_storage_emulator.server import create_server

    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    try:
        port = server._api._httpd.server_address[1]
        env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "NO_GCE_CHECK": "true",
               "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9"}
        env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        proc = subprocess.run([sys.executable, "-c", CLIENT, str(demo_assets.adapters["demo-0"].parent),
                               str(tmp_path / "cache")], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=180)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    folder, version, downloaded, kind = out["first"]
    assert (kind, downloaded) == ("gs", True) and Path(folder).parent.parent.parent.name == "gs"
    assert out["again"] == [folder, version, False]
    assert out["second"][1] != version and out["second"][2] is True
    assert out["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert out["second"][1] in out["old_revision"] and "allowed object-store prefixes" in out["refused"]
    assert json.loads((Path(out["second"][0]) / "adapter_config.json").read_text())["r"] == 8
