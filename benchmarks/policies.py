"""Miss ratio of the pool's eviction policies (LRU, FIFO, SIEVE) against Belady's MIN.

Why: the pool's policy decides how often a replica reloads an adapter; Belady's MIN (evict
the resident adapter whose next use is furthest away) is the exact lower bound for one
pool, so the gap to it says how much a smarter online policy could still win.

Model: requests arrive one at a time; each needs its adapter in one of ``slots`` slots
(no base-model slot); a miss loads it, evicting the policy's victim when every slot is
full. The online policies are the project's real ``pool.eviction`` objects driven by a
fast loop whose semantics are checked against ``pool.memory_pool.LoRAMemoryPool`` on
every run (and in ``tests/test_benchmarks_pool.py``).

    python -m benchmarks.policies [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Sequence

import numpy as np

from pool.adapter import AdapterConfig, LoRAAdapterWeights
from pool.eviction import EvictionPolicy, get_eviction_policy
from pool.memory_pool import LoRAMemoryPool
from pool.shapes import LoRAModelShape

from . import common
from .traces import Popularity, adapter_sequence, adapter_uid, standard_popularities

ONLINE_POLICIES = ("lru", "fifo", "sieve")
ALL_POLICIES = (*ONLINE_POLICIES, "belady")


# ---------------------------------------------------------------------------- replays


def replay_online(requests: Iterable[Hashable], slots: int, policy: str | EvictionPolicy,
                  victims: Optional[list] = None) -> int:
    """Misses of ``policy`` (a name or a fresh policy object) on ``requests``.

    Drives the real policy object exactly as ``LoRAMemoryPool.prepare_lora_batch({uid})``
    followed by ``release_batch()`` does: a hit is ``mark_used``; a miss with no free slot
    is ``select_victim(resident)`` and ``remove(victim)``, then ``mark_used`` of the new
    uid (the uid is never resident on a miss, so the resident set is the candidate set).
    Appends each victim to ``victims`` if given.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    pol = get_eviction_policy(policy) if isinstance(policy, str) else policy
    mark_used, select_victim, remove = pol.mark_used, pol.select_victim, pol.remove
    resident: set = set()
    misses = 0
    for uid in requests:
        if uid in resident:
            mark_used(uid)
            continue
        misses += 1
        if len(resident) >= slots:
            victim = select_victim(resident)
            resident.remove(victim)
            remove(victim)
            if victims is not None:
                victims.append(victim)
        mark_used(uid)
        resident.add(uid)
    return misses


def replay_pool(requests: Iterable[str], slots: int, policy: str,
                victims: Optional[list] = None) -> int:
    """Misses of the real ``LoRAMemoryPool`` (no tensors) on ``requests``, one batch each.

    The reference the fast loop is checked against: ``LoRAModelShape(num_layers=0,
    modules={})`` gives a pool with no weight buffers, and each request is one
    ``prepare_lora_batch({uid})`` then ``release_batch()``.
    """
    config = AdapterConfig(rank=8, alpha=16.0, use_rslora=False, target_modules=())

    def fetch(uid: str) -> LoRAAdapterWeights:
        return LoRAAdapterWeights(name=uid, config=config, a={}, bt={})

    pool = LoRAMemoryPool(LoRAModelShape(num_layers=0, modules={}), slots, max_lora_rank=64,
                          fetch_weights=fetch, eviction_policy=policy)
    if victims is not None:
        pool.subscribe(lambda e: victims.append(e.uid) if e.kind == "evict" else None)
    for uid in requests:
        pool.prepare_lora_batch({uid})
        pool.release_batch()
    if pool.counters.loads != pool.counters.misses:
        raise AssertionError(f"pool counted {pool.counters.loads} loads but {pool.counters.misses} misses")
    return pool.counters.misses


