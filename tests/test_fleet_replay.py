"""The simulator's replica against the cost model's arithmetic, and its replay of a fleet_live run.

The hand-built traces check the time model of ``benchmarks/live/emulated.py`` step by step: a disk
read delays only its requester, a slot copy stalls every running request by exactly its seconds,
prefill is chunked under the token budget, and the multiplexing baseline unloads its least recently
used model only once that model's requests finish.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import cluster_sim, fleet_live
from benchmarks.sim import SimConfig, Simulator
from benchmarks.sim.costs import CostModel
from benchmarks.sim.fleet_agreement import agreement_with_live
from benchmarks.sim.fleet_replay import live_replica_ids, replay_fleet_live, replay_variant
from benchmarks.traces import Popularity, Trace

COSTS = CostModel()
D = COSTS.decode_s_per_token
P = COSTS.prefill_s_per_token


def hand_trace(rows: list[tuple[float, int, int, int]], ranks: list[int]) -> Trace:
    """``(arrival, adapter, prompt tokens, output tokens)`` per request."""
    arrival, adapter, prompt, output = (np.array(col) for col in zip(*rows))
    return Trace(adapters=adapter.astype(np.int64), arrivals=arrival.astype(float), input_lens=prompt.astype(np.int64),
                 output_lens=output.astype(np.int64), ranks=np.array(ranks), num_adapters=len(ranks),
                 popularity=Popularity("zipf", 0.0))


def one_replica(trace: Trace, router: str = "pow2", **kw) -> Simulator:
    sim = Simulator(trace, SimConfig(replicas=1, router=router, warmup_fraction=0.0, **kw))
    sim.run()
    return sim


def test_a_disk_read_delays_only_its_requester_and_a_copy_stalls_the_batch_by_its_seconds():
    r8, h8 = COSTS.disk_read_s(8), COSTS.host_copy_s(8)
    r64, h64 = COSTS.disk_read_s(64), COSTS.host_copy_s(64)
    t1 = r8 + h8 + COSTS.step_s(100)  # A: read, then one step: its slot copy and its 100-token prefill
    b_arrives = t1 + 0.001
    sim = one_replica(hand_trace([(0.0, 0, 100, 40), (b_arrives, 1, 50, 5)], ranks=[8, 64]), slots=2, max_batch=4)
    a, b = sim.requests
    assert a.t_submit == pytest.approx(r8) and a.t_first == pytest.approx(t1)
    # B's read (0.47 s) runs while A decodes: A is not delayed by it ...
    assert b.t_submit == pytest.approx(b_arrives + r64)
    assert t1 + 18 * D < b.t_submit < t1 + 19 * D
    # ... B joins at A's next step boundary; that step copies B's slot and prefills B: A waits for both
    boundary = t1 + 19 * D
    assert b.t_admit == pytest.approx(boundary)
    assert b.t_first == pytest.approx(boundary + h64 + COSTS.step_s(50))
    assert b.t_done == pytest.approx(b.t_first + 4 * D)
    assert a.t_done == pytest.approx(t1 + 39 * D + h64 + 50 * P)
    assert (a.loaded, a.disk, b.loaded, b.disk) == (True, True, True, True)
    assert a.load_s == pytest.approx(r8 + h8) and b.load_s == pytest.approx(r64 + h64)
    replica = sim.replicas[0]
    assert (replica.copies, replica.disk_reads) == (2, 2)
    assert replica.steps == 40  # A's 40 tokens; B's 5 all came in steps A ran too


def test_a_second_request_waits_for_the_read_in_flight_and_a_host_hit_reads_nothing():
    r16, h16 = COSTS.disk_read_s(16), COSTS.host_copy_s(16)
    sim = one_replica(hand_trace([(0.0, 0, 10, 1), (0.01, 0, 10, 1), (5.0, 0, 10, 1)], ranks=[16]),
                      slots=1, max_batch=4)
    a, b, c = sim.requests
    assert a.t_submit == b.t_submit == pytest.approx(r16)  # one read: B waited for A's
    assert a.t_first == pytest.approx(r16 + h16 + COSTS.step_s(10))  # A's submission started the step ...
    assert b.t_first == pytest.approx(a.t_first + COSTS.step_s(10))  # ... B joins the next: no second copy
    assert (a.disk, b.disk, c.disk) == (True, False, False)
    assert c.t_first == pytest.approx(5.0 + COSTS.step_s(10))  # still in its slot: no read, no copy


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    prompt = 2 * COSTS.token_budget + 1000
    sim = one_replica(hand_trace([(0.0, 0, prompt, 3)], ranks=[8]), slots=1, max_batch=2)
    (a,) = sim.requests
    start = COSTS.disk_read_s(8) + COSTS.host_copy_s(8)
    assert sim.replicas[0].sched.prefill_chunks == 2
    assert a.t_first == pytest.approx(start + 3 * D + prompt * P)  # three steps: 8192, 8192, 1000 tokens
    assert a.t_done == pytest.approx(a.t_first + 2 * D)


def test_the_multiplexed_baseline_unloads_its_lru_model_only_after_its_requests_finish():
    r8, h8 = COSTS.disk_read_s(8), COSTS.host_copy_s(8)
    trace = hand_trace([(0.0, 0, 10, 100), (1.0, 1, 10, 1)], ranks=[8, 8])
    sim = one_replica(trace, router="multiplex", slots=1, max_batch=4)
    a, b = sim.requests
    assert a.t_first == pytest.approx(r8 + h8 + COSTS.step_s(10))
    assert a.t_done == pytest.approx(a.t_first + 99 * D)
    # B's registration waited for A's model to drain, then read B's files, then copied B's slot
    assert b.t_submit == pytest.approx(a.t_done + r8)
    assert b.t_first == pytest.approx(a.t_done + r8 + h8 + COSTS.step_s(10))
    assert list(sim.replicas[0].models) == [sim.requests[1].uid]
    assert sim.replicas[0].pool.counters.loads == 2


def test_disk_reads_wait_for_one_of_the_workers_threads():
    """The worker reads in ``asyncio.to_thread``: with ``read_threads`` reads running, the next waits for one."""
    r8, r16 = COSTS.disk_read_s(8), COSTS.disk_read_s(16)
    rows = [(0.0, 0, 10, 1), (0.0, 1, 10, 1), (0.0, 0, 10, 1)]
    free = one_replica(hand_trace(rows, ranks=[8, 16]), slots=2, max_batch=4)
    assert [r.t_submit for r in free.requests] == pytest.approx([r8, r16, r8])
    one = one_replica(hand_trace(rows, ranks=[8, 16]), slots=2, max_batch=4, read_threads=1)
    a, b, c = one.requests
    assert (a.t_submit, c.t_submit) == pytest.approx((r8, r8))  # the third waits for the first's read, not a thread
    assert b.t_submit == pytest.approx(r8 + r16)  # its read waited for the thread
    assert one.replicas[0].timings.disk_s is not None


def test_product_worker_copies_into_a_free_slot_without_draining():
    """The product's worker (no multiplexer) evicts an idle slot at the step boundary: no drain."""
    trace = hand_trace([(0.0, 0, 10, 100), (1.0, 1, 10, 1)], ranks=[8, 8])
    sim = one_replica(trace, router="pow2", slots=2, max_batch=4)
    a, b = sim.requests
    assert b.t_submit == pytest.approx(1.0 + COSTS.disk_read_s(8))
    assert b.t_first < a.t_done


