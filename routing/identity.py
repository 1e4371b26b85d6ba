"""Adapter identity: the user-facing name and the uid minted at each registration.

Pools, events and the directory key by uid; the registry maps name -> current uid. A new
uid per registration means a late event about an old registration is never taken for the
new one.
"""

from __future__ import annotations

import uuid


def mint_uid(name: str) -> str:
    """A fresh uid for one registration of ``name``."""
    return f"{name}@{uuid.uuid4().hex[:8]}"


def name_of(uid: str) -> str:
    """The adapter name a uid was minted for."""
    return uid.rsplit("@", 1)[0]
