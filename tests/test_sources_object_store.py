"""Object-store adapter sources against a real S3 server on 127.0.0.1 (moto's server, started here)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch

from pool.adapter import load_adapter_folder
from pool.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    InvalidAdapterSourceError,
    PickleWeightsRefusedError,
    SourceNotAllowedError,
    SourceUnavailableError,
    UnsupportedAdapterFeatureError,
)
from pool.shapes import LoRAModelShape
from pool.sources import SourcePolicy, parse_object_url, resolve_adapter_source, validate_object_store_prefixes
from pool.store import AdapterStore

from testkit.local_s3 import LocalS3Server, s3_client, upload_folder

BUCKET = "adapters"


@pytest.fixture(scope="module")
def s3():
    server = LocalS3Server().start()
    s3_client(server).create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


@pytest.fixture
def policy(tmp_path):
    return SourcePolicy.of(cache_dir=tmp_path / "node-cache")


@pytest.fixture(scope="module")
def shape(demo_assets):
    from transformers import AutoConfig

    return LoRAModelShape.from_hf_config(AutoConfig.from_pretrained(demo_assets.model_dir))


def cache_entries(policy: SourcePolicy) -> list[Path]:
    return [p for p in policy.cache_root.rglob("*") if p.is_dir() and (p / "adapter_config.json").exists()]


def test_s3_adapter_is_fetched_once_into_the_node_cache(s3_env, policy, demo_assets, shape, request):
    prefix = request.node.name
    client = s3_client(s3_env)
    upload_folder(client, demo_assets.adapters["demo-0"], BUCKET, prefix)
    for extra in ("README.md", "tokenizer.json", "optimizer.safetensors.bak"):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{extra}", Body=b"not an adapter file")

    first = resolve_adapter_source(f"s3://{BUCKET}/{prefix}/", policy=policy)
    assert first.kind == "s3" and first.downloaded and first.version
    assert sorted(p.name for p in first.folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert policy.cache_root in first.folder.parents
    local = load_adapter_folder(demo_assets.adapters["demo-0"], shape, 16)
    remote = load_adapter_folder(first.folder, shape, 16)
    assert all(torch.equal(local.a[m], remote.a[m]) and torch.equal(local.bt[m], remote.bt[m]) for m in local.a)

    again = resolve_adapter_source(f"s3://{BUCKET}/{prefix}", policy=policy)
    assert (again.folder, again.version, again.downloaded) == (first.folder, first.version, False)
    assert s3_env.gets(BUCKET, f"{prefix}/adapter_model.safetensors") == 1
    assert s3_env.gets(BUCKET, f"{prefix}/adapter_config.json") == 1
    assert s3_env.gets(BUCKET, f"{prefix}/README.md") == 0 and s3_env.gets(BUCKET, f"{prefix}/tokenizer.json") == 0


def test_a_changed_object_is_a_new_version_and_revisions_pin_it(s3_env, policy, demo_assets, request):
    prefix = request.node.name
    client = s3_client(s3_env)
    upload_folder(client, demo_assets.adapters["demo-0"], BUCKET, prefix)
    v1 = resolve_adapter_source(f"s3://{BUCKET}/{prefix}", policy=policy)
    upload_folder(client, demo_assets.adapters["demo-1"], BUCKET, prefix)   # a new fine-tune, same prefix
    v2 = resolve_adapter_source(f"s3://{BUCKET}/{prefix}", policy=policy)
    assert v2.version != v1.version and v2.folder != v1.folder and v2.downloaded
    assert json.loads((v2.folder / "adapter_config.json").read_text())["r"] == 8      # demo-1 has rank 8
    assert json.loads((v1.folder / "adapter_config.json").read_text())["r"] == 4      # v1's entry is untouched
    assert resolve_adapter_source(f"s3://{BUCKET}/{prefix}", v2.version, policy).folder == v2.folder
    with pytest.raises(AdapterNotFoundError, match=v2.version):
        resolve_adapter_source(f"s3://{BUCKET}/{prefix}", v1.version, policy)


@pytest.mark.parametrize("layout, error, match", [
    ({"adapter_config.json": "config", "adapter_model.bin": "weights"}, PickleWeightsRefusedError, "adapter_model.bin"),
    ({"adapter_config.json": "config", "adapter_model.safetensors": "weights", "added_tokens.json": "{}"},
     UnsupportedAdapterFeatureError, "adds tokens"),
    ({"adapter_model.safetensors": "weights"}, AdapterFormatError, "adapter_config.json"),
    ({"adapter_config.json": "config"}, AdapterFormatError, "adapter_model.safetensors"),
    ({}, AdapterNotFoundError, "not found|no files"),
])
def test_bad_prefixes_are_refused_before_any_download(s3_env, policy, demo_assets, layout, error, match, request):
    prefix = f"bad-{request.node.callspec.id}"
    client = s3_client(s3_env)
    folder = demo_assets.adapters["demo-0"]
    sources = {"config": (folder / "adapter_config.json").read_bytes(),
               "weights": (folder / "adapter_model.safetensors").read_bytes()}
    for key, body in layout.items():
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=sources.get(body, body.encode()))
    with pytest.raises(error, match=match):
        resolve_adapter_source(f"s3://{BUCKET}/{prefix}", policy=policy)
    assert cache_entries(policy) == []
    assert all(s3_env.gets(BUCKET, f"{prefix}/{key}") == 0 for key in layout)


def test_missing_bucket_is_not_found(s3_env, policy):
    with pytest.raises(AdapterNotFoundError):
        resolve_adapter_source("s3://no-such-bucket/x", policy=policy)


def test_allow_list_covers_buckets_and_whole_prefix_segments(s3_env, tmp_path, demo_assets):
    client = s3_client(s3_env)
    upload_folder(client, demo_assets.adapters["demo-0"], BUCKET, "team-a/support")
    upload_folder(client, demo_assets.adapters["demo-0"], BUCKET, "team-ab/support")
    policy = SourcePolicy.of(object_store_prefixes=[f"s3://{BUCKET}/team-a/"], cache_dir=tmp_path / "c")
    assert resolve_adapter_source(f"s3://{BUCKET}/team-a/support", policy=policy).downloaded
    for refused in (f"s3://{BUCKET}/team-ab/support", f"s3://{BUCKET}/team", "s3://other/team-a/support",
                    f"gs://{BUCKET}/team-a/support"):
        with pytest.raises(SourceNotAllowedError, match="allowed object-store prefixes"):
            resolve_adapter_source(refused, policy=policy)
    assert s3_env.gets(BUCKET, "team-ab/support/adapter_model.safetensors") == 0
    nothing = SourcePolicy.of(object_store_prefixes=[], cache_dir=tmp_path / "c")
    with pytest.raises(SourceNotAllowedError):
        resolve_adapter_source(f"s3://{BUCKET}/team-a/support", policy=nothing)


@pytest.mark.parametrize("source", [
    "s3://", "s3:///x", "s3://Bad_Bucket/x", "s3://b/../x", "s3://bucket/a//b", "s3://bucket/./a",
    "azure://container/x", "http://example.com/adapter",
])
def test_malformed_object_urls_are_refused_by_name(source, policy):
    with pytest.raises(InvalidAdapterSourceError):
        resolve_adapter_source(source, policy=policy)


def test_object_urls_normalise_and_nest():
    url = parse_object_url("gcs://bucket/a/b/")
    assert (url.scheme, url.bucket, url.key, url.url, url.protocol) == ("gs", "bucket", "a/b", "gs://bucket/a/b", "gcs")
    assert url.is_within(parse_object_url("gs://bucket")) and url.is_within(parse_object_url("gs://bucket/a"))
    assert not url.is_within(parse_object_url("gs://bucket/a/b/c")) and not url.is_within(parse_object_url("s3://bucket"))
    assert validate_object_store_prefixes(["s3://b-1/x/", "gs://b-2"]) == ["s3://b-1/x", "gs://b-2"]
    with pytest.raises(ValueError, match="/local/folder"):
        validate_object_store_prefixes(["/local/folder"])


def test_an_unreachable_store_is_unavailable_not_missing(policy, monkeypatch, s3):
    with socket.socket() as closed:   # bound but never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        for key, value in s3.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        with pytest.raises(SourceUnavailableError, match="listing failed"):
            resolve_adapter_source(f"s3://{BUCKET}/anything", policy=policy)
    assert cache_entries(policy) == []


def test_store_registers_an_s3_adapter_and_rereads_it_from_the_node_cache(s3_env, demo_assets, shape, tmp_path):
    upload_folder(s3_client(s3_env), demo_assets.adapters["demo-3"], BUCKET, "store/demo-3")
    store = AdapterStore(shape, 16, host_cache_bytes=10_000_000, object_store_prefixes=[f"s3://{BUCKET}/store"],
                         adapter_cache_dir=str(tmp_path / "cache"))
    record = store.register("demo-3@1", f"s3://{BUCKET}/store/demo-3", name="demo-3")
    assert record.version and (tmp_path / "cache") in record.folder.parents
    first = store.fetch("demo-3@1")
    store.host_cache.remove("demo-3@1")
    again = store.fetch("demo-3@1")       # a host-tier miss re-reads the cached files, not the store
    assert torch.equal(first.a["q_proj"], again.a["q_proj"])
    assert s3_env.gets(BUCKET, "store/demo-3/adapter_model.safetensors") == 1
    with pytest.raises(SourceNotAllowedError):
        store.register("x", f"s3://{BUCKET}/elsewhere/demo-3")
    assert "x" not in store
    shutil.rmtree(tmp_path / "cache")


def test_an_entry_the_node_cache_evicted_is_fetched_again_and_only_as_registered(s3_env, demo_assets, shape,
                                                                                   tmp_path):
    """The node cache is held to ``adapter_cache_bytes``, so a registered adapter's folder can go; a host-tier
    miss then downloads the same content version again, and refuses if the object changed meanwhile."""
    from pool.sources import NodeDownloadCache

    client = s3_client(s3_env)
    upload_folder(client, demo_assets.adapters["demo-2"], BUCKET, "evicted/demo-2")
    store = AdapterStore(shape, 16, host_cache_bytes=10_000_000, object_store_prefixes=[f"s3://{BUCKET}/evicted"],
                         adapter_cache_dir=str(tmp_path / "cache"), adapter_cache_bytes=10_000_000)
    record = store.register("demo-2@1", f"s3://{BUCKET}/evicted/demo-2", name="demo-2")
    first = store.fetch("demo-2@1")
    everything = NodeDownloadCache(tmp_path / "cache", max_bytes=0, evict_grace_s=0)
    assert everything.prune() == [record.folder] and not record.folder.exists()
    store.host_cache.remove("demo-2@1")
    again = store.fetch("demo-2@1")
    assert first.a.keys() == again.a.keys() and all(torch.equal(first.a[m], again.a[m]) for m in first.a)
    assert s3_env.gets(BUCKET, "evicted/demo-2/adapter_model.safetensors") == 2
    everything.prune()
    store.host_cache.remove("demo-2@1")
    upload_folder(client, demo_assets.adapters["demo-3"], BUCKET, "evicted/demo-2")   # other weights, same key
    with pytest.raises(AdapterNotFoundError, match="not the requested"):
        store.fetch("demo-2@1")
    assert "demo-2@1" not in store.host_cache


def test_a_listed_file_above_the_pools_limit_is_refused_before_the_download(s3_env, policy, demo_assets):
    from pool.errors import AdapterTooLargeError

    client = s3_client(s3_env)
    folder = demo_assets.adapters["demo-0"]
    weights = (folder / "adapter_model.safetensors").read_bytes()
    upload_folder(client, folder, BUCKET, "too-large")
    with pytest.raises(AdapterTooLargeError, match=f"{len(weights)} bytes, above the limit of 1024 bytes"):
        resolve_adapter_source(f"s3://{BUCKET}/too-large", policy=policy, max_bytes=1024)
    assert cache_entries(policy) == []
    assert s3_env.gets(BUCKET, "too-large/adapter_model.safetensors") == 0    # nothing was downloaded
    assert resolve_adapter_source(f"s3://{BUCKET}/too-large", policy=policy, max_bytes=len(weights)).downloaded
