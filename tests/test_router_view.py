"""RouterView: directory deltas, routing-stats reconciliation, optimistic decisions."""

import pytest

from routing.identity import name_of
from routing.settings import RoutingSettings
from routing.view import RouterView


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def state(rid, seq, resident, free=1, **extra):
    return {"replica_id": rid, "seq": seq, "resident": resident, "free_slots": free, "pinned": [], **extra}


def test_full_then_deltas_then_removal():
    v = RouterView()
    v.apply_directory_reply({"epoch": "e1", "version": 3, "full": {"r0": state("r0", 2, {"a@1": 0})}})
    ids = ("r0", "r1")
    assert v.fleet_view(ids).holders == {"a": {0}}
    v.apply_directory_reply({"epoch": "e1", "version": 5, "changes": {"r1": state("r1", 1, {"b@2": 0})}})
    assert v.fleet_view(ids).holders == {"a": {0}, "b": {1}}
    v.apply_directory_reply({"epoch": "e1", "version": 6, "changes": {"r0": {"replica_id": "r0", "removed": True}}})
    assert v.fleet_view(ids).holders == {"b": {1}} and v.version == 6


def test_a_new_epoch_starts_over():
    v = RouterView()
    v.apply_directory_reply({"epoch": "e1", "version": 9, "full": {"r0": state("r0", 2, {"a@1": 0})}})
    v.apply_directory_reply({"epoch": "e2", "version": 2, "changes": {}})
    assert v.version == -1 and v.states == {}  # ask again from scratch


def test_routing_stats_win_only_when_newer():
    v = RouterView()
    v.apply_directory_reply({"epoch": "e", "version": 1, "full": {"r0": state("r0", 5, {"a@1": 0})}})
    v.apply_routing_stats("r0", {"seq": 4, "resident": {}, "free_slots": 3})
    assert v.fleet_view(("r0",)).holders == {"a": {0}}
    v.apply_routing_stats("r0", {"seq": 7, "resident": {"c@3": 1}, "free_slots": 0})
    view = v.fleet_view(("r0",))
    assert view.holders == {"c": {0}} and not view.free_slots[0]
    v.apply_routing_stats("r0", {})  # a replica that has not reported yet
    assert v.fleet_view(("r0",)).holders == {"c": {0}}


def test_optimistic_decisions_expire():
    clock = Clock()
    v = RouterView(ttl_s=2.0, clock=clock)
    v.record_decision("x", "r1")
    assert v.fleet_view(("r0", "r1"), "x").holders.get("x") == {1}
    assert v.fleet_view(("r0", "r1")).free_slots[1] == 0  # r1 unknown: its one assumed free slot is reserved
    assert "x" not in v.fleet_view(("r0", "r1")).holders  # only the adapter being routed gets the overlay
    clock.now += 3
    assert "x" not in v.fleet_view(("r0", "r1"), "x").holders


def test_host_cached_and_loading_adapters_are_warm_and_unknown_replicas_are_free():
    v = RouterView()
    v.apply_directory_reply({"epoch": "e", "version": 1, "full": {
        "r0": state("r0", 1, {}, free=0, host_cached=["h@1"], loading=["l@2"])}})
    view = v.fleet_view(("r0", "r9"))
    assert view.warm == {"h": {0}, "l": {0}}
    assert list(view.free_slots) == [0, 1]


def test_adapter_name_strips_the_registration_id():
    assert name_of("my-lora@0a1b2c3d") == "my-lora" and name_of("plain") == "plain"


