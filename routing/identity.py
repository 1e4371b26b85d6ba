"""Adapter identity: the user-facing name and the uid minted at each registration.

Pools, events and the directory key by uid; the registry maps name -> current uid. A new
uid per registration means a late event about an old registration is never taken for the
new one.

A rollout's version of an adapter is an entry of its own, ``name@label`` (``deployments.traffic_split``):
placement keys it by ``family_of`` (the name before the first '@', which no user's name contains), so
every version of an adapter shares its rendezvous order and planned replicas (``routing.hashing``,
``routing.plan``) and a traffic flip lands where the adapter already runs.
"""

from __future__ import annotations

import uuid


def mint_uid(name: str) -> str:
    """A fresh uid for one registration of ``name``."""
    return f"{name}@{uuid.uuid4().hex[:8]}"


def name_of(uid: str) -> str:
    """The adapter name a uid was minted for."""
    return uid.rsplit("@", 1)[0]


def family_of(name: str) -> str:
    """The adapter a registry entry name belongs to: ``support@v2`` -> ``support`` (a plain name is its own)."""
    return name.split("@", 1)[0]