# ---------------------------------------------------------------------------- agreement


def live_row(variant: str, loads: int, p50: float, p99: float, segment: str = "trace@0.4") -> dict:
    return {"variant": variant, "segment": segment, "loads": loads, "ttft_p50_ms": p50, "ttft_p99_ms": p99,
            "e2e_p50_ms": 2 * p50, "e2e_p99_ms": 2 * p99}


def test_agreement_flags_a_ranking_flip_even_within_tolerance():
    live = [live_row("affinity", 100, 200.0, 900.0), live_row("pow2", 105, 210.0, 1000.0)]
    same = [live_row("affinity", 102, 220.0, 950.0), live_row("pow2", 108, 230.0, 1050.0)]
    flipped = [live_row("affinity", 106, 220.0, 950.0), live_row("pow2", 103, 230.0, 1050.0)]
    ok = agreement_with_live(live, same)
    assert ok["agrees"] and ok["cells_ok"] == 2 and ok["pairs_ok"] == ok["pairs"] == 2
    bad = agreement_with_live(live, flipped)
    assert all(r["loads_ok"] for r in bad["rows"])  # every cell within 10% ...
    assert not bad["agrees"]  # ... but the loads ranking flipped
    wrong = [r for r in bad["rankings"] if not r["same"]]
    assert [(r["metric"], r["live"], r["sim"]) for r in wrong] == [("loads", "affinity < pow2", "pow2 < affinity")]


