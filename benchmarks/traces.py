"""Synthetic multi-LoRA workloads, shared by the benchmarks and the cluster simulator.

Modelled on S-LoRA's ``benchmarks/trace.py``: each request's adapter is drawn from a
power law (``power(alpha)`` mapped onto adapter ids; smaller alpha is more skewed, alpha 1
is uniform) or from a bounded Zipf(s) (probability of the k-th most popular adapter
proportional to 1/k^s; larger s is more skewed); inter-arrival times are gamma with a
given rate and coefficient of variation (CV 1 is Poisson, larger is burstier); adapters
have mixed ranks from {8, 16, 32, 64}.

Everything takes a seed and is deterministic. Each ingredient (adapter ids, arrival
times, ranks, lengths) draws from its own child of one ``SeedSequence``, so changing the
arrival CV does not change which adapters are requested.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

RANK_CHOICES = (8, 16, 32, 64)
FAMILIES = ("power", "zipf")

_STREAMS = ("adapters", "arrivals", "ranks", "lengths")


def rngs(seed: int) -> dict[str, np.random.Generator]:
    """One independent generator per trace ingredient, all derived from ``seed``."""
    children = np.random.SeedSequence(seed).spawn(len(_STREAMS))
    return {name: np.random.default_rng(child) for name, child in zip(_STREAMS, children)}


@dataclass(frozen=True)
class Popularity:
    """Which adapter a request uses: ``power`` (S-LoRA's alpha) or bounded ``zipf`` (s)."""

    family: str
    param: float

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown popularity family {self.family!r}; choose one of {FAMILIES}")
        if self.param <= 0 and self.family == "power":
            raise ValueError(f"power-law alpha must be > 0, got {self.param}")
        if self.param < 0:
            raise ValueError(f"Zipf exponent s must be >= 0, got {self.param}")

    @property
    def label(self) -> str:
        return f"{'alpha' if self.family == 'power' else 's'}={self.param:g}"

    def probabilities(self, num_adapters: int) -> np.ndarray:
        """Exact probability of each adapter id (id 0 is the most popular)."""
        if self.family == "zipf":
            return zipf_probabilities(num_adapters, self.param)
        return power_probabilities(num_adapters, self.param)

    def sample(self, n: int, num_adapters: int, rng: np.random.Generator) -> np.ndarray:
        if self.family == "zipf":
            return zipf_adapters(n, num_adapters, self.param, rng)
        return power_adapters(n, num_adapters, self.param, rng)


def power_adapters(n: int, num_adapters: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """S-LoRA's draw: ``floor(power(alpha) * N)``; alpha < 1 piles requests on low ids."""
    ids = (rng.power(alpha, n) * num_adapters).astype(np.int64)
    return np.minimum(ids, num_adapters - 1)  # power() can return exactly 1.0


def power_probabilities(num_adapters: int, alpha: float) -> np.ndarray:
    """P(id = k) = ((k+1)/N)^alpha - (k/N)^alpha: the CDF of power(alpha) is x^alpha."""
    edges = (np.arange(num_adapters + 1) / num_adapters) ** alpha
    return np.diff(edges)


def zipf_probabilities(num_adapters: int, s: float) -> np.ndarray:
    """Bounded Zipf: P(id = k) proportional to 1 / (k+1)^s over N adapters."""
    weights = 1.0 / np.arange(1, num_adapters + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def zipf_adapters(n: int, num_adapters: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """Inverse-CDF sampling of bounded Zipf (numpy's ``zipf`` is unbounded and needs s > 1)."""
    cdf = np.cumsum(zipf_probabilities(num_adapters, s))
    ids = np.searchsorted(cdf, rng.random(n), side="right")
    return np.minimum(ids, num_adapters - 1).astype(np.int64)


def gamma_arrivals(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (seconds from 0) with gamma gaps of mean 1/rate and the given CV."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0, got rate={rate}, cv={cv}")
    shape = 1.0 / (cv * cv)
    scale = cv * cv / rate
    return np.cumsum(rng.gamma(shape, scale, n))


def adapter_ranks(num_adapters: int, rng: np.random.Generator, choices: Sequence[int] = RANK_CHOICES,
                  weights: Optional[Sequence[float]] = None) -> np.ndarray:
    """A rank per adapter, drawn from ``choices`` (uniformly unless ``weights`` is given)."""
    p = None if weights is None else np.asarray(weights, dtype=np.float64) / np.sum(weights)
    return rng.choice(np.asarray(choices, dtype=np.int64), size=num_adapters, p=p)


def request_lengths(n: int, rng: np.random.Generator, input_range: tuple[int, int] = (8, 512),
                    output_range: tuple[int, int] = (8, 512)) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output token counts, uniform in ``[low, high)`` like S-LoRA's synthetic mode."""
    return (rng.integers(input_range[0], input_range[1], n), rng.integers(output_range[0], output_range[1], n))


def adapter_uid(adapter_id: int) -> str:
    """The uid string the pool and router see for adapter id ``adapter_id``."""
    return f"adapter-{adapter_id:05d}"


@dataclass(frozen=True)
class Trace:
    """A request stream: who asks for which adapter, when, and how long the text is."""

    adapters: np.ndarray  # [n] adapter id per request
    arrivals: np.ndarray  # [n] seconds since the start, non-decreasing
    input_lens: np.ndarray  # [n] prompt tokens
    output_lens: np.ndarray  # [n] generated tokens
    ranks: np.ndarray  # [num_adapters] LoRA rank of each adapter id
    num_adapters: int
    popularity: Popularity
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.adapters.shape[0])

    def uids(self) -> list[str]:
        """Adapter uid per request, as the pool would be asked for them."""
        return [adapter_uid(i) for i in self.adapters.tolist()]


def make_trace(n_requests: int, num_adapters: int, popularity: Popularity, *, rate: float = 10.0,
               cv: float = 1.0, seed: int = 0, rank_choices: Sequence[int] = RANK_CHOICES,
               input_range: tuple[int, int] = (8, 512), output_range: tuple[int, int] = (8, 512)) -> Trace:
    """A full synthetic trace; the same arguments always give the same trace."""
    if n_requests < 0 or num_adapters < 1:
        raise ValueError(f"need n_requests >= 0 and num_adapters >= 1, got {n_requests}, {num_adapters}")
    g = rngs(seed)
    inputs, outputs = request_lengths(n_requests, g["lengths"], input_range, output_range)
    return Trace(
        adapters=popularity.sample(n_requests, num_adapters, g["adapters"]),
        arrivals=gamma_arrivals(n_requests, rate, cv, g["arrivals"]),
        input_lens=inputs,
        output_lens=outputs,
        ranks=adapter_ranks(num_adapters, g["ranks"], rank_choices),
        num_adapters=num_adapters,
        popularity=popularity,
        meta={"rate": rate, "cv": cv, "seed": seed, "family": popularity.family, "param": popularity.param},
    )


def adapter_sequence(n_requests: int, num_adapters: int, popularity: Popularity, seed: int = 0) -> np.ndarray:
    """Only the adapter ids of ``make_trace(...)`` with the same seed (cheaper, same ids)."""
    return popularity.sample(n_requests, num_adapters, rngs(seed)["adapters"])


def top_share(adapters: np.ndarray, num_adapters: int, fraction: float = 0.1) -> float:
    """Share of requests that go to the most-requested ``fraction`` of adapters (a skew measure)."""
    counts = np.sort(np.bincount(adapters, minlength=num_adapters))[::-1]
    k = max(1, int(round(fraction * num_adapters)))
    return float(counts[:k].sum() / max(1, counts.sum()))


def standard_popularities() -> list[Popularity]:
    """The settings docs/design.md names: S-LoRA alpha in {0.1, 0.3, 0.6, 1.0}, Zipf s in {0.8, 1.0, 1.2}."""
    return [Popularity("power", a) for a in (0.1, 0.3, 0.6, 1.0)] + [Popularity("zipf", s) for s in (0.8, 1.0, 1.2)]


# ---------------------------------------------------------------------------- time-varying load


def profile_arrivals(duration_s: float, rate_at: Callable[[np.ndarray], np.ndarray], cv: float,
                     rng: np.random.Generator, grid_s: float = 1.0) -> np.ndarray:
    """Arrivals in ``[0, duration_s)`` whose rate follows ``rate_at(t)`` (vectorised, >= 0).

    Time rescaling: a renewal process of unit rate with gamma gaps (this CV) is mapped
    through the inverse of the cumulative rate, integrated on a ``grid_s`` grid (the rate
    is held constant within each cell); CV 1 gives an inhomogeneous Poisson process.
    """
    if duration_s <= 0 or cv <= 0 or grid_s <= 0:
        raise ValueError(f"duration_s, cv and grid_s must be > 0, got {duration_s}, {cv}, {grid_s}")
    edges = np.arange(0.0, duration_s + grid_s, grid_s)
    edges[-1] = duration_s
    rates = np.asarray(rate_at(edges[:-1]), dtype=np.float64)
    if rates.shape != edges[:-1].shape or (rates < 0).any() or not np.isfinite(rates).all():
        raise ValueError("rate_at must return one finite rate >= 0 per time given")
    cumulative = np.concatenate([[0.0], np.cumsum(rates * np.diff(edges))])
    total = cumulative[-1]
    shape, scale = 1.0 / (cv * cv), cv * cv
    units = np.cumsum(rng.gamma(shape, scale, int(total * 1.1) + 64))
    while units.size and units[-1] < total:
        units = np.concatenate([units, units[-1] + np.cumsum(rng.gamma(shape, scale, int(total * 0.1) + 64))])
    units = units[units < total]
    return np.interp(units, cumulative, edges)


@dataclass(frozen=True)
class Diurnal:
    """A compressed day with bursts: the rate swings between ``trough`` and ``peak`` requests/s
    over ``day_s`` (lowest at 0), and bursts (Poisson, one per ``burst_gap_s`` on average, each
    ``burst_s`` long) add ``burst_factor`` x the current rate of requests for ``burst_adapters``
    adapters drawn from the whole population (a tenant's batch job, mostly cold adapters)."""

    trough: float
    peak: float
    day_s: float
    burst_gap_s: float
    burst_s: float
    burst_factor: float
    burst_adapters: int

    def base_rate(self, t: np.ndarray) -> np.ndarray:
        return self.trough + (self.peak - self.trough) * (1.0 - np.cos(2.0 * np.pi * t / self.day_s)) / 2.0


def make_diurnal_trace(days: float, num_adapters: int, popularity: Popularity, shape: Diurnal, *,
                       cv: float = 1.0, seed: int = 0, rank_choices: Sequence[int] = RANK_CHOICES) -> Trace:
    """``days`` of ``shape``: the steady stream draws adapters from ``popularity``, each burst from
    its own few adapters; ``meta["bursts"]`` lists the bursts' (start, end) seconds."""
    if num_adapters < 1 or days <= 0 or shape.burst_adapters < 1:
        raise ValueError(f"need num_adapters >= 1, days > 0, burst_adapters >= 1; got {num_adapters}, {days}, "
                         f"{shape.burst_adapters}")
    g = rngs(seed)
    duration = days * shape.day_s
    starts = np.cumsum(g["arrivals"].exponential(shape.burst_gap_s, int(duration / shape.burst_gap_s * 2) + 4))
    starts = starts[starts < duration - shape.burst_s]
    steady = profile_arrivals(duration, shape.base_rate, cv, g["arrivals"])
    adapters = [popularity.sample(steady.size, num_adapters, g["adapters"])]
    times = [steady]
    for start in starts.tolist():
        burst = start + profile_arrivals(shape.burst_s, lambda t, s=start: shape.burst_factor * shape.base_rate(t + s),
                                         cv, g["arrivals"])
        own = g["adapters"].choice(num_adapters, shape.burst_adapters, replace=False)
        adapters.append(own[g["adapters"].integers(0, shape.burst_adapters, burst.size)])
        times.append(burst)
    arrivals = np.concatenate(times)
    order = np.argsort(arrivals, kind="stable")
    inputs, outputs = request_lengths(arrivals.size, g["lengths"])
    return Trace(adapters=np.concatenate(adapters)[order].astype(np.int64), arrivals=arrivals[order],
                 input_lens=inputs, output_lens=outputs, ranks=adapter_ranks(num_adapters, g["ranks"], rank_choices),
                 num_adapters=num_adapters, popularity=popularity,
                 meta={"shape": shape.__dict__, "days": days, "cv": cv, "seed": seed,
                       "bursts": [(s, s + shape.burst_s) for s in starts.tolist()]})


def make_profile_trace(duration_s: float, num_adapters: int, popularity: Popularity,
                       rate_at: Callable[[np.ndarray], np.ndarray], *, cv: float = 1.0, seed: int = 0,
                       rank_choices: Sequence[int] = RANK_CHOICES) -> Trace:
    """Like ``make_trace`` but over ``duration_s`` seconds at the time-varying rate ``rate_at``."""
    g = rngs(seed)
    arrivals = profile_arrivals(duration_s, rate_at, cv, g["arrivals"])
    inputs, outputs = request_lengths(arrivals.size, g["lengths"])
    return Trace(adapters=popularity.sample(arrivals.size, num_adapters, g["adapters"]), arrivals=arrivals,
                 input_lens=inputs, output_lens=outputs, ranks=adapter_ranks(num_adapters, g["ranks"], rank_choices),
                 num_adapters=num_adapters, popularity=popularity,
                 meta={"duration_s": duration_s, "cv": cv, "seed": seed, "family": popularity.family,
                       "param": popularity.param})
