"""The application's Prometheus metrics, read from the code that defines them (never a list kept by hand).

Every ``Gauge``/``Counter``/``Histogram`` of ``ray.serve.metrics`` or ``ray.util.metrics``
constructed with a literal ``lorafleet_*`` name in the product packages, found by parsing
the source: a metric added to the code is a metric the dashboard and the docs must show.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("pool", "engine", "routing", "deployments")
METRIC_MODULES = ("ray.serve.metrics", "ray.util.metrics")
KINDS = ("Gauge", "Counter", "Histogram")
RAY_PREFIX = "ray_"  # Ray's metrics agent exports each user metric as ray_<name>


def _metric_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> metric kind, for every ``from ray...metrics import Kind [as alias]`` in a module."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in METRIC_MODULES:
            for name in node.names:
                if name.name in KINDS:
                    aliases[name.asname or name.name] = name.name
    return aliases


@cache
def defined_metrics() -> dict[str, str]:
    """Metric name (as the code names it, without Ray's prefix) -> ``Gauge`` | ``Counter`` | ``Histogram``."""
    found: dict[str, str] = {}
    for package in PRODUCT_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            aliases = _metric_aliases(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in aliases):
                    continue
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    assert first.value.startswith("lorafleet_"), f"{path}: metric {first.value!r} lacks the prefix"
                    found[first.value] = aliases[node.func.id]
    return found


def of_kind(*kinds: str) -> list[str]:
    return sorted(name for name, kind in defined_metrics().items() if kind in kinds)


def prometheus_series() -> set[str]:
    """Every series name Prometheus sees: counters and gauges as named, a histogram's three series."""
    return ({RAY_PREFIX + n for n in of_kind("Gauge", "Counter")}
            | {RAY_PREFIX + n + s for n in of_kind("Histogram") for s in ("_bucket", "_sum", "_count")})