def test_agreement_checks_each_tolerance_and_missing_cells():
    live = [live_row("affinity", 100, 200.0, 900.0), live_row("hash", 0, 200.0, 900.0)]
    sim = [live_row("affinity", 111, 200.0, 900.0), live_row("hash", 1, 251.0, 1124.0)]
    out = agreement_with_live(live, sim)
    by = {r["variant"]: r for r in out["rows"]}
    assert not by["affinity"]["loads_ok"]  # 11% off
    assert by["hash"]["loads_ok"] and not by["hash"]["p50_ok"] and by["hash"]["p99_ok"]  # one load; 25.5%; 24.9%
    assert not out["agrees"]
    assert not agreement_with_live(live, sim[:1])["agrees"]  # a cell the simulator did not replay


# ---------------------------------------------------------------------------- replaying a run


def tiny_settings() -> dict:
    args = fleet_live.make_parser().parse_args(["--replicas", "2", "--slots", "2", "--rows", "4", "--adapters", "12",
                                                "--requests", "30", "--loads", "0.5", "--arrivals", "gamma"])
    costs = CostModel().scaled(args.time_scale)
    return json.loads(json.dumps(fleet_live._settings(args, fleet_live.make_segments(args), costs)))


def test_replay_runs_every_variant_segment_by_segment_deterministically():
    settings = tiny_settings()
    rows = replay_fleet_live(settings, list(fleet_live.VARIANTS))
    assert [(r["variant"], r["segment"]) for r in rows] == [(v, "gamma@0.5") for v in fleet_live.VARIANTS]
    assert rows == replay_fleet_live(settings, list(fleet_live.VARIANTS))
    for r in rows:
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] <= r["e2e_p99_ms"] and r["loads"] >= 0
    warm, measured = replay_variant(settings, "affinity")
    assert warm["segment"] == "warmup" and measured["start_s"] == pytest.approx(warm["end_s"] + 0.5)
    late = replay_variant(settings, "affinity", starts={"gamma@0.5": warm["end_s"] + 100.0})[1]
    assert late["start_s"] == pytest.approx(warm["end_s"] + 100.5)


def test_a_replay_runs_on_the_live_runs_replica_ids():
    """Hashing routers, the plan's ties and the standby copies order replicas by a hash of their ids: a replay on
    the live run's ids (its rows name them) routes ``hash`` exactly as the live router did; on other ids, elsewhere."""
    settings = tiny_settings()
    ids = ("ks96whxa", "nd2gm6c9")
    rows = replay_fleet_live(settings, ["hash"], replica_ids=ids)
    assert live_replica_ids(rows, 2) == ids and set(rows[0]["replica_of"]) <= set(ids)
    assert live_replica_ids(rows, 3) is None  # a replica that served nothing: the ids are not all known
    assert rows == replay_fleet_live(settings, ["hash"], replica_ids=ids[::-1])  # the order given does not matter
    renamed = replay_fleet_live(settings, ["hash"], replica_ids=("aaaaaaaa", "zzzzzzzz"))
    assert [r["replica_of"] for r in renamed] != [r["replica_of"] for r in rows]
    with pytest.raises(ValueError, match="1 replica ids for 2 replicas"):
        replay_fleet_live(settings, ["hash"], replica_ids=ids[:1])


