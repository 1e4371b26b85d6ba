"""Tests and benchmarks share only ``testkit/``: a product test imports nothing from ``benchmarks/``, and
``testkit`` imports neither side (so neither can come to lean on the other through it)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the tests of the benchmarks themselves (their simulator, traces, workloads, scripts): they import what they test
BENCHMARK_TESTS = {"test_benchmark_chaos.py", "test_benchmark_engine_throughput.py", "test_benchmark_lora_compute.py",
                   "test_benchmark_machine_speed.py",
                   "test_benchmark_model_id_lag.py", "test_benchmark_routing_live.py", "test_benchmarks_pool.py", "test_cluster_sim.py",
                   "test_fleet_bound.py", "test_fleet_emulation.py", "test_fleet_replay.py", "test_fleet_workload.py", "test_online_floor.py",
                   "test_gpu_check.py", "test_sim_scale.py", "test_sim_serve_cache.py", "test_sim_serve_routing.py",
                   "test_worker_replay.py"}


def imported_roots(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (absolute imports, at any depth of the file)."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_product_tests_import_nothing_from_benchmarks():
    offenders = [p.name for p in sorted((REPO / "tests").glob("*.py"))
                 if p.name not in BENCHMARK_TESTS and "benchmarks" in imported_roots(p)]
    assert offenders == [], f"move what they share with benchmarks/ to testkit/: {offenders}"


def test_the_benchmark_test_list_names_real_files():
    assert all((REPO / "tests" / name).is_file() for name in BENCHMARK_TESTS)


def test_testkit_imports_neither_tests_nor_benchmarks():
    helpers = {p.stem for p in (REPO / "tests").glob("*.py")}
    for path in sorted((REPO / "testkit").glob("*.py")):
        roots = imported_roots(path)
        assert not roots & ({"benchmarks", "tests", "conftest"} | helpers), f"{path.name} imports {roots}"
