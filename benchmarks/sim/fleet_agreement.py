"""Does a simulated replay agree with the live fleet? Issue 25's test, cell by cell and pair by pair.

Why its own module: ``fleet_live`` (goal ``fleet16_sim_agrees``) and ``cluster_sim --live-json``
(goal ``sim_reproduces_live_ranking``) apply the same thresholds to the same rows:

- per variant and segment: loads within ``LOADS_TOL`` (10 %; counts, so a difference of one
  load always passes), TTFT p50 and p99 within ``TTFT_TOL`` (25 %), both relative to live;
- per segment, every pair of variants ordered alike by loads and by p99 TTFT (a pair the live
  run ties exactly may go either way).
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Mapping, Optional, Sequence

import numpy as np

LOADS_TOL = 0.10
TTFT_TOL = 0.25
RANKED = ("loads", "ttft_p99_ms")


def within(live: float, sim: float, tol: float, slack: float = 0.0) -> bool:
    """``sim`` within ``tol`` of ``live`` (relative), or within ``slack`` absolute."""
    if any(isinstance(v, float) and math.isnan(v) for v in (live, sim)):
        return False
    return abs(sim - live) <= max(tol * abs(live), slack)


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def agreement_with_live(live_rows: list[dict], sim_rows: list[dict]) -> dict:
    """``{"agrees", "summary", "rows", "rankings"}``: ``rows`` one per (segment, variant) the live run
    measured, live vs sim loads, TTFT p50 and p99 and whether each is within tolerance; ``rankings``
    one per (segment, metric, pair of variants) with the live and simulated order."""
    sim_by = {(r["segment"], r["variant"]): r for r in sim_rows}
    rows, missing = [], []
    for lr in sorted(live_rows, key=lambda r: (r["segment"], r["variant"])):
        key = (lr["segment"], lr["variant"])
        sr = sim_by.get(key)
        if sr is None:
            missing.append(key)
            continue
        row = {"segment": key[0], "variant": key[1], "loads_live": lr["loads"], "loads_sim": sr["loads"],
               "loads_ok": within(lr["loads"], sr["loads"], LOADS_TOL, slack=1.0)}
        for metric, short in (("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99")):
            row[f"{short}_live"], row[f"{short}_sim"] = lr[metric], sr[metric]
            row[f"{short}_ok"] = within(lr[metric], sr[metric], TTFT_TOL)
        rows.append(row)
    rankings = _rankings(live_rows, sim_by)
    cells_ok = sum(all(r[k] for k in ("loads_ok", "p50_ok", "p99_ok")) for r in rows)
    pairs_ok = sum(r["same"] for r in rankings)
    agrees = not missing and bool(rows) and cells_ok == len(rows) and pairs_ok == len(rankings)
    summary = (f"{cells_ok}/{len(rows)} cells within tolerance (loads 10%, TTFT p50/p99 25%), "
               f"{pairs_ok}/{len(rankings)} pairwise rankings alike"
               + (f"; not simulated: {missing}" if missing else ""))
    return {"agrees": agrees, "summary": summary, "rows": rows, "rankings": rankings,
            "cells_ok": cells_ok, "cells": len(rows), "pairs_ok": pairs_ok, "pairs": len(rankings)}


def _rankings(live_rows: Sequence[Mapping], sim_by: Mapping[tuple, Mapping]) -> list[dict]:
    by_segment: dict[str, dict[str, Mapping]] = {}
    for r in live_rows:
        by_segment.setdefault(r["segment"], {})[r["variant"]] = r
    out = []
    for segment in sorted(by_segment):
        live = by_segment[segment]
        names = sorted(v for v in live if (segment, v) in sim_by)
        for metric in RANKED:
            for a, b in combinations(names, 2):
                lo = _sign(live[a][metric] - live[b][metric])
                so = _sign(sim_by[(segment, a)][metric] - sim_by[(segment, b)][metric])
                out.append({"segment": segment, "metric": metric, "pair": f"{a} vs {b}",
                            "live": _order(a, b, lo), "sim": _order(a, b, so), "same": lo == 0 or lo == so})
    return out


def _order(a: str, b: str, sign: int) -> str:
    return f"{a} < {b}" if sign < 0 else f"{b} < {a}" if sign > 0 else f"{a} = {b}"


# ---------------------------------------------------------------------------- the command line

QUANTILES = (10, 25, 50, 75, 90, 95, 99)


def ttft_quantiles(live_rows: Sequence[Mapping], sim_rows: Sequence[Mapping]) -> list[dict]:
    """Per cell, live and simulated TTFT quantiles (ms) from the rows' per-request ``ttft_s``: where in the
    distribution the two part (a constant offset, a tail, a mode), which p50 and p99 alone do not show."""
    sim_by = {(r["segment"], r["variant"]): r for r in sim_rows}
    out = []
    for lr in sorted(live_rows, key=lambda r: (r["segment"], r["variant"])):
        sr = sim_by.get((lr["segment"], lr["variant"]))
        live = [x for x in lr.get("ttft_s") or () if x is not None]
        sim = list((sr or {}).get("ttft_s") or ())
        if not live or not sim:
            continue
        row: dict = {"segment": lr["segment"], "variant": lr["variant"]}
        for q in QUANTILES:
            row[f"p{q}"] = f"{1000 * float(np.percentile(live, q)):.0f}/{1000 * float(np.percentile(sim, q)):.0f}"
        row["ks"] = round(_ks(live, sim), 3)
        out.append(row)
    return out


def _ks(a: Sequence[float], b: Sequence[float]) -> float:
    """The two samples' Kolmogorov-Smirnov distance (largest gap between their empirical CDFs)."""
    xa, xb = np.sort(np.asarray(a, dtype=float)), np.sort(np.asarray(b, dtype=float))
    grid = np.concatenate([xa, xb])
    return float(np.max(np.abs(np.searchsorted(xa, grid, side="right") / len(xa)
                               - np.searchsorted(xb, grid, side="right") / len(xb))))


