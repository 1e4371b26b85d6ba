"""Plan-driven prefetch: what a replica reads ahead when the placement plan makes it a new holder.

Why: a new holder's first request would otherwise pay the disk read (50-490 ms for an 8B
model's adapters) on its own time to first token. The plan changes seldom (hysteresis), so
each change is a few reads, done before traffic arrives, off the engine thread. Into the
host tier always; into a slot only while a slot is free (a prefetch never evicts what
serves traffic now). Dynamo's allocation controller and SGLang's prefetcher do the same.
Pure; no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence


@dataclass(frozen=True)
class Prefetch:
    name: str
    into_slot: bool


def prefetches(planned: Sequence[str], before: Collection[str], resident: Collection[str],
               staged: Collection[str], free_slots: int) -> list[Prefetch]:
    """What to read ahead: adapters newly ``planned`` here (not in ``before``) that are not
    ``resident`` nor ``staged`` (host tier or being read); the first ``free_slots`` of them also
    into a slot. Names only; the caller maps them to its registry."""
    out: list[Prefetch] = []
    free = max(0, free_slots)
    for name in planned:
        if name in before or name in resident:
            continue
        into_slot = free > 0
        free -= into_slot
        if name not in staged or into_slot:
            out.append(Prefetch(name, into_slot))
    return out
