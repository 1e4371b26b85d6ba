"""The HTTP API through real HTTP on the session cluster, with the official openai client."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
import torch

from conftest import ADMIN_TOKEN, FLEET_ARGS
from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.request import GenerateRequest
from waiting import wait_until

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def client(fleet, http_base):
    return openai.OpenAI(base_url=f"{http_base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local_engine(demo_assets):
    """The engine in this process, for 'same output as the engine's direct output'."""
    engine = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=3,
                                max_lora_rank=16, max_model_len=256, max_tokens_limit=64).engine_config())
    for name, path in demo_assets.adapters.items():
        engine.register_adapter(name, str(path))
    yield engine
    engine.shutdown()


def admin_state(base: str) -> dict:
    reply = httpx.get(f"{base}/v1/adapters", headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return {"data": body["data"], "resident": {r: s["resident"] for r, s in body["replicas"].items()}}


@pytest.mark.parametrize("model", ["demo", "demo-1", "demo-2"])
def test_completions_match_the_engine(client, local_engine, model):
    reply = client.completions.create(model=model, prompt="The fleet", max_tokens=8, temperature=0)
    adapter = None if model == "demo" else model
    direct = local_engine.generate_blocking(GenerateRequest(adapter=adapter, prompt="The fleet", max_tokens=8))
    assert reply.choices[0].text == direct.text
    assert reply.choices[0].finish_reason == direct.finish_reason
    assert reply.usage.prompt_tokens == direct.prompt_tokens and reply.usage.completion_tokens == 8
    assert reply.model == model and reply.object == "text_completion"


@pytest.mark.parametrize("model", ["demo", "demo-3"])
def test_chat_completions_match_the_engine(client, local_engine, model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    adapter = None if model == "demo" else model
    direct = local_engine.generate_blocking(GenerateRequest(adapter=adapter, messages=messages, max_tokens=6))
    assert reply.choices[0].message.content == direct.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.total_tokens == direct.prompt_tokens + direct.completion_tokens


def test_streaming_completions_and_chat(client):
    full = client.completions.create(model="demo-4", prompt="stream", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="demo-4", prompt="stream", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == 10

    messages = [{"role": "user", "content": "hi"}]
    chat_full = client.chat.completions.create(model="demo-0", messages=messages, max_tokens=7, temperature=0)
    chat_chunks = list(client.chat.completions.create(model="demo-0", messages=messages, max_tokens=7,
                                                      temperature=0, stream=True))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_full.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == "length"


def test_raw_stream_ends_with_done(fleet, http_base):
    with httpx.stream("POST", f"{http_base}/v1/completions", timeout=30,
                      json={"model": "demo-1", "prompt": "x", "max_tokens": 3, "stream": True}) as r:
        lines = [l for l in r.iter_lines() if l]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    assert all(l.startswith("data: ") for l in lines)


def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "demo"
    assert {f"demo-{i}" for i in range(6)} <= set(ids)


def test_health(fleet, http_base):
    assert httpx.get(f"{http_base}/health", timeout=10).json()["status"] == "ok"


def test_admin_requires_the_bearer_token(fleet, http_base):
    assert httpx.get(f"{http_base}/v1/adapters", timeout=10).status_code == 401
    wrong = httpx.get(f"{http_base}/v1/adapters", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{http_base}/v1/adapters", headers=AUTH, timeout=10).status_code == 200


def test_register_use_pin_unregister_round_trip(client, http_base):
    made = httpx.post(f"{http_base}/v1/adapters", headers=AUTH, timeout=60,
                      json={"name": "round-trip", "source": "demo:demo-8"})
    assert made.status_code == 201, made.text
    uid = made.json()["uid"]
    assert uid.startswith("round-trip@") and made.json()["rank"] == 16
    assert "round-trip" in [m.id for m in client.models.list().data]
    out = client.completions.create(model="round-trip", prompt="hi", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    entry = next(a for a in admin_state(http_base)["data"] if a["name"] == "round-trip")
    assert entry["resident_on"] and entry["loads"] >= 1

    pinned = httpx.post(f"{http_base}/v1/adapters/round-trip/pin", headers=AUTH, timeout=30)
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True
    def pinned_entry():
        entry = next(a for a in admin_state(http_base)["data"] if a["name"] == "round-trip")
        return entry if entry["pinned_on"] else None

    entry = wait_until(pinned_entry, 60, "round-trip to be pinned on a replica")
    assert entry["pinned"] and len(entry["pinned_on"]) == 1
    assert httpx.post(f"{http_base}/v1/adapters/round-trip/unpin", headers=AUTH, timeout=30).json()["pinned"] is False

    gone = httpx.delete(f"{http_base}/v1/adapters/round-trip", headers=AUTH, timeout=30)
    assert gone.status_code == 200 and gone.json()["uid"] == uid
    assert "round-trip" not in [a["name"] for a in admin_state(http_base)["data"]]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="round-trip", prompt="hi", max_tokens=3)
    wait_until(lambda: not any(uid in res for res in admin_state(http_base)["resident"].values()), 60,
               "workers to drain and unload round-trip everywhere")


@pytest.fixture(scope="module")
def bad_adapters(demo_assets, tmp_path_factory):
    """Adapters that must be refused: rank above the pool's max, pickle weights, corrupt weights."""
    from transformers import AutoConfig

    from engine.demo import write_demo_adapter
    from pool.shapes import LoRAModelShape

    root = tmp_path_factory.mktemp("bad-adapters")
    shape = LoRAModelShape.from_hf_config(AutoConfig.from_pretrained(demo_assets.model_dir), ["q_proj", "v_proj"])
    big = write_demo_adapter(root / "rank32", shape, rank=32, target_modules=["q_proj", "v_proj"], alpha=32, seed=5)
    pickled = root / "pickled"
    shutil.copytree(demo_assets.adapters["demo-0"], pickled)
    weights = pickled / "adapter_model.safetensors"
    from safetensors.torch import load_file

    torch.save(load_file(weights), pickled / "adapter_model.bin")
    weights.unlink()
    corrupt = root / "corrupt"
    shutil.copytree(demo_assets.adapters["demo-0"], corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 3])
    shapes = root / "wrong-shapes"
    shutil.copytree(demo_assets.adapters["demo-0"], shapes)
    from safetensors.torch import save_file

    tensors = load_file(shapes / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    save_file(tensors, shapes / "adapter_model.safetensors")
    no_config = root / "no-config"
    shutil.copytree(demo_assets.adapters["demo-0"], no_config)
    (no_config / "adapter_config.json").unlink()
    return {"big": str(big), "pickled": str(pickled), "corrupt": str(corrupt), "shapes": str(shapes),
            "no_config": str(no_config)}


def _bad_cases(bad):
    completions, chat, admin = "/v1/completions", "/v1/chat/completions", "/v1/adapters"
    return [
        ("POST", completions, {"model": "no-such-adapter", "prompt": "x"}, 404, "no-such-adapter"),
        ("POST", chat, {"model": "no-such-adapter", "messages": [{"role": "user", "content": "x"}]}, 404,
         "no-such-adapter"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "max_tokens": 65}, 400, "max_tokens"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("POST", completions, {"model": "demo-1", "prompt": ""}, 400, "prompt"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "n": 17}, 400, "n"),
        ("POST", completions, {"model": "demo-1"}, 400, "prompt"),
        ("POST", chat, {"model": "demo-1", "messages": []}, 400, "messages"),
        ("POST", completions, {"model": "demo-1", "prompt": "x" * 40_000}, 400, "prompt"),
        ("POST", completions, {"model": "demo-1", "prompt": "x" * 2_000_000}, 413, "exceeds"),
        ("POST", admin, {"name": "bad/name", "source": "demo:demo-0"}, 400, "name"),
        ("POST", admin, {"name": "big", "source": bad["big"]}, 400, "rank 32"),
        ("POST", admin, {"name": "pickled", "source": bad["pickled"]}, 400, "pickle"),
        ("POST", admin, {"name": "corrupt", "source": bad["corrupt"]}, 400, "corrupt"),
        ("POST", admin, {"name": "missing", "source": "/tmp/no/such/adapter"}, 404, "does not exist"),
        ("POST", admin, {"name": "outside", "source": "/etc"}, 403, "allowed roots"),
        ("POST", admin, {"name": "hub", "source": "evil/adapter"}, 403, "evil"),
        ("POST", admin, {"name": "demo-1", "source": "demo:demo-2"}, 409, "already registered"),
        ("POST", admin, {"name": "x", "source": "demo:demo-0", "color": "red"}, 400, "color"),
        ("DELETE", admin + "/no-such-adapter", None, 404, "no-such-adapter"),
        ("POST", admin + "/no-such-adapter/pin", None, 404, "no-such-adapter"),
        ("POST", admin + "/demo-1/pin", {"replicas": 0}, 400, "replicas"),
        ("POST", admin, [1, 2], 400, "JSON object"),
        # sampling parameters: finite, in range, and nothing the engine does not implement
        ("POST", completions, b'{"model": "demo-1", "prompt": "x", "temperature": NaN}', 400, "temperature"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "temperature": 3}, 400, "temperature"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "seed": -1}, 400, "seed"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "response_format": {"type": "json_schema",
                               "json_schema": {"name": "s", "schema": {"$ref": "#/missing"}}}}, 400, "missing"),
        ("POST", chat, {"model": "demo-1", "messages": [{"role": "user", "content": "x"}],
                        "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "logit_bias": {"5": 3}}, 400, "logit_bias"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "best_of": 2}, 400, "best_of"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "top_k": -2}, 400, "top_k"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "min_p": 0.1}, 400, "min_p"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "stop": "s" * 300}, 400, "stop"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "echo": True, "stream": True}, 400, "echo"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("POST", chat, {"model": "demo-1", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
        ("POST", completions, {"model": "demo-1", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        # prompts and messages
        ("POST", completions, {"model": "demo-1", "prompt": [999_999]}, 400, "prompt"),
        ("POST", completions, {"model": "demo-1", "prompt": ["a", "b"]}, 400, "prompt"),
        ("POST", completions, {"prompt": "x"}, 400, "model"),
        ("POST", chat, {"model": "demo-1", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        ("POST", chat, {"model": "demo-1", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
        ("POST", chat, {"model": "demo-1", "messages": [{"role": "user", "content": [
            {"type": "text", "text": 123}]}]}, 400, "text must be a string"),
        # adapter registration: names, sources, files
        ("POST", admin, {"name": "n" * 200, "source": "demo:demo-0"}, 400, "name"),
        ("POST", admin, {"name": "nosource"}, 400, "source"),
        ("POST", admin, {"name": "shapes", "source": bad["shapes"]}, 400, "shape"),
        ("POST", admin, {"name": "noconfig", "source": bad["no_config"]}, 400, "adapter_config.json"),
        ("POST", admin, {"name": "bad-replicas", "source": "demo:demo-0", "replicas": 0}, 400, "replicas"),
        ("POST", admin + "/demo-1/pin", {"replicas": "x"}, 400, "replicas"),
        ("POST", admin + "/demo-1/pin", {"color": "red"}, 400, "color"),
    ]


def pools(replicas) -> dict:
    """Every replica's real pool: resident uids and pins."""
    from fleet_helpers import real_pool

    return {r: (real_pool(r)["resident"], sorted(real_pool(r)["pinned"])) for r in replicas}


def test_every_bad_input_gets_its_status_and_changes_nothing(fleet, bad_adapters, http_base):
    from fleet_helpers import live_replicas

    replicas = live_replicas(2)
    before, pools_before = admin_state(http_base), pools(replicas)
    cases = _bad_cases(bad_adapters)
    assert len(cases) >= 40
    for method, path, body, status, needle in cases:
        raw = {"content": body, "headers": {**AUTH, "content-type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body, "headers": AUTH}  # bytes: JSON httpx will not write
        reply = httpx.request(method, f"{http_base}{path}", timeout=60, **raw)
        assert reply.status_code == status, (path, body, reply.text[:300])
        error = reply.json()["error"]
        assert needle in error["message"] or needle == error.get("param"), (needle, error)
        if status == 429 or status == 503:
            assert "retry-after" in reply.headers
    rank_error = httpx.post(f"{http_base}/v1/adapters", headers=AUTH, timeout=60,
                            json={"name": "big", "source": bad_adapters["big"]}).json()["error"]["message"]
    assert "32" in rank_error and str(FLEET_ARGS["max_lora_rank"]) in rank_error  # both numbers
    outside = httpx.post(f"{http_base}/v1/adapters", headers=AUTH, timeout=60,
                         json={"name": "outside", "source": "/etc"}).json()["error"]["message"]
    assert "/tmp" not in outside and "lorafleet-demo" not in outside  # the allow-list is not disclosed
    chunked = httpx.post(f"{http_base}/v1/completions", timeout=60, headers={"content-type": "application/json"},
                         content=(b"x" * 65536 for _ in range(40)))  # 2.6 MB, no Content-Length
    assert chunked.status_code == 413 and "exceeds" in chunked.json()["error"]["message"]
    assert admin_state(http_base) == before
    assert pools(replicas) == pools_before


def test_pinning_the_last_free_slot_is_refused(fleet, http_base):
    pin = lambda name: httpx.post(f"{http_base}/v1/adapters/{name}/pin", headers=AUTH, json={"replicas": 2}, timeout=30)
    try:
        assert pin("demo-0").status_code == 200
        assert pin("demo-1").status_code == 200  # 2 of 3 slots pinned on both replicas
        before = admin_state(http_base)
        refused = pin("demo-2")
        assert refused.status_code == 409 and "at least one slot" in refused.json()["error"]["message"]
        assert [a["pinned"] for a in admin_state(http_base)["data"]] == [a["pinned"] for a in before["data"]]
    finally:
        for name in ["demo-0", "demo-1"]:
            httpx.post(f"{http_base}/v1/adapters/{name}/unpin", headers=AUTH, timeout=30)


def test_second_app_admin_off_and_queue_bound_gives_429(ray_cluster, fleet, http_base):
    """A second app: no admin token configured (403), and a queue bound of 2 (429 + Retry-After)."""
    import concurrent.futures

    from fleet_helpers import delete_app
    from ray import serve

    from deployments.app import build_fleet
    from deployments.config import AppArgs

    args = AppArgs(**{**FLEET_ARGS, "max_queued_requests": 2}, admin_token_env="LORAFLEET_TEST_UNSET_TOKEN",
                   adapters=[])
    serve.run(build_fleet(args, {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}),
              name="lorafleet-noadmin", route_prefix="/noadmin")
    try:
        reply = httpx.get(f"{http_base}/noadmin/v1/adapters", headers=AUTH, timeout=30)
        assert reply.status_code == 403
        assert "LORAFLEET_TEST_UNSET_TOKEN" in reply.json()["error"]["message"]
        models = httpx.get(f"{http_base}/noadmin/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["demo"]

        def one(_):
            return httpx.post(f"{http_base}/noadmin/v1/completions", timeout=120,
                              json={"model": "demo", "prompt": "load", "max_tokens": 64, "temperature": 0})

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(one, range(16)))
        statuses = [r.status_code for r in replies]
        assert 200 in statuses and 429 in statuses, statuses
        limited = next(r for r in replies if r.status_code == 429)
        assert limited.headers["retry-after"] == "1" and limited.json()["error"]["type"] == "rate_limit_error"
    finally:
        delete_app("lorafleet-noadmin")


def test_concurrent_registrations_all_land(fleet, http_base):
    """Sixteen registrations at once: each one is in the registry afterwards (the directory's writes
    once ran in Serve's thread pool, and two concurrent ones could each overwrite the other's)."""
    import asyncio

    names = [f"burst-{i}" for i in range(16)]

    async def register_all() -> list[int]:
        async with httpx.AsyncClient(base_url=http_base, headers=AUTH, timeout=120) as http:
            replies = await asyncio.gather(*(http.post("/v1/adapters", json={"name": n, "source": "demo:demo-1"})
                                             for n in names))
            return [r.status_code for r in replies]

    try:
        assert asyncio.run(register_all()) == [201] * len(names)
        registered = {a["name"] for a in admin_state(http_base)["data"]}
        assert set(names) <= registered, f"lost registrations: {sorted(set(names) - registered)}"
    finally:
        for name in names:
            httpx.delete(f"{http_base}/v1/adapters/{name}", headers=AUTH, timeout=30)
    assert not set(names) & {a["name"] for a in admin_state(http_base)["data"]}