def ensemble_rows(members: Sequence[Mapping]) -> list[dict]:
    """Per cell, over several replays' agreements: live loads, p50 and p99 against the replays' spread, and
    how many replays were within each tolerance."""
    out = []
    for k, row in enumerate(members[0]["rows"]):
        cells = [m["rows"][k] for m in members]
        entry: dict = {"segment": row["segment"], "variant": row["variant"]}
        for short in ("loads", "p50", "p99"):
            values = sorted(c[f"{short}_sim"] for c in cells)
            entry[short] = (f"{row[f'{short}_live']:.0f} | {values[0]:.0f} / {values[len(values) // 2]:.0f} / "
                            f"{values[-1]:.0f}")
            entry[f"{short}_ok"] = f"{sum(c[f'{short}_ok'] for c in cells)}/{len(cells)}"
        out.append(entry)
    return out


def ranking_votes(members: Sequence[Mapping]) -> list[dict]:
    """The rankings on which several replays disagree among themselves: each with how many replays had the
    live order. A pair the replays split on is decided by noise the live run does not fix, not by the model."""
    out = []
    for k, r in enumerate(members[0]["rankings"]):
        same = sum(m["rankings"][k]["same"] for m in members)
        if 0 < same < len(members):
            out.append({"segment": r["segment"], "metric": r["metric"], "pair": r["pair"],
                        "votes": f"{same}/{len(members)}"})
    return out


