"""A fleet-wide whole-number figure split over an ingress deployment's replicas by rank.

Used where a per-replica share is good enough (resolver lookups: a refusal costs a retry, not
a request the fleet had room for); adapter quotas are exact instead (``quota_book.py``).
"""

from __future__ import annotations

from typing import Optional


def replica_share(limit: int, replicas: int, rank: Optional[int]) -> int:
    """This replica's part of a fleet-wide whole-number limit; the parts of ranks 0..replicas-1 sum to it.
    An unknown or out-of-range rank takes the smallest part, so the fleet never admits more than ``limit``."""
    base, extra = divmod(limit, max(1, replicas))
    return base + 1 if rank is not None and 0 <= rank < extra else base


def serve_placement() -> tuple[int, Optional[int]]:
    """(replicas of this deployment, this replica's rank) from Serve, read now (both change live)."""
    from ray import serve

    context = serve.get_replica_context()
    rank = getattr(context.rank, "rank", context.rank)
    return max(1, context.world_size or 1), rank if isinstance(rank, int) else None