def test_the_optimistic_overlay_equals_an_eager_merge():
    """fleet_view(ids, adapter) adds this router's live, unconfirmed decisions for that adapter only."""
    import numpy as np

    rng = np.random.default_rng(0)
    clock = Clock()
    v = RouterView(ttl_s=1.0, clock=clock)
    ids = tuple(f"r{i}" for i in range(6))
    names = [f"a{i}" for i in range(12)]
    live: dict[tuple[str, str], float] = {}  # (adapter, replica) -> expiry, the reference
    resident: dict[str, set[str]] = {}
    for version in range(1, 80):
        clock.now += float(rng.uniform(0.0, 0.4))
        if version % 5 == 1:
            full = {r: state(r, version, {f"{names[int(a)]}@x": s for s, a in
                                          enumerate(rng.choice(12, 3, replace=False))}, free=int(rng.integers(0, 2)))
                    for r in ids[: int(rng.integers(3, 7))]}
            v.apply_directory_reply({"epoch": "e", "version": version, "full": full})
            resident = {r: {name_of(u) for u in st["resident"]} for r, st in full.items()}
            live = {(a, r): t for (a, r), t in live.items() if a not in resident.get(r, set())}  # confirmed
        for _ in range(int(rng.integers(0, 4))):
            a, r = names[int(rng.integers(12))], ids[int(rng.integers(6))]
            v.record_decision(a, r)
            if a not in resident.get(r, set()) and live.get((a, r), 0.0) <= clock.now:
                live[(a, r)] = clock.now + 1.0  # recorded once, never extended
        base = v.fleet_view(ids)
        for name in names:
            extra = {ids.index(r) for (a, r), t in live.items() if a == name and t > clock.now}
            got = v.fleet_view(ids, name).holders.get(name, set())
            assert set(got) == set(base.holders.get(name, ())) | extra
        assert v.fleet_view(ids) is base or v.fleet_view(ids).holders == base.holders


def test_placements_reserve_free_slots_until_reported():
    clock = Clock()
    v = RouterView(ttl_s=2.0, clock=clock)
    v.apply_directory_reply({"epoch": "e", "version": 1, "full": {"r0": state("r0", 1, {"a@1": 0}, free=2)}})
    assert v.fleet_view(("r0",)).free_slots[0] == 2
    v.record_decision("a", "r0")  # already resident: no reservation
    v.record_decision("b", "r0")
    v.record_decision("b", "r0")  # the same placement again: not a second slot
    assert v.fleet_view(("r0",)).free_slots[0] == 1
    v.record_decision("c", "r0")
    assert v.fleet_view(("r0",)).free_slots[0] == 0
    # r0 reports b loaded (one slot used): b's reservation is confirmed, c's still holds a slot
    v.apply_routing_stats("r0", {"seq": 2, "resident": {"a@1": 0, "b@2": 1}, "free_slots": 1})
    assert v.fleet_view(("r0",)).free_slots[0] == 0
    clock.now += 3  # c's reservation expires: its slot is free again
    assert v.fleet_view(("r0",)).free_slots[0] == 1


def test_a_decision_is_not_extended_so_an_evicted_adapter_stops_attracting_traffic():
    clock = Clock()
    v = RouterView(ttl_s=2.0, clock=clock)
    v.apply_directory_reply({"epoch": "e", "version": 1, "full": {"r0": state("r0", 1, {}, free=1),
                                                                 "r1": state("r1", 1, {}, free=1)}})
    v.record_decision("x", "r1")
    for _ in range(3):
        clock.now += 0.5
        v.record_decision("x", "r1")  # more sends while it is live: they must not extend it
    clock.now += 0.6  # 2.1 s after the first send
    assert "x" not in v.fleet_view(("r0", "r1"), "x").holders


# ---------------------------------------------------------------------------- LocalRouterState

from routing.router_state import LocalRouterState  # noqa: E402


def test_local_state_tracks_requests_in_flight_and_their_adapters():
    clock = Clock()
    s = LocalRouterState(clock=clock)
    s.routed("q1", "r0", "a")
    s.routed("q2", "r0", "a")
    s.routed("q3", "r0", None)
    assert s.inflight["r0"] == 3 and s.active["r0"] == {"a": 2, None: 1}
    clock.now += 0.5
    assert s.completed("q1") == "r0" and s.active["r0"] == {"a": 1, None: 1}
    assert s.completed("q1") is None  # twice: ignored
    s.completed("q2")
    s.completed("q3")
    assert s.inflight["r0"] == 0 and not s.active["r0"]
    active = s.active_by_index(("r1", "r0"))
    assert active[0] == {} and active[1] == {}


