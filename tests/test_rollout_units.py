"""Traffic splits, per-adapter quotas and the first-request resolver, without a cluster."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from deployments.config import AdapterSpec
from deployments.http_errors import HTTPError
from deployments.quotas import AdapterQuotas
from deployments.registry import RegistryEntry
from deployments.resolvers import AdapterResolver
from deployments.traffic_split import check_label, check_split, families, label_of, pick, weights
from engine.errors import AdapterExistsError, InvalidRequestError
from pool.adapter import load_adapter_folder
from pool.errors import AdapterNotFoundError, RankTooLargeError
from pool.shapes import LoRAModelShape
from pool.sources import SourcePolicy, candidate_source, resolve_adapter_source, validate_resolver_roots


def entry(name, created, version=None, version_of=None, traffic=None, **quota) -> RegistryEntry:
    return RegistryEntry(name=name, uid=f"{name}@{created}", source="s", created=created, version=version,
                         version_of=version_of, traffic=traffic, **quota)


def family_of(*entries):
    return families(entries)


def test_versions_group_under_the_requested_name_first_registration_first():
    fams = family_of(entry("support@v2", 2, "v2", "support", 0), entry("support", 1), entry("other", 3))
    assert [e.name for e in fams["support"]] == ["support", "support@v2"]
    assert [label_of(e) for e in fams["support"]] == ["v1", "v2"]
    assert weights(fams["support"]) == {"v1": 100, "v2": 0}
    assert set(fams) == {"support", "other"}


def test_pick_follows_the_split():
    fam = family_of(entry("a", 1, traffic=90), entry("a@v2", 2, "v2", "a", 10))["a"]
    rng = random.Random(7)
    counts = Counter(label_of(pick(fam, rng)) for _ in range(4000))
    assert 0.08 < counts["v2"] / 4000 < 0.12
    only_new = family_of(entry("a@v2", 2, "v2", "a", 100), entry("a@v3", 3, "v3", "a", 0))["a"]
    assert {pick(only_new, rng).name for _ in range(200)} == {"a@v2"}
    with pytest.raises(AdapterNotFoundError, match="no version with traffic"):
        pick(family_of(entry("a@v2", 2, "v2", "a", 0), entry("a@v3", 3, "v3", "a", 0))["a"], rng)


def test_split_and_label_checks_name_what_is_wrong():
    fam = family_of(entry("a", 1), entry("a@v2", 2, "v2", "a", 0))["a"]
    assert check_split({"v2": 100}, fam) == {"v1": 0, "v2": 100}
    with pytest.raises(AdapterNotFoundError, match="'v9'"):
        check_split({"v1": 50, "v9": 50}, fam)
    with pytest.raises(InvalidRequestError, match="sum to 100"):
        check_split({"v1": 50, "v2": 40}, fam)
    with pytest.raises(InvalidRequestError, match="whole percent"):
        check_split({"v1": 150, "v2": -50}, fam)
    with pytest.raises(AdapterExistsError, match="v2"):
        check_label("v2", fam)
    with pytest.raises(InvalidRequestError):
        check_label("bad/label", fam)
    assert check_label("2024-06-01.r3", fam) == "2024-06-01.r3"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_concurrency_quota_refuses_naming_the_adapter_and_frees_on_release():
    quotas = AdapterQuotas(metrics=False)
    held = [quotas.acquire("support", 2, None) for _ in range(2)]
    with pytest.raises(HTTPError) as err:
        quotas.acquire("support", 2, None)
    assert err.value.status == 429 and "'support'" in str(err.value) and err.value.code == "adapter_quota_exceeded"
    quotas.acquire("other", 2, None)          # quotas are per adapter
    held[0]()
    held[0]()                                  # releasing twice frees one place only
    quotas.acquire("support", 2, None)
    with pytest.raises(HTTPError):
        quotas.acquire("support", 2, None)
    assert quotas.state.rejections[("support", "max_concurrency")] == 2


def test_rate_quota_is_a_token_bucket_shared_across_ingress_replicas():
    clock = Clock()
    quotas = AdapterQuotas(ingress_replicas=2, clock=clock, metrics=False)   # this replica's share: 5/s
    admitted = 0
    for _ in range(20):
        try:
            quotas.acquire("a", None, 10)()
            admitted += 1
        except HTTPError as exc:
            assert "10 requests per second" in str(exc)
    assert admitted == 5
    clock.now = 0.4                                                          # 0.4 s refills 2 tokens
    assert sum(_try(quotas, "a") for _ in range(5)) == 2
    assert AdapterQuotas(ingress_replicas=4, metrics=False).acquire("b", 2, None)  # a share rounds down to >= 1


def _try(quotas, name) -> bool:
    try:
        quotas.acquire(name, None, 10)()
        return True
    except HTTPError:
        return False


@pytest.fixture(scope="module")
def shape(demo_assets):
    from transformers import AutoConfig

    return LoRAModelShape.from_hf_config(AutoConfig.from_pretrained(demo_assets.model_dir))


def local_registrar(shape, policy, max_rank=16):
    """Registration as a worker validates it (resolve + full read), into a dict."""
    registered: dict[str, str] = {}
    calls: list[str] = []

    async def register(spec: AdapterSpec) -> dict:
        calls.append(spec.source)
        folder = resolve_adapter_source(spec.source, spec.revision, policy).folder
        await asyncio.sleep(0.05)
        load_adapter_folder(folder, shape, max_rank, name=spec.name)
        registered[spec.name] = spec.source
        return {"name": spec.name, "source": spec.source}

    return register, registered, calls


def test_resolver_tries_roots_in_order_once_and_remembers_misses(demo_assets, shape, tmp_path):
    adapters = demo_assets.adapters["demo-0"].parent
    roots = [str(tmp_path / "empty"), str(adapters)]
    (tmp_path / "empty").mkdir()
    register, registered, calls = local_registrar(shape, SourcePolicy())
    clock = Clock()
    resolver = AdapterResolver(roots, register, negative_ttl_s=30, clock=clock)

    async def scenario():
        first = await asyncio.gather(*(resolver.resolve("demo-1") for _ in range(5)))  # one attempt for all five
        assert all(r == {"name": "demo-1", "source": f"{adapters}/demo-1"} for r in first)
        with pytest.raises(AdapterNotFoundError, match="no adapter resolver"):
            await resolver.resolve("nope")
        with pytest.raises(AdapterNotFoundError):
            await resolver.resolve("nope")      # remembered: no second lookup
        clock.now = 31
        with pytest.raises(AdapterNotFoundError):
            await resolver.resolve("nope")      # expired: looked up again
        with pytest.raises(AdapterNotFoundError):
            await resolver.resolve("../etc")    # not a valid adapter name: nothing is tried

    asyncio.run(scenario())
    assert registered == {"demo-1": f"{adapters}/demo-1"}
    assert calls == [f"{tmp_path}/empty/demo-1", f"{adapters}/demo-1",
                     f"{tmp_path}/empty/nope", f"{adapters}/nope", f"{tmp_path}/empty/nope", f"{adapters}/nope"]
    assert resolver.lookups == 4 and resolver.resolved == 1


def test_resolver_reports_an_invalid_adapter_and_respects_allow_lists(demo_assets, shape, tmp_path):
    adapters = str(demo_assets.adapters["demo-0"].parent)
    register, registered, _ = local_registrar(shape, SourcePolicy(), max_rank=8)
    resolver = AdapterResolver([adapters], register)
    with pytest.raises(RankTooLargeError):           # demo-2 is rank 16: found, but not servable here
        asyncio.run(resolver.resolve("demo-2"))
    fenced, registered2, _ = local_registrar(shape, SourcePolicy.of(adapter_roots=[str(tmp_path)]))
    with pytest.raises(AdapterNotFoundError):        # outside the allow-list: skipped, so not found
        asyncio.run(AdapterResolver([adapters], fenced).resolve("demo-0"))
    assert registered == {} and registered2 == {}


def test_resolver_roots_propose_root_slash_name():
    assert candidate_source("s3://models/team-a/", "x") == "s3://models/team-a/x"
    assert candidate_source("gs://models", "x") == "gs://models/x"
    assert candidate_source("/srv/adapters/", "x") == "/srv/adapters/x"
    assert candidate_source("acme", "x") == "acme/x"
    for bad in ("relative/folder", "s3://", "azure://c/x", ".."):
        with pytest.raises(ValueError):
            validate_resolver_roots([bad])