def live_repeatability(live_rows: Sequence[Mapping], other_rows: Sequence[Mapping]) -> dict:
    """``agreement_with_live`` with a second live run of the same settings in the simulator's place, over the
    variants both ran: how far two live runs part under the same tolerances. A fleet is chaotic (one request
    placed elsewhere changes every later queue) and a p99 over 240 requests is the third slowest one, so this is
    the closest any model can be expected to come to one run."""
    shared = {r["variant"] for r in live_rows} & {r["variant"] for r in other_rows}
    return agreement_with_live([dict(r) for r in live_rows if r["variant"] in shared],
                               [dict(r) for r in other_rows if r["variant"] in shared])


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Replay a ``fleet_live --json`` run in the simulator and print the agreement, cell by cell.

    Why a command of its own: the simulator's model is changed until it reproduces the live run,
    and each change needs the same table (a few seconds; ``cluster_sim --live-json`` runs much more)."""
    import argparse
    import json

    from .. import common
    from .fleet_replay import (live_deploys, live_host_costs, live_model_id_delays, live_replica_ids, live_starts,
                               replay_fleet_live)

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--live-json", required=True, help="a fleet_live --json run")
    parser.add_argument("--variants", nargs="+", help="replay only these (default: every variant the run has)")
    parser.add_argument("--quantiles", action="store_true", help="also print TTFT quantiles, live/sim, per cell")
    parser.add_argument("--json", metavar="PATH", help="write the simulated rows and the agreement here")
    parser.add_argument("--ensemble", type=int, default=0, metavar="N",
                        help="also N replays with each arrival up to --jitter-ms late and other router draws (on the "
                             "live run's replica ids when its rows name them all, else on random ones): how far each "
                             "cell moves under what the live run does not fix (it is one such draw)")
    parser.add_argument("--jitter-ms", type=float, default=10.0, help="the ensemble's send jitter (default 10)")
    parser.add_argument("--repeat-json", metavar="PATH",
                        help="another fleet_live --json run of the same settings: also print how well the two live "
                             "runs agree with each other under the same tolerances (the live run's own repeatability, "
                             "which no simulator can beat)")
    args = parser.parse_args(argv)
    live = json.loads(open(args.live_json).read())
    live_rows = [r for r in live["rows"] if not args.variants or r["variant"] in args.variants]
    variants = args.variants or sorted({r["variant"] for r in live_rows})
    cpus = (live["metadata"].get("machine") or {}).get("cpu_count")
    ids = live_replica_ids(live["rows"], live["metadata"]["settings"]["replicas"])
    delays = live_model_id_delays(live_rows)  # as fleet_live and cluster_sim replay it: the same agreement
    sim_rows = replay_fleet_live(live["metadata"]["settings"], variants, starts=live_starts(live_rows), cpu_count=cpus,
                                 host_costs=live_host_costs(live_rows), replica_ids=ids, model_id_delays=delays,
                                 deploys=live_deploys(live_rows))
    agreement = agreement_with_live(live_rows, sim_rows)
    common.print_table(agreement["rows"], floatfmt=".0f",
                       title=f"fleet_live replayed ({args.live_json}): live vs sim loads and TTFT ms, within 10% / 25%")
    for r in agreement["rankings"]:
        if not r["same"]:
            print(f"  disagrees: {r['segment']} {r['metric']}: live {r['live']}, sim {r['sim']}")
    if args.quantiles:
        print()
        common.print_table(ttft_quantiles(live_rows, sim_rows), title="TTFT quantiles, ms live/sim (ks: KS distance)")
    if args.ensemble > 0:
        members = [agreement_with_live(live_rows, replay_fleet_live(
            live["metadata"]["settings"], variants, starts=live_starts(live_rows), jitter_s=args.jitter_ms / 1000,
            seed=1 + k, cpu_count=cpus, host_costs=live_host_costs(live_rows), replica_ids=ids,
            model_id_delays=delays, deploys=live_deploys(live_rows)))
            for k in range(args.ensemble)]
        print()
        common.print_table(ensemble_rows(members), title=f"{args.ensemble} replays, arrivals up to {args.jitter_ms:g} ms "
                           "late, other router draws: live | the replays' min / median / max; ok: replays within "
                           "tolerance")
        shaky = ranking_votes(members)
        if shaky:
            print("  rankings the replays split on (replays with the live order): "
                  + "; ".join(f"{r['segment']} {r['metric']} {r['pair']} {r['votes']}" for r in shaky))
        print("  agreement of the replays: " + "; ".join(m["summary"].split(" (")[0] + f", {m['pairs_ok']}/{m['pairs']}"
                                                         for m in members))
    print(f"\n{agreement['summary']}")
    if args.repeat_json:
        repeat = json.loads(open(args.repeat_json).read())
        print(f"\nlive against live ({args.repeat_json} in the simulator's place): "
              f"{live_repeatability(live_rows, repeat['rows'])['summary']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sim_rows": sim_rows, "agreement": agreement}, f, indent=1)
    return agreement


if __name__ == "__main__":
    main()
