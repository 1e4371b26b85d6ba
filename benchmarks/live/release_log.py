"""Benchmark-only: log when a replica's Serve ongoing count changes, when it refuses, and when a request returns.

Why: Serve's routers decide on a cache of each replica's ongoing count (the count the replica
reported when it last accepted or refused, lowered by one at each result). Whether a closed-loop
client's next request meets a count that still includes the request just answered depends on when
the replica releases it relative to the result's delivery, which no router can see. These worker
subclasses wrap Serve 2.60's ``ReplicaMetricsManager.inc/dec_num_ongoing_requests`` and
``Replica._can_accept_request`` (private: the benchmark checks they exist and fails naming them if a
Serve upgrade moves them) and the worker's ``generate``, appending one JSON line per event to
``$LORAFLEET_RELEASE_LOG/<pid>.jsonl``. ``ReleaseLogPow2Router`` is Serve's default router with its sends
(and Serve's cached count for the replica at each) and probes logged the same way. The product never
deploys them; ``benchmarks.serve_release`` does.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from .load_cost import LoadCostLoRAWorker

LOG_ENV = "LORAFLEET_RELEASE_LOG"


def _log(record: dict) -> None:
    with open(os.path.join(os.environ[LOG_ENV], f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def install_serve_hooks() -> None:
    """Wrap Serve's count changes and refusals in this replica process (once)."""
    import ray.serve._private.replica as replica

    if getattr(replica, "_lorafleet_release_log", False):
        return
    manager, impl = getattr(replica, "ReplicaMetricsManager", None), getattr(replica, "Replica", None)
    needed = [(manager, "inc_num_ongoing_requests"), (manager, "dec_num_ongoing_requests"),
              (impl, "_can_accept_request")]
    missing = [name for owner, name in needed if owner is None or not hasattr(owner, name)]
    if missing:
        raise RuntimeError(f"this Ray Serve has no {missing} in ray.serve._private.replica: update release_log")
    replica._lorafleet_release_log = True
    inc, dec, can = manager.inc_num_ongoing_requests, manager.dec_num_ongoing_requests, impl._can_accept_request

    def logged_inc(self, metadata):
        inc(self, metadata)
        _log({"ev": "inc", "t": time.time(), "rid": metadata.request_id})

    def logged_dec(self, metadata):
        dec(self, metadata)
        _log({"ev": "dec", "t": time.time(), "rid": metadata.request_id})

    def logged_can(self, metadata):
        accepted = can(self, metadata)
        if not accepted:
            _log({"ev": "reject", "t": time.time(), "rid": metadata.request_id})
        return accepted

    manager.inc_num_ongoing_requests, manager.dec_num_ongoing_requests = logged_inc, logged_dec
    impl._can_accept_request = logged_can


class ReleaseLogLoRAWorker(LoadCostLoRAWorker):
    """The product's worker (with the injected load cost), its Serve counts and returns logged."""

    async def __init__(self, args: dict, directory=None, derived: Optional[dict] = None):
        install_serve_hooks()
        await super().__init__(args, directory, derived)

    async def generate(self, request):
        from ray import serve

        result = await super().generate(request)
        _log({"ev": "return", "t": time.time(), "rid": serve.context._get_serve_request_context().request_id,
              "prompt": request.prompt})
        return result


def _pow2_router_class():
    """Serve 2.60's default router class (private module: named in the error if a Serve upgrade moves it)."""
    try:
        from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
    except ImportError as exc:
        raise RuntimeError("this Ray Serve has no ray.serve._private.request_router.pow_2_router."
                           "PowerOfTwoChoicesRequestRouter: update release_log") from exc
    return PowerOfTwoChoicesRequestRouter


class ReleaseLogPow2Router(_pow2_router_class()):
    """Serve's default router, logging what it knew at each send and what each probe said."""

    def _cached(self, replica_id) -> Optional[int]:
        entry = self._replica_queue_len_cache._cache.get(replica_id)
        return None if entry is None else entry.queue_len

    def on_send_request(self, replica_id) -> None:
        _log({"ev": "send", "t": time.time(), "rep": replica_id.unique_id, "cache": self._cached(replica_id)})
        super().on_send_request(replica_id)

    async def _probe_queue_lens(self, replicas, backoff_index):
        started = time.time()
        result = await super()._probe_queue_lens(replicas, backoff_index)
        _log({"ev": "probe", "t0": started, "t": time.time(), "n": [q for _, q in result]})
        return result

