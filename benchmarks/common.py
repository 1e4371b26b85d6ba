"""Shared plumbing for ``python -m benchmarks.NAME [--quick] [--json PATH]``.

Every benchmark prints a plain-text table and can write the same rows as JSON with a
metadata block (settings, machine, timestamp), so results from different machines and
runs can be compared without re-reading the code that made them. Each goal a benchmark
checks is one ``goal(...)`` record: ``print_goals`` shows it and ``write_json`` stores the
same list under a top-level ``"goals"`` key, so the JSON and the printout never disagree.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy

Row = dict[str, Any]
Goal = dict[str, Any]

GOAL_KEYS = ("name", "measured", "target", "pass")


def base_parser(description: str, *, plot: bool = False) -> argparse.ArgumentParser:
    """The flags every benchmark shares; add benchmark-specific ones to the result."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small settings: 1-3 minutes on 2 cores (the live fleet benchmarks take longer)")
    parser.add_argument("--json", metavar="PATH", help="also write the table and metadata as JSON here")
    parser.add_argument("--seed", type=int, default=0, help="seed for every random draw (default 0)")
    if plot:
        parser.add_argument(
            "--plot", metavar="PATH",
            help="write the PNG here (default: the --json path with .png; no plot without either)",
        )
    return parser


def add_routing_flag(parser: argparse.ArgumentParser) -> None:
    """``--routing NAME=VALUE ...``: routing settings for the product's router and plan, as ``serve_config.yaml``'s
    ``args.routing`` sets them (so a setting can be tried live before it becomes a default)."""
    parser.add_argument("--routing", nargs="+", default=[], metavar="NAME=VALUE",
                        help="routing settings (docs/routing_settings.md), e.g. spill_margin=0.5")


def routing_overrides(pairs: Any) -> dict[str, float]:
    """``--routing``'s pairs (or a mapping, as a run's JSON metadata stores them) as settings; unknown names and
    values out of range are refused here, naming them (``RoutingSettings.from_mapping``)."""
    from routing.settings import RoutingSettings

    if isinstance(pairs, Mapping):
        values = dict(pairs)
    else:
        values = {}
        for pair in pairs or ():
            name, sep, raw = str(pair).partition("=")
            if not sep:
                raise ValueError(f"--routing takes NAME=VALUE, got {pair!r}")
            values[name.strip()] = int(raw) if raw.strip().lstrip("-").isdigit() else float(raw)
    return RoutingSettings.from_mapping(values).changed()


def plot_path(args: argparse.Namespace) -> Optional[Path]:
    """Where the PNG goes: ``--plot`` if given, else beside ``--json``, else nowhere."""
    if getattr(args, "plot", None):
        return Path(args.plot)
    if args.json:
        return Path(args.json).with_suffix(".png")
    return None


def _fmt(value: Any, floatfmt: str) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return format(value, floatfmt)
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Optional[Sequence[str]] = None,
                 floatfmt: str = ".4g") -> str:
    """Right-aligned plain-text table; ``columns`` picks and orders keys (default: first row's)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_fmt(row.get(c), floatfmt) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Optional[Sequence[str]] = None, *,
                title: Optional[str] = None, floatfmt: str = ".4g") -> None:
    if title:
        print(title)
    print(format_table(rows, columns, floatfmt))
    sys.stdout.flush()


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU count, library versions, the accelerator if any."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    if hasattr(os, "getloadavg"):  # other work on the machine skews timings; record it
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    info["numpy"] = numpy.__version__
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name()
            info["cuda_version"] = torch.version.cuda
    except ImportError:  # pragma: no cover - torch is a project dependency
        pass
    return info


def _jsonable(value: Any) -> Any:
    """numpy scalars, paths and tuples into plain JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return _jsonable(value.item())
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def goal(name: str, measured: Any, target: Any, passed: Optional[bool]) -> Goal:
    """One checked goal: what was measured, what it is held against (e.g. ``">= 0.8"``), the verdict.

    ``passed`` is ``None`` only when the run cannot judge the goal (e.g. neither side
    loaded anything); a missed goal is ``False`` and keeps its measured number.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a goal needs a non-empty name, got {name!r}")
    if passed is not None and not isinstance(passed, (bool, numpy.bool_)):
        raise ValueError(f"goal {name!r}: passed must be True, False or None, got {passed!r}")
    return {"name": name, "measured": measured, "target": target, "pass": None if passed is None else bool(passed)}


def verdict(passed: Optional[bool]) -> str:
    return "N/A" if passed is None else ("PASS" if passed else "FAIL")


def _shown(value: Any) -> str:
    return format(value, ".4g") if isinstance(value, float) else str(value)


def goal_lines(goals: Sequence[Goal]) -> list[str]:
    """``PASS  name  measured (target)`` per goal, names aligned."""
    width = max((len(g["name"]) for g in goals), default=0)
    return [f"{verdict(g['pass']):4s}  {g['name']:{width}s}  {_shown(g['measured'])} (goal {g['target']})"
            for g in goals]


def print_goals(goals: Sequence[Goal]) -> None:
    print("goals:")
    for line in goal_lines(goals):
        print(f"  {line}")
    sys.stdout.flush()


def write_json(path: str | os.PathLike, benchmark: str, rows: Sequence[Mapping[str, Any]],
               settings: Mapping[str, Any], extra: Optional[Mapping[str, Any]] = None, *,
               goals: Sequence[Goal]) -> Path:
    """``{"metadata": {benchmark, settings, machine, timestamp, ...extra}, "rows": [...], "goals": [...]}``.

    ``goals`` is required (pass ``[]`` for a benchmark with none): each is a ``goal(...)``
    record, the same list the benchmark printed.
    """
    for g in goals:
        if not isinstance(g, Mapping) or tuple(g) != GOAL_KEYS:
            raise ValueError(f"goals must be goal(...) records with keys {GOAL_KEYS}, got {g!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "benchmark": benchmark,
        "settings": dict(settings),
        "machine": machine_info(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **(extra or {}),
    }
    payload = {"metadata": metadata, "rows": list(rows), "goals": list(goals)}
    path.write_text(json.dumps(_jsonable(payload), indent=2) + "\n")
    return path


def settings_of(args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    """The parsed flags plus derived settings, for the JSON metadata."""
    return {**vars(args), **more}


def time_repeats(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1,
                 sync: Callable[[], None] = lambda: None,
                 before: Callable[[], Any] = lambda: None) -> list[float]:
    """Wall seconds of ``fn()`` per repeat, after ``warmup`` untimed calls.

    ``sync`` runs before starting and before stopping each timer (pass a CUDA synchronize
    so queued kernels are counted); ``before`` runs untimed ahead of every call (e.g. to
    free the slot the next call loads into).
    """
    for _ in range(warmup):
        before()
        fn()
    sync()
    times = []
    for _ in range(repeats):
        before()
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return times


def time_alternating(fns: Mapping[str, Callable[[], Any]], *, repeats: int = 5, warmup: int = 1,
                     sync: Callable[[], None] = lambda: None,
                     before: Optional[Mapping[str, Callable[[], Any]]] = None) -> dict[str, list[float]]:
    """Like ``time_repeats`` for several functions, taking turns each repeat.

    Taking turns exposes every function to the same drift (other processes, clock
    changes, thermal state), so ratios between them are fairer than from separate loops.
    """
    before = before or {}
    noop: Callable[[], Any] = lambda: None
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            before.get(name, noop)()
            sync()
            started = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - started)
    return times


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def elapsed_since(started: float) -> str:
    return f"{time.perf_counter() - started:.1f} s"
