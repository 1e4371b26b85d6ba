"""Adapter sources and lifecycle on a live fleet: object stores, resolve on first request,
versioned rollout under traffic, per-adapter quotas, through real HTTP.

The fleet here is its own app (``sources`` at ``/sources``) whose workers reach a real S3
server on 127.0.0.1 (moto's, started by this module) through ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import ADMIN_TOKEN, FLEET_ARGS
from fleet_helpers import delete_app
from test_metrics import scrape, total
from waiting import wait_until

from testkit.local_s3 import LocalS3Server, s3_client, upload_folder

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
APP = "sources"
BUCKET = "fleet-adapters"
VERSION_HEADER = "x-lorafleet-adapter-version"


@pytest.fixture(scope="module")
def s3():
    server = LocalS3Server().start()
    client = s3_client(server)
    client.create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def resolve_root(demo_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("resolve-root")
    shutil.copytree(demo_assets.adapters["demo-5"], root / "disk-only")
    return root


@pytest.fixture(scope="module")
def sources_fleet(ray_cluster, http_base, demo_assets, s3, resolve_root, tmp_path_factory):
    from ray import serve

    from deployments.app import build_fleet
    from deployments.config import AppArgs

    client = s3_client(s3)
    upload_folder(client, demo_assets.adapters["demo-3"], BUCKET, "team/support-s3")
    upload_folder(client, demo_assets.adapters["demo-4"], BUCKET, "resolve/s3-only")
    demo_dir = str(demo_assets.adapters["demo-0"].parent)
    args = AppArgs(**FLEET_ARGS, adapters=[{"name": "flip", "source": "demo:demo-0"},
                                           {"name": "quota-a", "source": "demo:demo-2"}],
                   adapter_roots=[str(demo_assets.model_dir.parents[1]), str(resolve_root)],
                   object_store_prefixes=[f"s3://{BUCKET}/team", f"s3://{BUCKET}/resolve"],
                   adapter_cache_dir=str(tmp_path_factory.mktemp("node-cache")),
                   adapter_resolvers=[str(resolve_root), f"s3://{BUCKET}/resolve"],
                   version_retire_grace_s=0)   # retire at once: requests still queued for it must re-pick
    worker_options = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": s3.env()}}}
    serve.run(build_fleet(args, worker_options), name=APP, route_prefix=f"/{APP}")
    yield {"base": f"{http_base}/{APP}", "demo_dir": demo_dir}
    delete_app(APP)


def complete(base: str, model: str, prompt: str = "The fleet", max_tokens: int = 6) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def admin(method: str, url: str, **kw) -> httpx.Response:
    return httpx.request(method, url, headers=AUTH, timeout=120, **kw)


def test_s3_adapter_end_to_end_through_the_admin_api(sources_fleet, s3):
    base, demo_dir = sources_fleet["base"], sources_fleet["demo_dir"]
    made = admin("POST", f"{base}/v1/adapters", json={"name": "support-s3", "source": f"s3://{BUCKET}/team/support-s3"})
    assert made.status_code == 201, made.text
    reference = admin("POST", f"{base}/v1/adapters", json={"name": "support-disk", "source": f"{demo_dir}/demo-3"})
    assert reference.status_code == 201, reference.text
    from_s3 = [complete(base, "support-s3", p) for p in ("one", "two", "three")]
    from_disk = [complete(base, "support-disk", p) for p in ("one", "two", "three")]
    assert all(r.status_code == 200 for r in from_s3 + from_disk), [r.text for r in from_s3 + from_disk]
    assert [r.json()["choices"][0]["text"] for r in from_s3] == [r.json()["choices"][0]["text"] for r in from_disk]
    assert from_s3[0].json()["model"] == "support-s3"
    # both workers share the node's cache: the weights crossed the network once
    assert s3.gets(BUCKET, "team/support-s3/adapter_model.safetensors") == 1
    for name in ("support-s3", "support-disk"):
        assert admin("DELETE", f"{base}/v1/adapters/{name}").status_code == 200


@pytest.mark.parametrize("source, status", [
    (f"s3://{BUCKET}/elsewhere/x", 403),          # bucket allowed, prefix not
    ("s3://another-bucket/team/x", 403),          # bucket not allowed
    ("gs://fleet-adapters/team/x", 403),          # same names, other store
    ("/etc", 403),                                # local folder outside adapter_roots
    ("s3://Not_A_Bucket/x", 400),                 # malformed
    ("azure://container/x", 400),                 # a scheme lorafleet does not read
])
def test_allow_list_refusals(sources_fleet, source, status):
    reply = admin("POST", f"{sources_fleet['base']}/v1/adapters", json={"name": "refused", "source": source})
    assert reply.status_code == status, reply.text
    assert "refused" not in [a["name"] for a in admin("GET", f"{sources_fleet['base']}/v1/adapters").json()["data"]]


def test_resolve_on_first_request_from_disk_and_s3(sources_fleet, s3, resolve_root):
    base = sources_fleet["base"]
    for model, source in (("disk-only", f"{resolve_root}/disk-only"), ("s3-only", f"s3://{BUCKET}/resolve/s3-only")):
        first = complete(base, model)
        assert first.status_code == 200, first.text
        assert first.json()["model"] == model and first.headers[VERSION_HEADER] == "v1"
        entry = next(a for a in admin("GET", f"{base}/v1/adapters").json()["data"] if a["name"] == model)
        assert entry["source"] == source and entry["uid"].startswith(f"{model}@")
        assert complete(base, model).json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    for _ in range(2):  # the second miss comes from the negative cache
        missing = complete(base, "nowhere-to-be-found")
        assert missing.status_code == 404 and "nowhere-to-be-found" in missing.json()["error"]["message"]
    assert complete(base, "demo-1").status_code == 404   # in the demo folder, but that is no resolver root
    for name in ("disk-only", "s3-only"):
        assert admin("DELETE", f"{base}/v1/adapters/{name}").status_code == 200



def test_a_resolver_lookup_of_a_missing_source_is_an_answer_not_an_error(sources_fleet, resolve_root):
    """The resolver asks with ``missing_ok``: a bogus name's miss comes back as a plain answer (no traceback
    logged on the worker per lookup); an admin registration of a missing source still raises (404)."""
    from ray import serve

    from pool.errors import AdapterNotFoundError

    worker = serve.get_deployment_handle("LoRAWorker", app_name=APP)
    for source in (f"{resolve_root}/absent", f"s3://{BUCKET}/resolve/absent"):
        answer = worker.validate_adapter.remote("absent", source, None, "absent@1", True).result(timeout_s=60)
        assert set(answer) == {"missing"} and "absent" in answer["missing"], answer
        with pytest.raises(AdapterNotFoundError):
            worker.validate_adapter.remote("absent", source, None, "absent@1").result(timeout_s=60)


def test_the_model_guard_answers_a_known_bogus_name_exactly_as_the_app_does(sources_fleet):
    """Under the route prefix, through Serve's proxy: the first request for a bogus name takes the normal
    path (FastAPI, the resolvers' lookup); once its miss is cached the guard answers, with the same bytes, or
    Serve's proxy does (the edge guard, once the ingress told it of the miss: tests/test_edge_guard.py)."""
    from ray import serve

    base = sources_fleet["base"]
    ingress = serve.get_app_handle(APP)   # one ingress replica here

    def counts() -> tuple[int, int]:
        stats = ingress.admission_stats.remote().result(timeout_s=30)
        return stats["early_refusals"], stats["guard_asked"]

    def early_refusals() -> int:
        return counts()[0]

    before = early_refusals()
    first = complete(base, "guarded-bogus")
    assert first.status_code == 404 and early_refusals() == before, first.text
    replies = []

    def answered_early() -> bool:
        refused, asked = counts()
        replies.append(complete(base, "guarded-bogus"))
        refused_now, asked_now = counts()
        return refused_now > refused or asked_now == asked   # the model guard answered, or the proxy did

    wait_until(answered_early, 60, "the model guard or the proxy to answer a name the negative cache holds")
    assert {(r.status_code, r.headers["content-type"], r.text) for r in replies} == \
        {(404, first.headers["content-type"], first.text)}
    answered = early_refusals()
    assert complete(base, "flip").status_code == 200 and early_refusals() == answered   # a known name passes

def test_version_flip_under_traffic(sources_fleet):
    base, demo_dir = sources_fleet["base"], sources_fleet["demo_dir"]
    for name, folder in (("ref-v1", "demo-0"), ("ref-v2", "demo-1")):
        assert admin("POST", f"{base}/v1/adapters", json={"name": name, "source": f"{demo_dir}/{folder}"}).status_code == 201
    expected = {"v1": complete(base, "ref-v1", "flip").json()["choices"][0]["text"],
                "v2": complete(base, "ref-v2", "flip").json()["choices"][0]["text"]}
    assert expected["v1"] != expected["v2"]
    results: list[tuple[int, str, str, str]] = []
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            r = complete(base, "flip", "flip")
            body = r.json()
            results.append((r.status_code, r.headers.get(VERSION_HEADER, ""), body.get("model", ""),
                            body["choices"][0]["text"] if r.status_code == 200 else r.text))

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(results) >= 4, 120, "steady traffic on flip")
        added = admin("POST", f"{base}/v1/adapters/flip/versions", json={"version": "v2", "source": f"{demo_dir}/demo-1"})
        assert added.status_code == 201, added.text
        assert all(label == "v1" for _, label, _, _ in results)      # 0% until the split says otherwise
        half = admin("PUT", f"{base}/v1/adapters/flip/traffic", json={"v1": 50, "v2": 50})
        assert half.status_code == 200, half.text
        assert "slot" in half.json()["prewarmed"]["v2"].values()
        wait_until(lambda: Counter(label for _, label, _, _ in results)["v2"] >= 3, 120, "v2 to serve traffic")
        with ThreadPoolExecutor(12) as burst:   # more than the fleet runs at once: some queue for v1
            queued = [burst.submit(complete, base, "flip", "flip") for _ in range(12)]
            full = admin("PUT", f"{base}/v1/adapters/flip/traffic", json={"v2": 100})
            burst_replies = [f.result() for f in queued]
        assert full.status_code == 200 and full.json()["retired"] == ["v1"], full.text
        assert [r.status_code for r in burst_replies] == [200] * 12, [r.text for r in burst_replies]
        assert all(r.json()["choices"][0]["text"] == expected[r.headers[VERSION_HEADER]] for r in burst_replies)
        flipped_at = len(results)
        wait_until(lambda: len(results) >= flipped_at + 4, 120, "traffic after the flip")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert [r for r in results if r[0] != 200] == []
    assert all(model == "flip" for _, _, model, _ in results)
    assert all(text == expected[label] for _, label, _, text in results), Counter((l, t) for _, l, _, t in results)
    assert {label for _, label, _, _ in results[flipped_at + 2:]} == {"v2"}
    names = lambda: {a["name"]: a for a in admin("GET", f"{base}/v1/adapters").json()["data"]}
    wait_until(lambda: "flip" not in names(), 30, "the directory to retire v1 once its grace passed")
    assert names()["flip@v2"]["traffic"] == 100
    v1_uid_gone = lambda: not any(u.startswith("flip@") and not u.startswith("flip@v2")
                                  for s in admin("GET", f"{base}/v1/adapters").json()["replicas"].values()
                                  for u in s["resident"])
    wait_until(v1_uid_gone, 90, "v1 to drain and unload everywhere",
               detail=lambda: {r: [u for u in s["resident"] if u.startswith("flip@")]
                               for r, s in admin("GET", f"{base}/v1/adapters").json()["replicas"].items()})
    models = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
    assert "flip" in [m["id"] for m in models] and "flip@v2" not in [m["id"] for m in models]
    assert admin("POST", f"{base}/v1/adapters", json={"name": "flip", "source": f"{demo_dir}/demo-0"}).status_code == 409
    assert admin("DELETE", f"{base}/v1/adapters/flip").status_code == 200
    assert complete(base, "flip").status_code == 404
    for name in ("ref-v1", "ref-v2"):
        admin("DELETE", f"{base}/v1/adapters/{name}")


