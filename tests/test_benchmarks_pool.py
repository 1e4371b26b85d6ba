"""Fast checks of the pool benchmarks: traces, the policy replays, Belady, the swap harness.

The benchmarks' numbers are only worth reading if the fast replay is the pool's own
semantics and Belady really is the optimum, so both are proved here on small cases.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import common, policies, traces
from benchmarks.policies import belady_misses, check_against_pool, fill_index, next_use, replay_online, replay_pool
from benchmarks.traces import Popularity, adapter_sequence, adapter_uid, make_trace, top_share


def brute_force_min_misses(seq: tuple[int, ...], slots: int) -> int:
    """Fewest misses over every possible victim choice (demand loading, exhaustive)."""

    @lru_cache(maxsize=None)
    def go(i: int, resident: frozenset) -> int:
        if i == len(seq):
            return 0
        uid = seq[i]
        if uid in resident:
            return go(i + 1, resident)
        if len(resident) < slots:
            return 1 + go(i + 1, resident | {uid})
        return 1 + min(go(i + 1, (resident - {v}) | {uid}) for v in resident)

    return go(0, frozenset())


# ---------------------------------------------------------------------------- traces


def test_traces_are_deterministic_per_seed() -> None:
    pop = Popularity("power", 0.3)
    a, b = make_trace(500, 40, pop, cv=3.0, seed=7), make_trace(500, 40, pop, cv=3.0, seed=7)
    for field in ("adapters", "arrivals", "input_lens", "output_lens", "ranks"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    c = make_trace(500, 40, pop, cv=3.0, seed=8)
    assert not np.array_equal(a.adapters, c.adapters)
    # Ingredients have their own streams: the arrival CV does not change which adapters are asked for.
    np.testing.assert_array_equal(a.adapters, make_trace(500, 40, pop, cv=1.0, seed=7).adapters)
    np.testing.assert_array_equal(a.adapters, adapter_sequence(500, 40, pop, seed=7))


def test_trace_values_are_in_range() -> None:
    t = make_trace(2000, 30, Popularity("zipf", 1.0), seed=1)
    assert t.adapters.min() >= 0 and t.adapters.max() < 30
    assert set(t.ranks.tolist()) <= set(traces.RANK_CHOICES)
    assert np.all(np.diff(t.arrivals) >= 0)
    assert t.uids()[0] == adapter_uid(int(t.adapters[0]))
    assert len(t) == 2000


@pytest.mark.parametrize("family,params", [("power", (0.1, 0.3, 0.6, 1.0)), ("zipf", (1.2, 1.0, 0.8))])
def test_popularity_skew_order(family: str, params: tuple[float, ...]) -> None:
    """Listed from most to least skewed: smaller alpha and larger s concentrate requests."""
    shares = [top_share(adapter_sequence(20000, 200, Popularity(family, p), seed=3), 200) for p in params]
    assert shares == sorted(shares, reverse=True), shares
    exact = [Popularity(family, p).probabilities(200)[:20].sum() for p in params]
    assert exact == sorted(exact, reverse=True)


def test_power_alpha_one_is_uniform_and_samples_match_probabilities() -> None:
    np.testing.assert_allclose(Popularity("power", 1.0).probabilities(50), np.full(50, 1 / 50))
    for pop in (Popularity("power", 0.3), Popularity("zipf", 1.2)):
        p = pop.probabilities(20)
        assert p.sum() == pytest.approx(1.0)
        freq = np.bincount(adapter_sequence(200_000, 20, pop, seed=5), minlength=20) / 200_000
        np.testing.assert_allclose(freq, p, atol=0.005)


def test_gamma_arrivals_have_the_requested_rate_and_cv() -> None:
    rng = np.random.default_rng(0)
    for cv in (1.0, 4.0):
        gaps = np.diff(traces.gamma_arrivals(200_000, rate=5.0, cv=cv, rng=rng), prepend=0.0)
        assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_popularity_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        Popularity("uniform", 1.0)
    with pytest.raises(ValueError):
        Popularity("power", 0.0)


# ---------------------------------------------------------------------------- replays


def _small_traces():
    for seed in range(4):
        for pop in (Popularity("power", 0.3), Popularity("zipf", 1.0), Popularity("power", 1.0)):
            yield seed, pop, adapter_sequence(600, 12, pop, seed=seed)


@pytest.mark.parametrize("policy", policies.ONLINE_POLICIES)
def test_fast_replay_equals_real_pool(policy: str) -> None:
    """Same misses and the same victims, in order, as ``LoRAMemoryPool`` itself."""
    for slots in (1, 2, 5):
        for seed, pop, ids in _small_traces():
            uids = [adapter_uid(i) for i in ids.tolist()]
            fast_v, pool_v = [], []
            fast = replay_online(uids, slots, policy, fast_v)
            real = replay_pool(uids, slots, policy, pool_v)
            assert fast == real, (policy, slots, seed, pop)
            assert fast_v == pool_v, (policy, slots, seed, pop)
            # Integer uids (what the benchmark feeds the fast loop) give the same victims too.
            assert replay_online(ids.tolist(), slots, policy) == fast


def test_check_against_pool_reports_identical() -> None:
    ids = adapter_sequence(400, 30, Popularity("zipf", 0.8), seed=2)
    assert check_against_pool(ids, 4) == {p: True for p in policies.ONLINE_POLICIES}


def test_next_use_matches_naive() -> None:
    ids = np.random.default_rng(0).integers(0, 7, 300)
    naive = [next((j for j in range(i + 1, len(ids)) if ids[j] == ids[i]), len(ids)) for i in range(len(ids))]
    assert next_use(ids).tolist() == naive
    assert next_use(np.array([3])).tolist() == [1]


def test_belady_never_worse_than_online_policies() -> None:
    for slots in (1, 3, 6):
        for seed, pop, ids in _small_traces():
            best = belady_misses(ids, slots)
            for policy in policies.ONLINE_POLICIES:
                assert best <= replay_online(ids.tolist(), slots, policy), (policy, slots, seed, pop)


def test_belady_equals_brute_force_on_tiny_traces() -> None:
    rng = np.random.default_rng(11)
    for _ in range(60):
        n_ad = int(rng.integers(2, 6))
        slots = int(rng.integers(1, 4))
        ids = rng.integers(0, n_ad, int(rng.integers(1, 13)))
        assert belady_misses(ids, slots) == brute_force_min_misses(tuple(ids.tolist()), slots), (ids, slots)


def test_belady_records_victims_and_counts_compulsory_misses() -> None:
    ids = np.array([0, 1, 2, 0, 1, 3, 0, 1, 2])
    victims: list = []
    misses = belady_misses(ids, 2, victims)
    assert misses == brute_force_min_misses(tuple(ids.tolist()), 2)
    assert len(victims) == misses - 2
    assert belady_misses(ids, 4) == 4  # only the four first uses miss when everything fits


def test_fill_index() -> None:
    ids = np.array([5, 5, 1, 5, 2, 1, 3])
    assert fill_index(ids, 1) == 0
    assert fill_index(ids, 3) == 4
    assert fill_index(ids, 4) == 6
    assert fill_index(ids, 5) is None


def test_make_row_ratios_and_summary() -> None:
    ids = adapter_sequence(2000, 50, Popularity("zipf", 1.0), seed=0)
    row = policies.make_row(Popularity("zipf", 1.0), 50, 4, ids, policies.run_setting(ids, 4))
    assert 0 < row["belady"] <= min(row["lru"], row["fifo"], row["sieve"]) <= 1
    assert row["gap"] >= 0 and row["gap_rel"] >= 0
    assert row["best"].split("=")[0] in policies.ONLINE_POLICIES
    assert 0 <= row["warm_belady"] <= row["warm_lru"] <= 1
    s = policies.summarize([row])
    assert s["sieve_beats_lru"] + s["sieve_ties_lru"] + s["lru_beats_sieve"] == 1


def test_policies_main_tiny_run_writes_json_and_plot(tmp_path: Path, capsys) -> None:
    out = tmp_path / "p.json"
    assert policies.main(["--quick", "--requests", "300", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["metadata"]["benchmark"] == "policies"
    assert data["metadata"]["pool_check_identical"] is True
    assert len(data["rows"]) == 7 * 2 * 2
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "SIEVE beats LRU on" in printed
    assert [(g["name"], g["measured"], g["pass"]) for g in data["goals"]] == [
        ("fast replay = LoRAMemoryPool (misses, victims)", "identical", True),
        ("settings where an online policy beats Belady", 0, True)]
    for line in common.goal_lines(data["goals"]):
        assert line in printed


def test_policy_goals_fail_when_a_check_fails() -> None:
    ids = adapter_sequence(300, 20, Popularity("zipf", 1.0), seed=0)
    row = policies.make_row(Popularity("zipf", 1.0), 20, 4, ids, policies.run_setting(ids, 4))
    assert [g["pass"] for g in policies.policy_goals(True, [row])] == [True, True]
    assert [g["pass"] for g in policies.policy_goals(False, [row])] == [False, True]
    beaten = {**row, "misses_sieve": row["misses_belady"] - 1}  # what a broken Belady would produce
    goals = policies.policy_goals(True, [row, beaten])
    assert goals[1]["measured"] == 1 and goals[1]["pass"] is False


# ---------------------------------------------------------------------------- common + swap


def test_format_table_and_write_json(tmp_path: Path) -> None:
    rows = [{"a": 1, "b": 0.123456, "c": None}, {"a": 22, "b": float("nan"), "c": "x"}]
    text = common.format_table(rows)
    assert text.splitlines()[0].split() == ["a", "b", "c"]
    assert "0.1235" in text and "nan" in text
    goals = [common.goal("speed", np.float64(1.25), ">= 1.5", False), common.goal("ties", None, "> 0", None)]
    path = common.write_json(tmp_path / "x.json", "demo", rows, {"quick": True}, {"k": np.int64(3)}, goals=goals)
    data = json.loads(path.read_text())
    assert data["rows"][1]["b"] is None and data["metadata"]["k"] == 3
    assert {"settings", "machine", "timestamp"} <= set(data["metadata"])
    assert data["goals"] == [{"name": "speed", "measured": 1.25, "target": ">= 1.5", "pass": False},
                             {"name": "ties", "measured": None, "target": "> 0", "pass": None}]
    assert common.goal_lines(goals) == ["FAIL  speed  1.25 (goal >= 1.5)", "N/A   ties   None (goal > 0)"]


@pytest.mark.parametrize("bad", [dict(name="", passed=True), dict(name="x", passed="yes"),
                                 dict(name="x", passed=1.0)])
def test_goal_refuses_a_nameless_goal_or_a_non_verdict(bad) -> None:
    with pytest.raises(ValueError):
        common.goal(bad["name"], 1.0, ">= 1", bad["passed"])


def test_write_json_refuses_goals_that_are_not_goal_records(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="goal"):
        common.write_json(tmp_path / "x.json", "demo", [], {}, goals=[{"name": "x", "pass": True}])
    assert not (tmp_path / "x.json").exists()


def test_swap_bench_rank_smoke(tmp_path: Path) -> None:
    """One Llama-3-8B layer at rank 8: both paths load through the real pool and time something."""
    from benchmarks import swap
    from pool.device import default_device

    shape = swap.llama3_8b_shape(1)
    assert shape.adapter_bytes(64, 2) == 64 * (2 * 8192 + 2 * 5120 + 3 * 18432) * 2
    rows = swap.bench_rank(8, shape, torch.float32, default_device(), tmp_path, repeats=2, disk_repeats=1,
                           seed=0, profile=False)
    assert [r["source"] for r in rows] == ["host", "disk"]
    for r in rows:
        assert r["MB"] == pytest.approx(shape.adapter_bytes(8, 4) / 1e6)
        assert r["seconds"] > 0 and r["copy_s"] > 0 and r["GB/s"] > 0


def test_swap_main_writes_one_goal_per_rank_with_the_tables_verdict(tmp_path: Path, capsys) -> None:
    from benchmarks import swap

    out = tmp_path / "swap.json"
    assert swap.main(["--quick", "--layers", "1", "--ranks", "8,16", "--json", str(out), "--tmpdir",
                      str(tmp_path)]) == 0
    data = json.loads(out.read_text())
    host = [r for r in data["rows"] if r["source"] == "host"]
    assert [g["name"] for g in data["goals"]] == [f"host swap-in / plain copy bandwidth, rank {r}" for r in (8, 16)]
    for row, g in zip(host, data["goals"]):
        assert g["measured"] == row["ratio"] and g["pass"] is row["goal_met"] is (row["ratio"] >= swap.HOST_GOAL)
        assert g["target"] == f">= {swap.HOST_GOAL}"
    printed = capsys.readouterr().out
    for line in common.goal_lines(data["goals"]):
        assert line in printed