def test_request_time_is_an_ewma_and_unmeasured_replicas_get_the_mean():
    clock = Clock()
    s = LocalRouterState(clock=clock, settings=RoutingSettings(request_time_alpha=0.5))
    for seconds in (1.0, 3.0):
        s.routed("q", "r0", "a")
        clock.now += seconds
        s.completed("q")
    times = s.request_s_by_index(("r0", "r1"))
    assert times[0] == 2.0 and times[1] == 2.0  # 1, then 1 + 0.5 * (3 - 1); r1: the mean of measured ones
    assert LocalRouterState().request_s_by_index(("r0",))[0] is None


def test_a_choice_counts_against_its_replica_until_serve_sends_it_or_it_expires():
    clock = Clock()
    s = LocalRouterState(clock=clock, settings=RoutingSettings(send_ttl_s=1.0))
    s.chose("q1", "r0")
    s.chose("q2", "r0")
    s.chose("q2", "r1")  # the same request decided again: its earlier choice is released
    assert s.pending == {"r0": 1, "r1": 1}
    s.sent("r0")
    assert s.pending == {"r1": 1}
    clock.now += 2
    s.expire()  # never sent (cancelled): the row comes back
    assert not s.pending


def test_demand_decays_with_time():
    clock = Clock()
    s = LocalRouterState(clock=clock, settings=RoutingSettings(demand_tau_s=10.0))
    for _ in range(10):
        s.routed("q", "r0", "hot")
        s.completed("q")
    rate = s.demand.get("hot")
    assert rate == pytest.approx(1.0)  # 10 requests / tau
    clock.now += 10
    assert s.demand.get("hot") == pytest.approx(rate / 2.718281828, rel=1e-6)
    assert s.demand.get("never") == 0.0
    clock.now += 1000
    s.demand.prune()
    assert len(s.demand) == 0


def test_replicas_without_measured_load_times_are_priced_at_the_fleet_mean():
    v = RouterView()
    v.apply_directory_reply({"epoch": "e", "version": 1, "full": {
        "r0": state("r0", 1, {}, slots=2, load_s={"host": 0.002, "disk": 0.04}),
        "r1": state("r1", 1, {}, slots=2, load_s={"host": 0.004, "disk": None}),
        "r2": state("r2", 1, {}, slots=2)}})
    view = v.fleet_view(("r0", "r1", "r2"))
    assert view.host_load_s == [0.002, 0.004, 0.003] and view.disk_load_s == [0.04, 0.04, 0.04]
    assert view.slots == [2, 2, 2]


def test_batch_slowdown_is_fitted_from_request_times_against_the_queue_they_joined():
    clock = Clock()
    s = LocalRouterState(clock=clock)
    assert s.batch_slowdown() is None
    k = 0
    for _ in range(10):  # each request takes 0.1 s plus 0.02 s per request already running there
        for queue in range(4):
            for j in range(queue):
                s.routed(f"busy{k}-{j}", "r0", "a")
            s.routed(f"q{k}", "r0", "a")
            clock.now += 0.1 + 0.02 * queue
            s.completed(f"q{k}")
            for j in range(queue):
                s._requests.pop(f"busy{k}-{j}")  # the fillers never complete: only the timed one counts
                s.inflight["r0"] -= 1
            k += 1
    assert s.batch_slowdown() == pytest.approx(0.2, rel=1e-6)



def test_prompts_sent_to_a_replica_queue_for_prefill_and_the_wait_runs_down_with_time():
    """Two 1,000-token prompts at 1 ms a token: 2 s of prefill queued; half a second later 1.5 s is left; a
    prompt sent after the queue ran dry starts from now, not from the old end; forgetting the replica drops it."""
    clock = Clock()
    s = LocalRouterState(clock=clock)
    s.routed("q1", "r0", "a", 1000, 1e-3)
    s.routed("q2", "r0", "b", 1000, 1e-3)
    s.routed("q3", "r1", "a", 0, 1e-3)  # no prompt (or no rate): no wait
    wait = s.prefill_wait_by_index(("r0", "r1", "r2"))
    assert [wait[i] for i in range(3)] == [pytest.approx(2.0), 0.0, 0.0] and len(wait) == 3
    clock.now += 0.5
    assert s.prefill_wait_by_index(("r0",))[0] == pytest.approx(1.5)
    clock.now += 5
    s.routed("q4", "r0", "a", 100, 1e-3)
    assert s.prefill_wait_by_index(("r0",))[0] == pytest.approx(0.1)
    s.forget_replica("r0")
    assert s.prefill_wait_by_index(("r0",))[0] == 0.0


