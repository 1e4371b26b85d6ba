"""The result of resolving an adapter source: a local folder plus what version it holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class ResolvedSource:
    folder: Path
    kind: str                   # "local", "hub", "s3" or "gs"
    version: Optional[str]      # hub commit, object-store content version; None for a local folder
    downloaded: bool = False    # this call fetched the files into the node-local cache