def test_quota_429s_name_the_adapter(sources_fleet, metrics_url):
    base = sources_fleet["base"]
    set_quota = admin("PUT", f"{base}/v1/adapters/quota-a/quota", json={"max_concurrency": 1})
    assert set_quota.status_code == 200, set_quota.text
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: complete(base, "quota-a", f"q{i}", max_tokens=48), range(6)))
    codes = Counter(r.status_code for r in replies)
    assert codes[200] >= 1 and codes[429] >= 1 and set(codes) <= {200, 429}, codes
    refused = next(r for r in replies if r.status_code == 429)
    assert "'quota-a'" in refused.json()["error"]["message"] and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "adapter_quota_exceeded"
    assert complete(base, "quota-a").status_code == 200      # places are given back

    assert admin("PUT", f"{base}/v1/adapters/quota-a/quota", json={"requests_per_s": 0.5}).status_code == 200
    rate_codes = Counter(complete(base, "quota-a", max_tokens=1).status_code for _ in range(8))
    assert rate_codes[429] >= 5 and rate_codes[200] >= 1, rate_codes   # one token, the next after 2 s
    assert admin("PUT", f"{base}/v1/adapters/quota-a/quota", json={}).status_code == 200
    assert Counter(complete(base, "quota-a", max_tokens=1).status_code for _ in range(4)) == {200: 4}
    assert admin("PUT", f"{base}/v1/adapters/quota-a/quota", json={"max_concurrency": 0}).status_code == 400

    def counted():
        series = scrape(metrics_url)
        c = total(series, "ray_lorafleet_adapter_quota_rejections_total", adapter="quota-a", quota="max_concurrency")
        r = total(series, "ray_lorafleet_adapter_quota_rejections_total", adapter="quota-a", quota="requests_per_s")
        return (c, r) if c >= codes[429] and r >= rate_codes[429] else None

    wait_until(counted, 60, "quota rejections on the metrics endpoint", interval_s=1.0)