def test_a_chosen_prompt_queues_for_prefill_from_its_decision_until_the_replica_accepts_it():
    """A burst decided before any of it is accepted sees the prompts decided ahead of it (Serve's send to the
    replica takes a round trip); the accept replaces the estimate by the routed one, never counting it twice; a
    decision never sent expires; a request decided again moves its prompt; forgetting the replica drops them."""
    clock = Clock()
    s = LocalRouterState(clock=clock, settings=RoutingSettings(send_ttl_s=1.0))
    s.chose("q1", "r0", 2.0)
    s.chose("q2", "r0", 1.0)
    s.chose("q3", "r1")  # no prompt: no wait
    wait = s.prefill_wait_by_index(("r0", "r1"))
    assert [wait[0], wait[1]] == [pytest.approx(3.0), 0.0]
    s.sent("r0")  # sent but not yet accepted: its prompt still counts
    assert s.prefill_wait_by_index(("r0",))[0] == pytest.approx(3.0)
    s.routed("q1", "r0", "a", 1000, 1e-3)  # accepted: 1 s as routed, replacing the decision's 2 s
    assert s.prefill_wait_by_index(("r0",))[0] == pytest.approx(2.0)
    s.chose("q2", "r1", 1.0)  # decided again elsewhere
    wait = s.prefill_wait_by_index(("r0", "r1"))
    assert [wait[0], wait[1]] == [pytest.approx(1.0), pytest.approx(1.0)]
    clock.now += 1.5
    s.expire()  # q2 never sent: gone; q1's routed second ran down
    wait = s.prefill_wait_by_index(("r0", "r1"))
    assert [wait[0], wait[1]] == [0.0, 0.0] and not s.pending_prefill
    s.chose("q4", "r0", 0.5)
    s.forget_replica("r0")
    assert s.prefill_wait_by_index(("r0",))[0] == 0.0
    s.routed("q4", "r0", "a")  # an accept after the replica was forgotten changes nothing
    assert not s.pending_prefill


def test_the_prefill_rate_is_measured_per_replica_and_unmeasured_ones_get_the_fleet_mean():
    from routing.load_timings import LoadTimings

    t = LoadTimings(alpha=0.5)
    assert t.report()["prefill"] is None
    t.observe_prefill(1000, 0.2)
    t.observe_prefill(1000, 0.2)  # nothing new: unchanged
    t.observe_prefill(3000, 0.8)  # 2,000 tokens in 0.6 s
    assert t.report()["prefill"] == pytest.approx(0.0002 + 0.5 * (0.0003 - 0.0002))
    v = RouterView()
    v.apply_directory_reply({"epoch": "e", "version": 1, "full": {
        "r0": state("r0", 1, {}, slots=2, load_s={"host": 0.002, "disk": 0.04, "prefill": 2e-4}),
        "r1": state("r1", 1, {}, slots=2, load_s={"host": 0.004, "disk": None, "prefill": 4e-4}),
        "r2": state("r2", 1, {}, slots=2)}})
    assert v.prefill_s_per_token("r1") == 4e-4 and v.prefill_s_per_token("r2") == pytest.approx(3e-4)
    assert RouterView().prefill_s_per_token("r0") is None  # nothing measured: the caller's prior


def test_a_requests_prompt_tokens_are_counted_or_estimated_from_its_text():
    from engine.request import GenerateRequest
    from routing.request_fields import request_prompt_tokens

    assert request_prompt_tokens(GenerateRequest(token_ids=[5] * 700)) == 700
    assert request_prompt_tokens(GenerateRequest(prompt="x" * 400)) == 100
    chat = [{"role": "system", "content": "y" * 40}, {"role": "user", "content": "z" * 360},
            {"role": "user", "content": [{"type": "text", "text": "not counted"}]}]
    assert request_prompt_tokens(GenerateRequest(messages=chat)) == 100
    assert request_prompt_tokens(GenerateRequest()) == 0 and request_prompt_tokens(None) == 0
