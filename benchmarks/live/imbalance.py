"""How unevenly a closed-loop run's outstanding requests sat on its replicas over time.

Why: at concurrency 64 on two replicas that hold disjoint adapters (the demo: six adapters in
2 x 3 slots, each planned on one replica), every completion starts a request whose adapter is
drawn afresh, so the split of the 64 outstanding requests between the replicas is a random walk
with no restoring force while both are saturated. Measured live (600 requests, one and three
routers): it drifted to 60 / 4 within 3 s, and the slowest requests were the ones queued for the
busy replica while the other had idle rows. A router that never loads cannot move that work;
this measure makes the drift visible beside the latency quantiles it explains.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def busiest_share(sent_at: Sequence[float], latencies: Sequence[float], replicas: Sequence[Optional[str]],
                  quantile: float = 90.0) -> float:
    """The ``quantile`` (over send instants) of the busiest replica's share of the requests outstanding then.

    ``sent_at``: each request's send time (one clock for all clients); ``latencies``: seconds to its
    result; ``replicas``: the replica that served it (None: failed, left out). Balanced over two
    replicas this is near 0.5; 1.0 means every outstanding request sat on one replica. NaN without
    a served request."""
    served = [(float(s), float(s) + float(lat), r) for s, lat, r in zip(sent_at, latencies, replicas)
              if r is not None]
    if not served:
        return float("nan")
    names = sorted({r for _, _, r in served})
    index = {name: k for k, name in enumerate(names)}
    starts = np.array([s for s, _, _ in served])
    ends = np.array([e for _, e, _ in served])
    which = np.array([index[r] for _, _, r in served])
    shares = []
    for t in np.sort(starts):
        out = (starts <= t) & (ends > t)
        counts = np.bincount(which[out], minlength=len(names))
        total = counts.sum()
        if total:
            shares.append(counts.max() / total)
    return float(np.percentile(shares, quantile)) if shares else float("nan")