def test_admin_writes_are_compare_and_set(sources_fleet):
    """A write based on an entry that changed meanwhile is refused (409) and changes nothing."""
    from ray import serve

    from deployments.registry import RegistryConflictError

    base = sources_fleet["base"]
    directory = serve.get_deployment_handle("AdapterDirectory", app_name=APP)
    entries = lambda: {e["name"]: e for e in directory.get_registry.remote(-1, 0.0).result(timeout_s=30)["entries"]}
    stale = entries()["quota-a"]
    assert admin("PUT", f"{base}/v1/adapters/quota-a/quota", json={"max_concurrency": 7}).status_code == 200
    with pytest.raises(RegistryConflictError, match="changed meanwhile"):
        directory.write_entries.remote([{**stale, "max_concurrency": 3}],
                                       {"quota-a": stale["generation"]}).result(timeout_s=30)
    assert entries()["quota-a"]["max_concurrency"] == 7        # the newer write stands
    with pytest.raises(RegistryConflictError):                 # a write cannot bring back a removed entry
        directory.write_entries.remote([{**stale, "name": "gone"}], {"gone": 1}).result(timeout_s=30)
    assert "gone" not in entries()
    assert admin("PUT", f"{base}/v1/adapters/quota-a/quota", json={}).status_code == 200


def test_a_source_edited_after_registration_is_refused_not_served(sources_fleet, demo_assets, resolve_root):
    """The weights were validated at registration; a replica that reads other bytes later serves nothing."""
    folder = resolve_root / "edited-src"
    shutil.copytree(demo_assets.adapters["demo-1"], folder)
    base = sources_fleet["base"]
    reply = admin("POST", f"{base}/v1/adapters", json={"name": "edited", "source": str(folder)})
    assert reply.status_code == 201 and reply.json()["content"].startswith("local:"), reply.text
    weights = folder / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))                 # edited in place before any replica loaded it
    refused = complete(base, "edited")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "source_changed", refused.text
    assert admin("DELETE", f"{base}/v1/adapters/edited").status_code == 200
