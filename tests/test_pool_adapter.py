"""PEFT adapter loading: what is accepted, and every refusal by its typed error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pool.adapter import load_adapter_folder
from pool.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    CorruptWeightsError,
    PickleWeightsRefusedError,
    RankTooLargeError,
    ShapeMismatchError,
    SourceNotAllowedError,
    UnsupportedAdapterFeatureError,
    UnsupportedTargetModulesError,
)
from pool.host_cache import HostAdapterCache
from pool.shapes import LoRAModelShape
from pool.sources import SourcePolicy, resolve_adapter_source
from pool.store import AdapterStore

from hub_cache import add_to_hub_cache


@pytest.fixture(scope="module")
def shape(demo_assets):
    from transformers import AutoConfig

    return LoRAModelShape.from_hf_config(AutoConfig.from_pretrained(demo_assets.model_dir))


@pytest.fixture
def adapter_copy(demo_assets, tmp_path):
    """A writable copy of demo-0 (rank 4, all seven modules)."""
    dst = tmp_path / "adapter"
    shutil.copytree(demo_assets.adapters["demo-0"], dst)
    return dst


def edit_config(folder: Path, **changes):
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_tensors(folder: Path, fn):
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_demo_adapters_load_with_stacked_layout(demo_assets, shape):
    for name, folder in demo_assets.adapters.items():
        w = load_adapter_folder(folder, shape, 16)
        raw = load_file(folder / "adapter_model.safetensors")
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert w.rank == cfg["r"] and set(w.a) == set(cfg["target_modules"])
        key = next(k for k in raw if ".lora_A." in k)
        module = key.split(".lora_A.")[0].rsplit(".", 1)[1]
        layer = int(key.split("layers.")[1].split(".")[0])
        assert torch.equal(w.a[module][layer], raw[key])
        assert torch.equal(w.bt[module][layer], raw[key.replace("lora_A", "lora_B")].t())
        expected = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg["use_rslora"] else cfg["r"])
        assert w.scaling == pytest.approx(expected)


def test_rank_above_max_names_both_numbers(demo_assets, shape):
    with pytest.raises(RankTooLargeError) as err:
        load_adapter_folder(demo_assets.adapters["demo-2"], shape, 8)  # demo-2 has rank 16
    assert "16" in str(err.value) and "8" in str(err.value)
    from deployments.http_errors import status_of

    assert status_of(err.value) == 400


def test_pickle_weights_are_refused(adapter_copy, shape):
    weights = adapter_copy / "adapter_model.safetensors"
    torch.save(load_file(weights), adapter_copy / "adapter_model.bin")
    weights.unlink()
    with pytest.raises(PickleWeightsRefusedError, match="adapter_model.bin"):
        load_adapter_folder(adapter_copy, shape, 16)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors_are_refused(adapter_copy, shape, damage):
    path = adapter_copy / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + data[18:])
    with pytest.raises(CorruptWeightsError):
        load_adapter_folder(adapter_copy, shape, 16)


def test_missing_files(adapter_copy, shape, tmp_path):
    with pytest.raises(AdapterNotFoundError):
        load_adapter_folder(tmp_path / "nowhere", shape, 16)
    (adapter_copy / "adapter_config.json").unlink()
    with pytest.raises(AdapterFormatError, match="adapter_config.json"):
        load_adapter_folder(adapter_copy, shape, 16)


def test_missing_weights_file(adapter_copy, shape):
    (adapter_copy / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterFormatError, match="adapter_model.safetensors"):
        load_adapter_folder(adapter_copy, shape, 16)


def test_target_modules_the_pool_does_not_serve(demo_assets):
    from transformers import AutoConfig

    attn_only = LoRAModelShape.from_hf_config(AutoConfig.from_pretrained(demo_assets.model_dir),
                                              ["q_proj", "k_proj", "v_proj", "o_proj"])
    with pytest.raises(UnsupportedTargetModulesError, match="down_proj"):
        load_adapter_folder(demo_assets.adapters["demo-0"], attn_only, 16)


def test_shape_mismatch(adapter_copy, shape):
    def widen(t):
        key = next(k for k in t if "q_proj.lora_A" in k)
        t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 1)

    edit_tensors(adapter_copy, widen)
    with pytest.raises(ShapeMismatchError, match="q_proj"):
        load_adapter_folder(adapter_copy, shape, 16)


@pytest.mark.parametrize("change, what", [
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(peft_type="PREFIX_TUNING"), "not LoRA"),
])
def test_unsupported_config_features(adapter_copy, shape, change, what):
    edit_config(adapter_copy, **change)
    with pytest.raises(UnsupportedAdapterFeatureError, match=what):
        load_adapter_folder(adapter_copy, shape, 16)


@pytest.mark.parametrize("extra_key, what", [
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding"),
    ("base_model.model.lm_head.lora_A.weight", "lm_head"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
    ("base_model.model.model.layers.0.self_attn.q_proj.bias", "biases"),
])
def test_unsupported_tensors(adapter_copy, shape, extra_key, what):
    edit_tensors(adapter_copy, lambda t: t.__setitem__(extra_key, torch.zeros(4, 4)))
    with pytest.raises(UnsupportedAdapterFeatureError, match=what):
        load_adapter_folder(adapter_copy, shape, 16)


def test_added_tokens_are_refused(adapter_copy, shape):
    (adapter_copy / "added_tokens.json").write_text('{"<new>": 263}')
    with pytest.raises(UnsupportedAdapterFeatureError, match="adds tokens"):
        load_adapter_folder(adapter_copy, shape, 16)


def test_allow_lists(demo_assets, tmp_path):
    folder = demo_assets.adapters["demo-0"]
    resolved = resolve_adapter_source(str(folder), policy=SourcePolicy.of(adapter_roots=[str(folder.parent)]))
    assert (resolved.folder, resolved.kind, resolved.version) == (folder.resolve(), "local", None)
    with pytest.raises(SourceNotAllowedError):
        resolve_adapter_source(str(folder), policy=SourcePolicy.of(adapter_roots=[str(tmp_path)]))
    with pytest.raises(SourceNotAllowedError, match="evil"):
        resolve_adapter_source("evil/adapter", policy=SourcePolicy.of(hub_orgs=["good"]))
    with pytest.raises(AdapterNotFoundError):
        resolve_adapter_source("not a repo id at all")


def test_hub_source_from_an_offline_cache(demo_assets, tmp_path):
    """A hub id resolves through huggingface_hub's cache, with HF_HUB_OFFLINE=1: no network."""
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, "acme/demo-adapter", demo_assets.adapters["demo-1"], "a" * 40)
    add_to_hub_cache(cache, "acme/demo-adapter", demo_assets.adapters["demo-2"], "b" * 40, ref="v2")
    script = textwrap.dedent(f"""
        import json
        from pool.sources import resolve_adapter_source
        from pool.errors import AdapterNotFoundError
        out = {{}}
        for rev in [None, "v2", "{'a' * 40}"]:
            resolved = resolve_adapter_source("acme/demo-adapter", rev)
            out[str(rev)] = [json.load(open(resolved.folder / "adapter_config.json"))["r"], resolved.version[:1]]
        try:
            resolve_adapter_source("acme/missing")
        except AdapterNotFoundError as e:
            out["missing"] = "not found" in str(e)
        print(json.dumps(out))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_TOKEN": "hf_dummy"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"None": [8, "a"], "v2": [16, "b"], "a" * 40: [8, "a"], "missing": True}


def test_store_registers_then_fetches_from_host_tier_or_disk(demo_assets, shape):
    store = AdapterStore(shape, 16, host_cache_bytes=10_000_000)
    rec = store.register("demo-0@1", str(demo_assets.adapters["demo-0"]), name="demo-0")
    assert rec.rank == 4 and "demo-0@1" in store.host_cache
    first = store.fetch("demo-0@1")
    assert store.host_cache.stats.hits == 1
    store.host_cache.remove("demo-0@1")
    again = store.fetch("demo-0@1")  # re-read from the folder
    assert torch.equal(first.a["q_proj"], again.a["q_proj"])
    with pytest.raises(RankTooLargeError):
        AdapterStore(shape, 8).register("x", str(demo_assets.adapters["demo-2"]))
    with pytest.raises(AdapterNotFoundError):
        store.fetch("never-registered")


def test_host_cache_is_lru_by_bytes(demo_assets, shape):
    ws = {n: load_adapter_folder(p, shape, 16) for n, p in demo_assets.adapters.items()}
    sizes = {n: w.nbytes for n, w in ws.items()}
    cache = HostAdapterCache(budget_bytes=sizes["demo-0"] + sizes["demo-1"] + 1, pin_memory=False)
    cache.put("demo-0", ws["demo-0"])
    cache.put("demo-1", ws["demo-1"])
    assert cache.get("demo-0") is not None   # demo-0 is now the most recent
    cache.put("demo-3", ws["demo-3"])        # evicts what no longer fits, oldest first
    assert "demo-1" not in cache and cache.stats.evictions >= 1
    assert cache.stats.bytes_used <= cache.budget_bytes
    assert cache.get("demo-1") is None and cache.stats.misses == 1
    tiny = HostAdapterCache(budget_bytes=10)
    tiny.put("demo-0", ws["demo-0"])         # larger than the whole budget: not cached
    assert "demo-0" not in tiny and tiny.stats.bytes_used == 0
    with pytest.raises(ValueError):
        HostAdapterCache(-1)


@dataclass(frozen=True)
class SimulatedAdapter:
    nbytes: int


def test_the_host_cache_keeps_any_sized_entry_so_the_simulator_evicts_as_a_replica_does():
    """The fleet simulator keeps sizes, not tensors, in this same cache: eviction must read only ``nbytes``."""
    cache: HostAdapterCache[SimulatedAdapter] = HostAdapterCache(budget_bytes=100, pin_memory=True)
    for uid, size in (("a", 40), ("b", 40), ("c", 30)):
        cache.put(uid, SimulatedAdapter(size))
    assert cache.uids() == ["b", "c"] and cache.stats.bytes_used == 70 and cache.stats.evictions == 1
    assert cache.get("b") == SimulatedAdapter(40)           # a use: b is now the most recent
    cache.put("d", SimulatedAdapter(60))                    # evicts c (the oldest), not b
    assert cache.uids() == ["b", "d"] and cache.stats.bytes_used == 100
    assert cache.put("huge", SimulatedAdapter(101)) == SimulatedAdapter(101) and "huge" not in cache


def test_a_weights_file_larger_than_any_valid_adapter_is_refused_before_reading(demo_assets, shape, tmp_path):
    import shutil

    from pool.adapter import max_adapter_file_bytes
    from pool.errors import AdapterTooLargeError

    folder = shutil.copytree(demo_assets.adapters["demo-1"], tmp_path / "huge")
    limit = max_adapter_file_bytes(shape, 16)
    with open(folder / "adapter_model.safetensors", "ab") as f:
        f.truncate(limit + 1)  # sparse: as large as the limit + 1 without writing it
    with pytest.raises(AdapterTooLargeError, match=str(limit)):
        load_adapter_folder(folder, shape, 16)
    with pytest.raises(AdapterTooLargeError, match="100 bytes"):
        load_adapter_folder(demo_assets.adapters["demo-1"], shape, 16, max_bytes=100)


def test_hub_failures_are_reported_as_what_they_are():
    """Gated or refused: 403; missing: 404; the hub down or rate-limiting: retry later (never a 404)."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    from pool.errors import SourceAccessDeniedError, SourceUnavailableError
    from pool.sources.hub import hub_error

    def response(status: int):
        return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/acme/x"))

    def after(cause: BaseException) -> LocalEntryNotFoundError:
        error = LocalEntryNotFoundError("no cached snapshot")
        error.__cause__ = cause
        return error

    cases = [
        (GatedRepoError("gated", response=response(403)), SourceAccessDeniedError),
        (HfHubHTTPError("refused", response=response(401)), SourceAccessDeniedError),
        (RepositoryNotFoundError("missing", response=response(404)), AdapterNotFoundError),
        (HfHubHTTPError("slow down", response=response(429)), SourceUnavailableError),
        (HfHubHTTPError("down", response=response(503)), SourceUnavailableError),
        (after(httpx2.ConnectError("refused")), SourceUnavailableError),
        (after(HfHubHTTPError("down", response=response(502))), SourceUnavailableError),
        (after(OfflineModeIsEnabled("offline")), AdapterNotFoundError),
        (LocalEntryNotFoundError("local_files_only and not cached"), AdapterNotFoundError),
    ]
    for exc, expected in cases:
        assert type(hub_error(exc, "hub adapter 'acme/x'")) is expected, exc
