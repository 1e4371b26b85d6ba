"""Traffic splits and the first-request resolver, without a cluster (quotas: test_quota_leases.py)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from deployments.config import AdapterSpec
from deployments.http_errors import HTTPError
from deployments.registry import RegistryEntry, RegistryFollower
from deployments.resolvers import AdapterResolver, LookupLimiter
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


def test_a_traffic_write_is_read_back_from_its_own_result_without_a_directory_call():
    """``RegistryFollower.merge``: a rollout's split is applied to the ingress's copy from the write's own
    result (no refresh round trip): written entries replace theirs, removed names go, others stay, the copy
    is a new dict (the gate re-groups families on identity) and the change hook sees old and new."""
    follower = RegistryFollower(directory=None)
    v1, v2, other = entry("a", 1, traffic=50), entry("a@v2", 2, "v2", "a", 50), entry("b", 3)
    follower.entries = {e.name: e for e in (v1, v2, other)}
    seen = []

    async def hook(old, new):
        seen.append((set(old), set(new)))

    follower.on_change = hook
    before = follower.entries
    written = {**v2.to_dict(), "traffic": 100, "generation": 7}
    asyncio.run(follower.merge([written], removed={"a": v1.uid}))
    assert follower.entries is not before
    assert set(follower.entries) == {"a@v2", "b"}
    assert follower.entries["a@v2"].traffic == 100 and follower.entries["a@v2"].generation == 7
    assert follower.entries["b"] is other
    assert seen == [({"a", "a@v2", "b"}, {"a@v2", "b"})]
    assert weights(families(follower.entries.values())["a"]) == {"v2": 100}


def test_merging_its_own_write_never_undoes_a_newer_one_the_long_poll_already_brought():
    """Another ingress wrote after this one and the long poll delivered it before this write's reply was
    merged: the newer generation stays, and a name re-registered since this write removed it stays too."""
    follower = RegistryFollower(directory=None)
    newer_v2 = RegistryEntry.from_dict({**entry("a@v2", 2, "v2", "a", 30).to_dict(), "generation": 9})
    again = RegistryEntry.from_dict({**entry("a", 5, traffic=70).to_dict(), "generation": 1})  # a new uid
    follower.entries = {"a@v2": newer_v2, "a": again}
    mine = {**entry("a@v2", 2, "v2", "a", 100).to_dict(), "generation": 8}
    asyncio.run(follower.merge([mine], removed={"a": "a@1"}))    # this write removed a's first registration
    assert follower.entries["a@v2"] is newer_v2 and follower.entries["a"] is again
    replaced = {**entry("b", 6).to_dict(), "generation": 2}     # an entry re-registered since it was read
    follower.entries = {"b": RegistryEntry.from_dict({**entry("b", 7).to_dict(), "generation": 1})}
    asyncio.run(follower.merge([replaced]))
    assert follower.entries["b"].uid == "b@7"


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
    assert resolver.lookups == 3 and resolver.resolved == 1   # the invalid name was no lookup


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


def test_resolver_bounds_what_bogus_names_cost(tmp_path):
    """Invalid names cost nothing; misses are an LRU of fixed size; each request gets its own error."""
    calls: list[str] = []

    async def register(spec: AdapterSpec) -> dict:
        calls.append(spec.name)
        raise AdapterNotFoundError(f"{spec.source} does not exist")

    clock = Clock()
    resolver = AdapterResolver([str(tmp_path)], register, negative_ttl_s=30, clock=clock, max_misses=8)

    async def errors_for(name, n):
        caught = []
        for _ in range(n):
            try:
                await resolver.resolve(name)
            except AdapterNotFoundError as exc:
                caught.append(exc)
        return caught

    huge = "x" * (1 << 20)
    invalid = asyncio.run(errors_for(huge, 3)) + asyncio.run(errors_for("a/b", 1))
    assert calls == [] and not resolver.misses and len(invalid) == 4
    assert len(str(invalid[0])) < 300                               # a 1 MiB name is not echoed back
    repeated = asyncio.run(errors_for("bogus", 50))
    assert calls == ["bogus"] and len({id(e) for e in repeated}) == 50   # one lookup, a fresh error each time
    assert all(e.__traceback__ is None or _depth(e.__traceback__) < 10 for e in repeated)
    asyncio.run(errors_for_all(resolver, [f"bogus-{i}" for i in range(100)]))
    assert len(resolver.misses) == 8 and "bogus-99" in resolver.misses and "bogus" not in resolver.misses


async def errors_for_all(resolver, names):
    for name in names:
        with pytest.raises(AdapterNotFoundError):
            await resolver.resolve(name)


def _depth(tb) -> int:
    n = 0
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


def test_resolver_lookups_are_limited_to_the_replica_part_of_the_fleet_rate(tmp_path):
    clock = Clock()
    started = asyncio.Event()
    release = asyncio.Event()
    calls: list[str] = []

    async def register(spec: AdapterSpec) -> dict:
        calls.append(spec.name)
        started.set()
        await release.wait()
        raise AdapterNotFoundError("no")

    # fleet: 4 lookups/s, 2 at once, over 2 ingress replicas -> this one (rank 0): 2/s, 1 at once
    limiter = LookupLimiter(4.0, 2, placement=lambda: (2, 0), clock=clock)
    resolver = AdapterResolver([str(tmp_path)], register, clock=clock, limiter=limiter)

    async def scenario():
        first = asyncio.ensure_future(resolver.resolve("n-0"))
        await started.wait()
        with pytest.raises(HTTPError) as busy:       # one lookup runs: the second waits for none, it is refused
            await resolver.resolve("n-1")
        assert busy.value.status == 429 and busy.value.code == "resolver_busy" and busy.value.retry_after == 1
        release.set()
        with pytest.raises(AdapterNotFoundError):
            await first
        with pytest.raises(HTTPError):
            await resolver.resolve("n-2")              # rate 2 per second here, paced: no burst past one
        clock.now = 0.5                                # half a second refills one
        with pytest.raises(AdapterNotFoundError):
            await resolver.resolve("n-3")
        with pytest.raises(HTTPError):
            await resolver.resolve("n-5")              # and no more in that half second
        clock.now = 5.0                                # a long idle still leaves a burst of one
        with pytest.raises(AdapterNotFoundError):
            await resolver.resolve("n-4")
        with pytest.raises(HTTPError):
            await resolver.resolve("n-6")

    asyncio.run(scenario())
    assert calls == ["n-0", "n-3", "n-4"] and "n-1" not in resolver.misses and limiter.running == 0


def test_a_local_folder_content_version_follows_its_bytes_not_its_mtime(demo_assets, tmp_path):
    import os
    import shutil

    from deployments.content_version import SourceChangedError, check_unchanged, folder_fingerprint
    from pool.store import AdapterRecord

    folder = tmp_path / "a"
    shutil.copytree(demo_assets.adapters["demo-0"], folder)
    registered = folder_fingerprint(folder)
    weights = folder / "adapter_model.safetensors"
    os.utime(weights, ns=(1, 1))                                  # another node's copy: same bytes, other mtime
    assert folder_fingerprint(folder) == registered
    record = AdapterRecord(uid="a@1", name="a", source=str(folder), revision=None, folder=folder, rank=4, nbytes=1)
    check_unchanged(record, registered)
    check_unchanged(record, None)                                 # registered before versions were recorded
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF                                              # one weight byte edited in place
    weights.write_bytes(bytes(data))
    with pytest.raises(SourceChangedError, match="register it again"):
        check_unchanged(record, registered)
