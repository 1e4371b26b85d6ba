"""Modelled costs of one replica: adapter loads, prefill and decode.

Adapter load seconds are hard-coded from ``python -m benchmarks.swap`` (full run on this
project's CPU machine, Llama-3-8B shapes, 32 layers, all seven target modules, bf16,
through the real ``LoRAMemoryPool``; median of 41 host / 7 disk loads):

    rank   MB      host tier (memcpy)   disk (PEFT folder, page cache warm)
      8    41.9    2.62 ms              52.5 ms
     16    83.9    4.79 ms              87.6 ms
     64   335.5   18.96 ms             492.3 ms

Rank 32 (not measured) is interpolated linearly in bytes between 16 and 64. A host-tier
load on a GPU is a pinned host-to-device copy of the same bytes (PCIe 4/5 x16 moves
them at the same order of speed as this CPU memcpy, ~17 GB/s), so the same numbers
serve for both.

Compute is modelled, not measured: a Llama-3-8B-class model on one datacenter GPU, with
prefill at ``prefill_s_per_token`` per prompt token and memory-bound decode at
``decode_s_per_token`` per generated token (one step per token, the same for every batch
size up to ``max_batch``).

What a load costs, as the engine pays it (``deployments/worker.py`` and ``engine/engine.py``):

- a **disk read** (``disk_read_s``: the file read into the host tier) happens off the engine
  thread before the request is submitted: the requester waits for it, the batch does not;
- a **host-to-slot copy** (``host_copy_s``) happens at a step boundary on the engine thread:
  every running request waits for it;
- a step costs ``step_s(prefill_tokens)``: one decode step for every running row plus the
  prompt tokens it prefills, at most ``token_budget`` tokens a step (chunked prefill).

``benchmarks.fleet_live``'s emulated engine sleeps these times and the simulator charges them,
so both run one model (``scaled`` multiplies every time by one factor, for slower machines).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# rank -> (host-tier seconds, disk seconds), from benchmarks.swap as above
MEASURED_LOAD_SECONDS: dict[int, tuple[float, float]] = {
    8: (0.002623, 0.052489),
    16: (0.004787, 0.087637),
    64: (0.018962, 0.492255),
}
MB_PER_RANK = 41.94304 / 8  # Llama-3-8B, 7 modules, 32 layers, bf16: MB per unit of rank


def _interpolated(rank: int) -> tuple[float, float]:
    if rank in MEASURED_LOAD_SECONDS:
        return MEASURED_LOAD_SECONDS[rank]
    ranks = sorted(MEASURED_LOAD_SECONDS)
    lo = max([r for r in ranks if r <= rank], default=ranks[0])
    hi = min([r for r in ranks if r >= rank], default=ranks[-1])
    if lo == hi:
        scale = rank / lo
        return tuple(v * scale for v in MEASURED_LOAD_SECONDS[lo])  # type: ignore[return-value]
    f = (rank - lo) / (hi - lo)
    a, b = MEASURED_LOAD_SECONDS[lo], MEASURED_LOAD_SECONDS[hi]
    return (a[0] + f * (b[0] - a[0]), a[1] + f * (b[1] - a[1]))


@dataclass(frozen=True)
class CostModel:
    prefill_s_per_token: float = 1e-4   # 10k prompt tokens/s
    decode_s_per_token: float = 0.025   # one decode step (memory-bound, batch <= max_batch)
    host_cache_bytes: float = 8e9       # host tier per replica (LRU by bytes, like pool.host_cache)
    load_table: dict = field(default_factory=lambda: {r: _interpolated(r) for r in (8, 16, 32, 64)})
    token_budget: int = 8192            # tokens one step computes at most (prefill chunk + decode rows)
    step_host_s: float = 0.0            # host work per step beyond the device's time (simulator only)

    def host_copy_s(self, rank: int) -> float:
        """A host-tier copy into a slot: stalls the step it happens in."""
        return self.load_seconds(rank, True)

    def disk_read_s(self, rank: int) -> float:
        """A read from disk into the host tier (the measured disk load less its slot copy): off the step."""
        return max(0.0, self.load_seconds(rank, False) - self.load_seconds(rank, True))

    def step_s(self, prefill_tokens: int) -> float:
        """One engine step: a decode token for every running row, plus ``prefill_tokens`` prompt tokens."""
        return self.decode_s_per_token + prefill_tokens * self.prefill_s_per_token

    def step_wall_s(self, prefill_tokens: int) -> float:
        """A step as a replica lives it: the device's time plus the host's work around it (scheduling, KV
        blocks, sampling). The emulated engine sleeps only ``step_s`` and does that host work for real;
        the simulator charges both (``step_host_s``, measured per step by ``benchmarks.fleet_live``)."""
        return self.step_s(prefill_tokens) + self.step_host_s

    def scaled(self, factor: float) -> "CostModel":
        """Every time multiplied by ``factor`` (a slower device; bytes and budgets unchanged)."""
        if factor <= 0:
            raise ValueError(f"time scale must be > 0, got {factor}")
        return replace(self, prefill_s_per_token=self.prefill_s_per_token * factor,
                       decode_s_per_token=self.decode_s_per_token * factor,
                       load_table={r: (h * factor, d * factor) for r, (h, d) in self.load_table.items()})

    def load_seconds(self, rank: int, from_host: bool) -> float:
        host, disk = self.load_table[rank] if rank in self.load_table else _interpolated(rank)
        return host if from_host else disk

    @staticmethod
    def adapter_bytes(rank: int) -> float:
        return rank * MB_PER_RANK * 1e6

    def service_seconds(self, input_len: float, output_len: float) -> float:
        """A request's own compute time (no loads, no other requests' stalls)."""
        return input_len * self.prefill_s_per_token + output_len * self.decode_s_per_token

    def describe(self) -> dict:
        return {
            "prefill_s_per_token": self.prefill_s_per_token,
            "decode_s_per_token": self.decode_s_per_token,
            "host_cache_bytes": self.host_cache_bytes,
            "token_budget": self.token_budget,
            "step_host_s": self.step_host_s,
            "load_seconds_host_disk_by_rank": {str(r): list(v) for r, v in self.load_table.items()},
            "source": "benchmarks.swap full run (CPU, Llama-3-8B shapes, bf16); rank 32 interpolated",
        }
