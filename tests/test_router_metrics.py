"""The router's metrics as a benchmark reads them in-process: the counts ``lorafleet_router_decisions_total``
exports, before and after an export, summed over this process's routers (no Ray cluster needed)."""

from __future__ import annotations

import gc
from collections import Counter

from routing.router_metrics import RouterMetrics, decision_counts


def test_counts_are_what_the_metric_counts_exported_or_not():
    metrics = RouterMetrics()
    for kind in ("affinity", "wait", "affinity"):
        metrics.decision(kind)
    assert metrics.counts() == {"affinity": 2, "wait": 1}
    metrics.export()  # sent to the metric: still counted, not twice
    metrics.decision("spill")
    assert metrics.counts() == {"affinity": 2, "wait": 1, "spill": 1}
    metrics.export()
    assert metrics.counts() == {"affinity": 2, "wait": 1, "spill": 1}


def test_decision_counts_sum_this_process_routers_and_forget_a_gone_one():
    before = Counter(decision_counts())
    first, second = RouterMetrics(), RouterMetrics()
    first.decision("affinity")
    second.decision("affinity")
    second.decision("placement")
    second.export()
    assert Counter(decision_counts()) - before == Counter({"affinity": 2, "placement": 1})
    del second
    gc.collect()
    assert Counter(decision_counts()) - before == Counter({"affinity": 1})