def test_cluster_sim_takes_a_fleet_live_json(tmp_path, capsys):
    """A run the simulator itself produced agrees with its replay exactly (the goal's plumbing)."""
    settings = tiny_settings()
    rows = replay_fleet_live(settings, ["affinity", "pow2"])
    path = tmp_path / "fleet_live.json"
    path.write_text(json.dumps({"metadata": {"benchmark": "fleet_live", "settings": settings}, "rows": rows}))
    out, goal = cluster_sim.live_check([str(path)])
    assert goal["name"] == "sim_reproduces_live_ranking" and goal["measured"] == 1.0 and goal["pass"]
    assert len(out) == 2 and all(r["loads_ok"] and r["p99_ok"] for r in out)
    loads = {r["variant"]: r["loads"] for r in rows}
    assert loads["affinity"] != loads["pow2"]
    swapped = [dict(r, loads=loads["pow2" if r["variant"] == "affinity" else "affinity"]) for r in rows]
    path.write_text(json.dumps({"metadata": {"benchmark": "fleet_live", "settings": settings}, "rows": swapped}))
    goal = cluster_sim.live_check([str(path)])[1]
    assert goal["pass"] is False and goal["measured"] == 0.5  # the loads pair flipped; the p99 pair did not


def test_a_fresh_affinity_deployment_comes_up_one_replica_at_a_time_and_a_viewless_one_stays_cold():
    """As live (``scale_events.warm_start_at_deploy``): the first replica finds no plan and warms nothing, then
    reads ahead what the next plan tick gives it (free slots first); each later one warms its trial plan;
    at the end every replica has noted the final plan's placements on it."""
    from benchmarks.sim.scale_events import warm_start_at_deploy
    from routing.plan import planned_on

    trace = hand_trace([(0.0, a, 10, 1) for a in range(40)], ranks=[8] * 40)
    sim = Simulator(trace, SimConfig(replicas=4, router="affinity", slots=4, warmup_fraction=0.0))
    plans = warm_start_at_deploy(sim)
    assert len(plans) == 4 and plans[0].slots == plans[0].host == ()
    assert len(sim.replicas[0].pool.uid_to_slot) == 4  # read ahead into its free slots
    for plan, replica in zip(plans[1:], sim.replicas[1:]):
        assert 0 < len(plan.slots) <= 3 and set(plan.slots) <= set(replica.pool.uid_to_slot)
        assert set(plan.slots) | set(plan.host) <= set(replica.host.uids())  # read before traffic
    for replica in sim.replicas:
        assert replica.planned == set(planned_on(sim.directory.plan, replica.rid))
    assert warm_start_at_deploy(Simulator(trace, SimConfig(replicas=4, router="pow2"))) == []


def test_the_replay_names_adapters_as_fleet_live_does():
    """The plan orders adapters of equal need by name: the replay must use the live run's names."""
    from benchmarks.sim.fleet_replay import ADAPTER_NAMES

    assert all(ADAPTER_NAMES.format(i) == fleet_live.adapter_name(i) for i in (0, 7, 100, 255))