def next_use(ids: np.ndarray) -> np.ndarray:
    """For each request, the index of the next request for the same adapter (``len(ids)`` if none)."""
    ids = np.asarray(ids)
    n = ids.shape[0]
    nxt = np.full(n, n, dtype=np.int64)
    if n < 2:
        return nxt
    order = np.argsort(ids, kind="stable")  # grouped by adapter, increasing index inside a group
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_misses(ids: np.ndarray, slots: int, victims: Optional[list] = None) -> int:
    """Belady's MIN with demand loading: evict the resident adapter used furthest in the future.

    A max-heap keyed on next use with lazy deletion: an entry is live only while it
    still equals its adapter's current next use (next uses of one adapter only grow, so a
    stale entry can never look live). O(n log n).
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    ids = np.asarray(ids)
    nxt = next_use(ids).tolist()
    resident: dict[int, int] = {}  # adapter -> index of its next use
    heap: list[tuple[int, int]] = []  # (-next use, adapter)
    push, pop = heapq.heappush, heapq.heappop
    misses = 0
    for uid, nu in zip(ids.tolist(), nxt):
        if uid not in resident:
            misses += 1
            if len(resident) >= slots:
                while True:
                    neg, victim = pop(heap)
                    if resident.get(victim) == -neg:
                        break
                del resident[victim]
                if victims is not None:
                    victims.append(victim)
        resident[uid] = nu
        push(heap, (-nu, uid))
    return misses


def fill_index(ids: np.ndarray, slots: int) -> Optional[int]:
    """Index of the request that loads the ``slots``-th distinct adapter (pool first full), if any.

    Until then no policy evicts, so every policy (Belady too) has exactly ``slots``
    misses up to and including it: warm misses are the rest.
    """
    ids = np.asarray(ids)
    first = np.zeros(ids.shape[0], dtype=bool)
    first[np.unique(ids, return_index=True)[1]] = True
    distinct = np.cumsum(first)
    hit = np.flatnonzero(distinct >= slots)
    return int(hit[0]) if hit.size else None


def check_against_pool(ids: np.ndarray, slots: int, policies: Sequence[str] = ONLINE_POLICIES) -> dict[str, bool]:
    """Whether the fast loop and the real pool make the same evictions, per policy."""
    uids = [adapter_uid(i) for i in np.asarray(ids).tolist()]
    same = {}
    for name in policies:
        fast_v: list = []
        pool_v: list = []
        fast = replay_online(uids, slots, name, fast_v)
        real = replay_pool(uids, slots, name, pool_v)
        same[name] = fast == real and fast_v == pool_v
    return same


# ---------------------------------------------------------------------------- benchmark


@dataclass(frozen=True)
class Settings:
    requests: int
    adapters: tuple[int, ...]
    slots: tuple[int, ...]
    popularities: tuple[Popularity, ...]
    seed: int
    check_requests: int


def settings_for(quick: bool, seed: int, requests: Optional[int]) -> Settings:
    pops = tuple(standard_popularities())
    if quick:
        return Settings(requests or 10000, (50, 1000), (4, 16), pops, seed, 1000)
    return Settings(requests or 100000, (50, 200, 1000), (4, 8, 16, 32), pops, seed, 3000)


def run_setting(ids: np.ndarray, slots: int) -> dict[str, int]:
    """Misses of every policy on one adapter sequence."""
    seq = ids.tolist()
    misses = {name: replay_online(seq, slots, name) for name in ONLINE_POLICIES}
    misses["belady"] = belady_misses(ids, slots)
    return misses


def make_row(pop: Popularity, adapters: int, slots: int, ids: np.ndarray, misses: dict[str, int]) -> common.Row:
    n = len(ids)
    row: common.Row = {"family": pop.family, "param": pop.param, "adapters": adapters, "slots": slots}
    for name in ALL_POLICIES:
        row[name] = misses[name] / n
    best_misses = min(misses[p] for p in ONLINE_POLICIES)
    row["best"] = "=".join(p for p in ONLINE_POLICIES if misses[p] == best_misses)
    row["gap"] = (best_misses - misses["belady"]) / n
    row["gap_rel"] = (best_misses - misses["belady"]) / misses["belady"]
    # Warm-only ratios: misses after the pool first fills, over the requests after that point.
    fill = fill_index(ids, slots)
    warm_n = n - (fill + 1) if fill is not None else 0
    for name in ALL_POLICIES:
        row[f"warm_{name}"] = (misses[name] - slots) / warm_n if warm_n else 0.0
    row.update({f"misses_{name}": misses[name] for name in ALL_POLICIES})
    row["requests"] = n
    return row


def summarize(rows: Sequence[common.Row]) -> dict[str, object]:
    """SIEVE vs LRU win/tie/loss counts and the mean gap of each online policy to Belady."""
    sieve_wins = sum(1 for r in rows if r["misses_sieve"] < r["misses_lru"])
    sieve_ties = sum(1 for r in rows if r["misses_sieve"] == r["misses_lru"])
    out: dict[str, object] = {
        "settings": len(rows),
        "sieve_beats_lru": sieve_wins,
        "sieve_ties_lru": sieve_ties,
        "lru_beats_sieve": len(rows) - sieve_wins - sieve_ties,
        "best_counts": {p: sum(1 for r in rows if p in str(r["best"]).split("=")) for p in ONLINE_POLICIES},
    }
    for p in ONLINE_POLICIES:
        gaps = [(r[f"misses_{p}"] - r["misses_belady"]) / r["requests"] for r in rows]
        rel = [(r[f"misses_{p}"] - r["misses_belady"]) / r["misses_belady"] for r in rows]
        out[f"mean_gap_{p}"] = float(np.mean(gaps))
        out[f"mean_gap_rel_{p}"] = float(np.mean(rel))
    return out


def summary_lines(summary: dict[str, object]) -> list[str]:
    n = summary["settings"]
    lines = [
        f"SIEVE beats LRU on {summary['sieve_beats_lru']} of {n} settings "
        f"(ties {summary['sieve_ties_lru']}, LRU better on {summary['lru_beats_sieve']}).",
        "best online policy (ties count for each): "
        + ", ".join(f"{p} {c}" for p, c in summary["best_counts"].items()),
        "mean gap to Belady (miss-ratio points; relative to Belady's misses):",
    ]
    for p in ONLINE_POLICIES:
        lines.append(f"  {p:5s} {summary[f'mean_gap_{p}']:.4f}  ({100 * summary[f'mean_gap_rel_{p}']:.1f}%)")
    return lines


def policy_goals(pool_check_identical: bool, rows: Sequence[common.Row]) -> list[common.Goal]:
    """The run's two checks: the fast replay is the pool's own semantics, and Belady is a lower bound.

    Both must hold for the miss ratios to mean anything; a broken replay or a Belady that
    some online policy beats would make every number in the table wrong.
    """
    beaten = sum(1 for r in rows if any(r[f"misses_{p}"] < r["misses_belady"] for p in ONLINE_POLICIES))
    return [
        common.goal("fast replay = LoRAMemoryPool (misses, victims)",
                    "identical" if pool_check_identical else "different", "identical", pool_check_identical),
        common.goal("settings where an online policy beats Belady", beaten, "== 0", beaten == 0),
    ]


def plot(rows: Sequence[common.Row], settings: Settings, path) -> None:
    """Miss ratio vs slots: one panel per popularity (columns) and adapter count (rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pops, adapters = settings.popularities, settings.adapters
    fig, axes = plt.subplots(len(adapters), len(pops), figsize=(2.6 * len(pops), 2.4 * len(adapters)),
                             squeeze=False, sharex=True)
    styles = {"lru": "o-", "fifo": "s--", "sieve": "^-", "belady": "k:"}
    for i, n_ad in enumerate(adapters):
        for j, pop in enumerate(pops):
            ax = axes[i][j]
            sel = sorted((r for r in rows if r["adapters"] == n_ad and r["family"] == pop.family
                          and r["param"] == pop.param), key=lambda r: r["slots"])
            xs = [r["slots"] for r in sel]
            for name in ALL_POLICIES:
                ax.plot(xs, [r[name] for r in sel], styles[name], label=name, markersize=3, linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(settings.slots), [str(s) for s in settings.slots])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{pop.family} {pop.label}, {n_ad} adapters", fontsize=8)
            ax.tick_params(labelsize=7)
            if j == 0:
                ax.set_ylabel("miss ratio", fontsize=8)
            if i == len(adapters) - 1:
                ax.set_xlabel("slots", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Adapter-slot miss ratio ({settings.requests} requests, cold+warm, seed {settings.seed})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = common.base_parser(__doc__.split("\n\n")[0], plot=True)
    parser.add_argument("--requests", type=int, help="requests per trace (default 100000; 10000 with --quick)")
    args = parser.parse_args(argv)
    s = settings_for(args.quick, args.seed, args.requests)
    started = time.perf_counter()

    check_ids = adapter_sequence(s.check_requests, 50, Popularity("power", 0.3), s.seed)
    checks = {k: check_against_pool(check_ids, k) for k in (4, 16)}
    same = all(all(v.values()) for v in checks.values())
    print(f"fast replay vs LoRAMemoryPool on {s.check_requests} requests, slots 4 and 16, "
          f"lru/fifo/sieve: {'identical misses and victims' if same else 'DIFFERENT'}")
    if not same:
        print(f"  details: {checks}")

    rows = []
    for pop in s.popularities:
        for n_ad in s.adapters:
            ids = adapter_sequence(s.requests, n_ad, pop, s.seed)
            for k in s.slots:
                rows.append(make_row(pop, n_ad, k, ids, run_setting(ids, k)))
    columns = ["family", "param", "adapters", "slots", *ALL_POLICIES, "best", "gap", "gap_rel"]
    print()
    common.print_table(
        rows, columns, floatfmt=".3f",
        title=(f"miss ratio = misses / requests over {s.requests} requests per trace, cold + warm "
               f"(pool starts empty; the JSON also has warm_* ratios that skip the fill); "
               f"gap = best online - belady, gap_rel = gap / belady"),
    )
    summary = summarize(rows)
    print()
    for line in summary_lines(summary):
        print(line)
    goals = policy_goals(same, rows)
    print()
    common.print_goals(goals)
    print(f"\n({common.elapsed_since(started)})")

    settings = common.settings_of(args, requests=s.requests, adapters=s.adapters, slots=s.slots,
                                  popularities=[(p.family, p.param) for p in s.popularities],
                                  miss_ratio="cold+warm (pool starts empty); warm_* skip the fill")
    if args.json:
        common.write_json(args.json, "policies", rows, settings,
                          {"summary": summary, "pool_check_identical": same}, goals=goals)
    png = common.plot_path(args)
    if png:
        plot(rows, s, png)
        print(f"plot: {png}")
    return 0 if all(g["pass"] for g in goals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
