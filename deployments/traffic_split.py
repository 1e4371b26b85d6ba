"""Versions of an adapter name and the traffic split between them (pure: no Ray, no I/O).

A name's *family* is its registry entries: the first registration (entry name = the name,
label ``v1`` unless it says otherwise) and every version added later (entry name
``name@label``; '@' cannot occur in a user's adapter name, so these never collide). Each
entry carries its percent; the first registration's ``None`` means "what the others leave".
"""

from __future__ import annotations

import random
import re
from typing import Iterable, Mapping, Optional

from engine.errors import AdapterExistsError, InvalidRequestError
from pool.errors import AdapterNotFoundError

from .registry import RegistryEntry

FIRST_LABEL = "v1"
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,31}$")


def version_entry_name(name: str, label: str) -> str:
    return f"{name}@{label}"


def label_of(entry: RegistryEntry) -> str:
    return entry.version or FIRST_LABEL


def requested_name(entry: RegistryEntry) -> str:
    """The name clients use for this entry."""
    return entry.version_of or entry.name


def families(entries: Iterable[RegistryEntry]) -> dict[str, list[RegistryEntry]]:
    """Requested name -> its entries, the first registration first, then versions by creation."""
    grouped: dict[str, list[RegistryEntry]] = {}
    for entry in entries:
        grouped.setdefault(requested_name(entry), []).append(entry)
    for family in grouped.values():
        family.sort(key=lambda e: (e.version_of is not None, e.created))
    return grouped


def weights(family: list[RegistryEntry]) -> dict[str, int]:
    """Label -> effective percent (the first registration's ``None`` takes the remainder)."""
    explicit = {label_of(e): e.traffic for e in family if e.traffic is not None}
    rest = max(0, 100 - sum(explicit.values()))
    return {label_of(e): e.traffic if e.traffic is not None else rest for e in family}


def pick(family: list[RegistryEntry], rng: random.Random) -> RegistryEntry:
    """The entry that serves one request, drawn by the split."""
    if len(family) == 1:
        return family[0]
    w = weights(family)
    serving = [(e, w[label_of(e)]) for e in family if w[label_of(e)] > 0]
    if not serving:
        raise AdapterNotFoundError(f"adapter {requested_name(family[0])!r} has no version with traffic")
    point = rng.uniform(0, sum(p for _, p in serving))
    for entry, percent in serving:
        point -= percent
        if point <= 0:
            return entry
    return serving[-1][0]


def check_label(label: str, family: list[RegistryEntry]) -> str:
    if not isinstance(label, str) or not LABEL_RE.fullmatch(label):
        raise InvalidRequestError("version", f"version {label!r} is invalid: 1-32 letters, digits, '.', '_', '-'")
    if label in {label_of(e) for e in family}:
        raise AdapterExistsError(f"adapter {requested_name(family[0])!r} already has a version {label!r}")
    return label


def check_split(split: Mapping[str, int], family: list[RegistryEntry]) -> dict[str, int]:
    """A full split (label -> percent, omitted labels 0) that names only existing versions and sums to 100."""
    name = requested_name(family[0])
    labels = [label_of(e) for e in family]
    unknown = sorted(set(split) - set(labels))
    if unknown:
        raise AdapterNotFoundError(f"adapter {name!r} has no version {unknown[0]!r} (it has {labels})")
    for label, percent in split.items():
        if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
            raise InvalidRequestError("traffic", f"traffic for {label!r} must be a whole percent 0-100, got {percent!r}")
    if sum(split.values()) != 100:
        raise InvalidRequestError("traffic", f"traffic percents must sum to 100, got {sum(split.values())}")
    return {label: int(split.get(label, 0)) for label in labels}


def quota_of(family: list[RegistryEntry]) -> tuple[Optional[int], Optional[float]]:
    first = family[0]
    return first.max_concurrency, first.requests_per_s