def test_the_replay_polls_and_prices_as_the_live_router_does():
    """The replayed affinity router's feed pacing, priors and policy are the routing settings the live router
    built: the defaults when fleet_live passes no ``--routing``, and exactly its ``--routing`` when it does."""
    from benchmarks.sim.feed import PollPacing
    from benchmarks.sim.fleet_replay import routing_of
    from routing.settings import DEFAULT_SETTINGS

    args = fleet_live.make_parser().parse_args(["--quick"])
    assert fleet_live.app_args(args, CostModel().scaled(args.time_scale)).router_kwargs() == {}
    assert PollPacing() == PollPacing.of(DEFAULT_SETTINGS)
    assert routing_of(vars(args)) == DEFAULT_SETTINGS

    tuned = fleet_live.make_parser().parse_args(["--quick", "--routing", "spill_margin=0.5", "requests_per_poll=8"])
    live_kwargs = fleet_live.app_args(tuned, CostModel().scaled(tuned.time_scale)).router_kwargs()
    assert live_kwargs == {"spill_margin": 0.5, "requests_per_poll": 8}
    replayed = routing_of(json.loads(json.dumps(vars(tuned))))  # as the run's JSON metadata stores it
    assert (replayed.spill_margin, replayed.requests_per_poll) == (0.5, 8)
    assert PollPacing.of(replayed).requests_per_poll == 8
    with pytest.raises(ValueError, match="spill_margn"):
        routing_of({"routing": ["spill_margn=0.5"]})
    trace = hand_trace([(0.0, 0, 16, 4)], ranks=[16])
    router = Simulator(trace, SimConfig(replicas=2, routing=replayed)).router
    assert router.config.spill_margin == 0.5 and router.config.requests_per_poll == 8


def test_a_paced_feed_reaches_the_router_once_per_poll_of_requests():
    """With ``PollPacing`` the router hears the directory only when a poll is out: after 16 routed requests
    (or 5 s idle), never twice within 0.2 s; unpaced, at every sync."""
    from benchmarks.sim.feed import DirectoryFeed, PollPacing

    class Router:
        replies = 0

        def apply_directory_reply(self, reply):
            self.replies += 1

    now = [0.0]
    feed = DirectoryFeed(lambda: now[0], 0.02, 8, registered=["a"], pacing=PollPacing())
    feed.join("r1", _snapshot("r1"))
    router = Router()
    feed.start(router)
    assert router.replies == 1
    for step in range(1, 50):  # 1 s of syncs, every one with news (a heartbeat that changes), no traffic
        now[0] = step * 0.02
        feed.directory.heartbeat("r1", host_cached=[f"x{step}"])
        feed.sync(router)
    assert router.replies == 1  # no poll went out: no traffic and < 5 s
    feed.routed += 16
    now[0] += 0.02
    feed.directory.heartbeat("r1", host_cached=["y"])
    feed.sync(router)
    assert router.replies == 2
    now[0] += 0.02
    feed.routed += 16
    feed.directory.heartbeat("r1", host_cached=["z"])
    feed.sync(router)
    assert router.replies == 2  # due by traffic, but within 0.2 s of the last poll
    now[0] += 0.2
    feed.sync(router)
    assert router.replies == 3
    now[0] += 5.0
    feed.sync(router)  # 5 s idle: a poll goes out, and nothing new: it waits
    assert router.replies == 3
    feed.directory.heartbeat("r1", host_cached=["w"])
    now[0] += 0.02
    feed.sync(router)
    assert router.replies == 4


def _snapshot(rid: str):
    from pool.memory_pool import LoRAMemoryPool
    from pool.shapes import LoRAModelShape

    return LoRAMemoryPool(LoRAModelShape(num_layers=0, modules={}), 2, 8, lambda uid: None, replica_id=rid).snapshot()


