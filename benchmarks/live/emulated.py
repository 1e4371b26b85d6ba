"""Benchmark-only: a replica whose engine is real except the model forward, which takes the cost model's time.

Why: ``benchmarks.fleet_live`` runs 16 replicas of a GPU fleet on a 2-core machine. Every
part of the serving path stays the product's own -- the worker, its ``LoRAEngine`` (scheduler,
chunked prefill under the token budget, KV blocks), the ``LoRAMemoryPool``, adapter staging
and the host tier, Serve, the directory, the plan and the router -- and only what a GPU
would do is replaced by a sleep of ``benchmarks.sim.costs.CostModel``'s time:

- the forward: ``step_s(prefill tokens)`` per step, returning logits that pick one fixed token
  (requests ask ``ignore_eos``, so lengths are the trace's);
- a host-tier copy into a slot (the pool's weight fetch, on the engine thread at a step
  boundary): ``host_copy_s(rank)``, so the step stalls as a GPU's would;
- a read from disk into the host tier (registration, or a re-read after host-tier eviction,
  off the engine thread): topped up to ``disk_read_s(rank)``, so the requester waits.

``rank`` is the modelled rank of each adapter name (the trace's ranks 8-64); the files on
disk are the demo's small adapters. The simulator charges the same times, so the two can
be compared request for request.
"""

from __future__ import annotations

import time
from typing import Mapping, Optional

import torch

from ..sim.costs import CostModel


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class EmulatedCosts:
    """Installs the emulation on one engine; ``ranks`` maps adapter names to modelled ranks."""

    def __init__(self, engine, costs: CostModel, ranks: Mapping[str, int], default_rank: int = 16):
        self.engine, self.costs, self.ranks, self.default_rank = engine, costs, dict(ranks), default_rank
        self.steps = 0
        self.step_seconds = 0.0
        self.copy_seconds = 0.0
        self.disk_seconds = 0.0
        self.step_wall_seconds = 0.0  # wall time of the steps that ran a forward, host work included
        self.step_host_seconds = 0.0  # of which neither the forward's nor a copy's sleep: the step's CPU work
        vocab = engine.model.config.vocab_size
        eos = set(getattr(engine, "eos_ids", ()) or ())
        self.token = next(t for t in range(vocab - 1, -1, -1) if t not in eos)  # a plain token, never EOS
        self._logits = torch.zeros(1, vocab, device=engine.device)
        self._logits[0, self.token] = 1.0
        engine.runner.forward = self.forward
        pool, store = engine.pool, engine.store
        fetch_weights, register, fetch = pool._fetch_weights, store.register, store.fetch

        def copied(uid: str):
            started = time.perf_counter()
            weights = fetch_weights(uid)
            cost = self.costs.host_copy_s(self.rank_of_uid(uid))
            _sleep_until(started + cost)
            self.copy_seconds += cost
            return weights

        def registered(uid: str, source: str, *, name: Optional[str] = None, revision: Optional[str] = None):
            started = time.perf_counter()
            record = register(uid, source, name=name, revision=revision)
            self._read(started, record.name)
            return record

        def fetched(uid: str):
            if uid in store.host_cache:
                return fetch(uid)
            started = time.perf_counter()
            weights = fetch(uid)
            self._read(started, store.record(uid).name)
            return weights

        pool._fetch_weights = copied
        store.register = registered
        store.fetch = fetched
        step = engine._step

        def timed_step() -> None:
            """The step as the engine runs it, timed: what it took beyond the sleeps is host work (scheduling,
            KV blocks, sampling, the pool) that a GPU replica pays too, and that the simulator must charge."""
            steps, charged, started = self.steps, self.step_seconds + self.copy_seconds, time.perf_counter()
            step()
            if self.steps > steps:  # a forward ran (a step with nothing running costs nobody anything)
                wall = time.perf_counter() - started
                self.step_wall_seconds += wall
                self.step_host_seconds += max(0.0, wall - (self.step_seconds + self.copy_seconds - charged))

        engine._step = timed_step

    def rank_of(self, name: Optional[str]) -> int:
        return self.ranks.get(name, self.default_rank) if name is not None else 0

    def rank_of_uid(self, uid: str) -> int:
        return self.rank_of(self.engine.store.record(uid).name)

    def _read(self, started: float, name: str) -> None:
        cost = self.costs.disk_read_s(self.rank_of(name))
        _sleep_until(started + cost)
        self.disk_seconds += cost

    def forward(self, seqs, all_logits: bool = False) -> torch.Tensor:
        """The step's time (one decode token per row plus its prompt tokens), then logits for each row."""
        started = time.perf_counter()
        prefill = sum(len(s.token_ids) for s in seqs if len(s.token_ids) > 1 or s.start_pos == 0)
        cost = self.costs.step_s(prefill)
        rows = sum(len(s.token_ids) for s in seqs) if all_logits else len(seqs)
        logits = self._logits.expand(rows, -1).contiguous()
        _sleep_until(started + cost)
        self.steps += 1
        self.step_seconds += cost
        return logits

    def stats(self) -> dict:
        return {"steps": self.steps, "step_s": round(self.step_seconds, 3), "copy_s": round(self.copy_seconds, 3),
                "disk_s": round(self.disk_seconds, 3), "step_wall_s": round(self.step_wall_seconds, 3),
                "step_host_s": round(self.step_host_seconds, 3)}
