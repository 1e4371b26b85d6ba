"""Adapters in a local folder (or a shared filesystem mounted on every node)."""

from __future__ import annotations

from pathlib import Path

from ..errors import AdapterNotFoundError, SourceNotAllowedError
from .policy import SourcePolicy
from .resolved import ResolvedSource


def looks_local(source: str) -> bool:
    """An absolute or relative path, or any string naming an existing file system entry."""
    return source.startswith(("/", ".", "~")) or Path(source).expanduser().exists()


def resolve_local_source(source: str, policy: SourcePolicy) -> ResolvedSource:
    real = Path(source).expanduser().resolve()
    if not policy.allows_folder(real):
        raise SourceNotAllowedError(
            f"adapter source {source!r} is outside the allowed roots (this server's adapter_roots)")
    if not real.is_dir():
        raise AdapterNotFoundError(f"adapter source folder {source!r} does not exist")
    return ResolvedSource(real, "local", None)