def test_ensemble_rows_and_split_rankings_summarise_several_replays():
    live = [live_row("affinity", 100, 200.0, 900.0), live_row("pow2", 120, 210.0, 1000.0)]
    replays = [[live_row("affinity", a, 200.0, p), live_row("pow2", 120, 210.0, 1000.0)]
               for a, p in ((101, 950.0), (99, 1050.0), (130, 980.0))]
    from benchmarks.sim.fleet_agreement import ensemble_rows, ranking_votes

    members = [agreement_with_live(live, r) for r in replays]
    rows = {r["variant"]: r for r in ensemble_rows(members)}
    assert rows["affinity"]["loads"] == "100 | 99 / 101 / 130" and rows["affinity"]["loads_ok"] == "2/3"
    split = ranking_votes(members)
    assert [(r["metric"], r["votes"]) for r in split] == [("loads", "2/3"), ("ttft_p99_ms", "2/3")]


def test_the_live_host_costs_delay_arrival_and_lengthen_every_step():
    """``HostCosts`` as the replay charges them: a request reaches its replica ``dispatch_s`` after the send, and
    every step takes ``step_host_s`` beyond the device's time (the read and the copy are unchanged)."""
    from dataclasses import replace

    host, hop = 0.003, 0.02
    costs = replace(COSTS, step_host_s=host)
    sim = one_replica(hand_trace([(0.0, 0, 100, 3)], ranks=[8]), slots=1, max_batch=4, costs=costs, dispatch_s=hop)
    (a,) = sim.requests
    assert a.t_dispatch == pytest.approx(hop) and a.t_submit == pytest.approx(hop + COSTS.disk_read_s(8))
    assert a.t_first == pytest.approx(a.t_submit + COSTS.host_copy_s(8) + COSTS.step_s(100) + host)
    assert a.t_done == pytest.approx(a.t_first + 2 * (D + host))


def test_live_host_costs_are_each_variants_step_weighted_host_work_and_median_hop():
    from benchmarks.sim.fleet_replay import HostCosts, live_host_costs

    rows = [{"variant": "pow2", "steps": 100, "step_host_ms": 2.0, "arrive_s": [0.01, 0.03, None]},
            {"variant": "pow2", "steps": 300, "step_host_ms": 4.0, "arrive_s": [0.02]},
            {"variant": "hash", "ttft_s": [0.5]}]  # a run from before the split: nothing to charge
    got = live_host_costs(rows)
    assert set(got) == {"pow2"}
    assert got["pow2"] == HostCosts(step_host_s=pytest.approx(0.0035), dispatch_s=pytest.approx(0.02))


def test_multiplexing_routes_on_model_ids_as_late_as_the_live_run_measured():
    """Serve's router hears a replica's new model only after the push and the controller's broadcast: a second
    request for the model sent before that goes to the replica with the fewest models and loads it again; after
    it, to the holder. The replay takes the delay a live run measured (``live_model_id_delays``)."""
    from benchmarks.sim.fleet_replay import live_model_id_delays

    trace = hand_trace([(0.0, 0, 10, 400), (0.3, 0, 10, 4)], ranks=[8])

    def loads(delay: float) -> int:
        sim = Simulator(trace, SimConfig(replicas=2, router="multiplex", warmup_fraction=0.0, lag_s=0.1,
                                         model_id_delay_s=delay))
        sim.run()
        return sum(r.pool.counters.loads for r in sim.replicas)

    assert loads(0.05) == 1  # the push reached the router before the second request: it joins the holder
    assert loads(0.5) == 2   # still unheard: the other replica (fewest models) loads it too
    rows = [{"variant": "multiplexed", "model_id_lag_s": [0.2, 0.3, 0.9]}, {"variant": "pow2"}]
    assert live_model_id_delays(rows) == {"multiplexed": pytest.approx(0.3 - 0.05)}


