"""The fewest adapter loads any online router can expect: the floor a loads goal must sit above.

Why: Belady's MIN (``sim.fleet_bound``) sees the future, so "affinity loads 2.9x the bound" mixes
two gaps: what routing loses, and what no policy that decides without the future can avoid. The
benchmarks draw each request's adapter independently from a known popularity (the independent
reference model). Under that model the best online replacement policy in expectation is A0 (Aho,
Denning and Ullman, 1971): keep the ``K - 1`` most probable adapters for good and let the last slot
take the others in turn (a request runs only from a slot, so the one it asks for must come in). So
for ``K`` = every slot of the fleet:

- ``expected``: A0's loads over as many requests in its steady state, ``n (q - sum p^2 / q)`` with
  ``q`` the probability outside the kept ``K - 1`` (the last slot holds the last of those asked for):
  no online router, with perfect knowledge of the popularity and no routing constraint, pays fewer
  loads on average;
- ``realized``: A0's loads on this trace's measured requests (the ``K`` most probable in the slots at
  the start): one draw, which an online policy can beat on a given trace only by luck.

A fleet pays more than the floor: the hottest adapters need copies on several replicas for their
rows (each copy is a slot fewer for distinct adapters), and a request that leaves a busy holder for
an idle replica loads there. The floor leaves both out, so it is a floor for every router here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class OnlineFloor:
    slots: int
    realized: int     # A0's loads on the measured requests of this trace
    expected: float   # A0's expected loads over as many requests: no online policy expects fewer


def online_floor(adapters: np.ndarray, probabilities: np.ndarray, slots: int, first_measured: int = 0) -> OnlineFloor:
    """A0's loads for a cache of ``slots`` entries on ``adapters[first_measured:]`` (adapter ids, drawn from
    ``probabilities``: id -> its probability), realized and expected (see the module docstring)."""
    probabilities = np.asarray(probabilities, dtype=np.float64)
    adapters = np.asarray(adapters)
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if probabilities.ndim != 1 or probabilities.size == 0 or np.any(probabilities < 0):
        raise ValueError("probabilities must be a non-empty vector of non-negative numbers (one per adapter id)")
    if adapters.size and (adapters.min() < 0 or adapters.max() >= probabilities.size):
        raise ValueError(f"adapter ids must lie in 0..{probabilities.size - 1}")
    if not 0 <= first_measured <= adapters.size:
        raise ValueError(f"first_measured must be within the trace (0..{adapters.size}), got {first_measured}")
    probabilities = probabilities / probabilities.sum()
    order = np.argsort(-probabilities, kind="stable")  # ties by id, as the popularity orders them
    kept = np.zeros(probabilities.size, dtype=bool)
    kept[order[:slots - 1]] = True
    last = int(order[slots - 1]) if slots <= order.size else None  # the turn slot, at the start
    realized = 0
    for a in adapters[first_measured:].tolist():
        if not kept[a] and a != last:
            realized += 1
            last = a
    q = float(probabilities[~kept].sum())
    per_request = q - float((probabilities[~kept] ** 2).sum()) / q if q > 0 else 0.0
    return OnlineFloor(slots, realized, (adapters.size - first_measured) * per_request)