def test_a_replay_starts_from_the_fleet_a_live_deploy_recorded():
    """``scale_events.deployed_as_recorded``: each replica's slots and host tier and the directory's plan are
    what ``fleet_live`` recorded when its warm-up began (not a model of the order the replicas came up in);
    ``live_deploys`` finds them in the first measured row, and a replay of a warm-started variant uses them."""
    from benchmarks.sim.fleet_replay import live_deploys
    from benchmarks.sim.scale_events import deployed_as_recorded

    ids = ("ks96whxa", "nd2gm6c9")
    pools = {"ks96whxa": {"slots": ["demo-1", "demo-3"], "host": ["demo-1", "demo-3", "demo-5"]},
             "nd2gm6c9": {"slots": ["demo-0"], "host": ["demo-0", "demo-2"]}}
    plan = {"version": 7, "holders": {"demo-1": ["ks96whxa"], "demo-3": ["ks96whxa"], "demo-0": ["nd2gm6c9"]},
            "busy": [], "slotted": {"ks96whxa": ["demo-1", "demo-3"], "nd2gm6c9": ["demo-0"]}}
    trace = hand_trace([(0.0, a, 10, 1) for a in range(6)], ranks=[8] * 6)
    sim = Simulator(trace, SimConfig(replicas=2, router="affinity", slots=2, warmup_fraction=0.0, replica_ids=ids,
                                     adapter_names="demo-{}"))
    deployed_as_recorded(sim, pools, plan)
    for replica in sim.replicas:
        assert sorted(replica.pool.uid_to_slot) == pools[replica.rid]["slots"]
        assert sorted(replica.host.uids()) == pools[replica.rid]["host"]
        assert replica.planned == {a for a, rs in plan["holders"].items() if replica.rid in rs}
    assert sim.directory.planner.plan.version == 7 and sim.directory.planner.plan.holders["demo-0"] == ("nd2gm6c9",)
    with pytest.raises(ValueError, match="replicas the simulated fleet does not have"):
        deployed_as_recorded(Simulator(trace, SimConfig(replicas=2, router="affinity", slots=2, replica_ids=ids,
                                                        adapter_names="demo-{}")), {"elsewhere": pools["ks96whxa"]}, plan)

    warmup = {"pools_at_start": pools, "plan_at_start": plan, "loads": 3}
    rows = [{"variant": "affinity", "segment": "a", "warmup": warmup}, {"variant": "affinity", "segment": "b"},
            {"variant": "pow2", "segment": "a", "warmup": warmup}]
    assert live_deploys(rows) == {"affinity": warmup}  # only warm-started variants start from a recorded deploy
    settings = tiny_settings()
    deployed = replay_variant(settings, "affinity", replica_ids=ids, deployed=warmup)
    modelled = replay_variant(settings, "affinity", replica_ids=ids)
    assert deployed == replay_variant(settings, "affinity", replica_ids=ids, deployed=warmup)  # deterministic
    assert deployed[0]["loads"] != modelled[0]["loads"] or deployed[0]["ttft_p50_ms"] != modelled[0]["ttft_p50_ms"]


def test_fleet_live_goals_take_the_worst_cell_and_report_the_online_floor():
    def row(segment, variant, loads, p99, floor=30):
        return {"segment": segment, "variant": variant, "loads": loads, "ttft_p99_ms": p99, "online_floor": floor,
                "machine_cpu_share": 0.5}
    rows = [row("a", "affinity", 30, 900), row("a", "multiplexed", 60, 1000), row("a", "pow2", 90, 950),
            row("b", "affinity", 40, 1200, 20), row("b", "multiplexed", 50, 1100, 20), row("b", "hash", 45, 1300, 20)]
    got = {g["name"]: g for g in fleet_live.goals(rows, None)}
    assert got["fleet16_loads_vs_multiplexed"]["measured"] == 0.8 and got["fleet16_loads_vs_multiplexed"]["pass"] is False
    assert got["fleet16_p99_ttft_vs_best_peer"]["measured"] == round(1200 / 1100, 3)
    assert got["fleet16_online_floor_vs_multiplexed"]["measured"] == 0.5  # 30 / 60 in cell a, 20 / 50 in b
    assert got["fleet16_online_floor_vs_multiplexed"]["pass"] is None and got["fleet16_sim_agrees"]["pass"] is None
