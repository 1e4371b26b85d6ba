"""Where adapters may come from: the allow-lists every source kind is checked against.

``None`` allows any source of that kind (the local-development default); an empty list
allows none. Object-store entries are URL prefixes matched whole path segment by whole
path segment, so ``s3://models/team-a`` allows ``s3://models/team-a/x`` but not
``s3://models/team-ab``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..errors import InvalidAdapterSourceError
from .urls import ObjectURL, parse_object_url


def default_cache_dir() -> Path:
    """The node-local download cache every replica on a node shares unless told otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lorafleet" / "adapters"


def validate_object_store_prefixes(prefixes: Optional[Sequence[str]]) -> Optional[list[str]]:
    """Config-time check of an allow-list: each entry must be an ``s3://`` or ``gs://`` URL with a bucket.

    Raises ValueError (what config validators expect), naming the bad entry.
    """
    if prefixes is None:
        return None
    try:
        return [parse_object_url(p).url for p in prefixes]
    except InvalidAdapterSourceError as exc:
        raise ValueError(f"object_store_prefixes: {exc}") from None


@dataclass(frozen=True)
class SourcePolicy:
    adapter_roots: Optional[tuple[str, ...]] = None           # local folders
    hub_orgs: Optional[tuple[str, ...]] = None                # hub organisations
    object_store_prefixes: Optional[tuple[str, ...]] = None   # s3://bucket[/prefix], gs://bucket[/prefix]
    cache_dir: Optional[str] = None                           # node-local download cache (None: default_cache_dir())
    cache_bytes: Optional[int] = None                         # disk budget of each adapter download cache (None: any)
    cache_grace_s: float = 60.0                               # an adapter download used this recently is never evicted

    @classmethod
    def of(cls, adapter_roots: Optional[Sequence[str | os.PathLike]] = None, hub_orgs: Optional[Sequence[str]] = None,
           object_store_prefixes: Optional[Sequence[str]] = None,
           cache_dir: Optional[str | os.PathLike] = None, cache_bytes: Optional[int] = None,
           cache_grace_s: float = 60.0) -> "SourcePolicy":
        """Build from config lists; malformed object-store prefixes are refused here, before any request."""
        prefixes = validate_object_store_prefixes(object_store_prefixes)
        return cls(
            adapter_roots=None if adapter_roots is None else tuple(str(r) for r in adapter_roots),
            hub_orgs=None if hub_orgs is None else tuple(hub_orgs),
            object_store_prefixes=None if prefixes is None else tuple(prefixes),
            cache_dir=None if cache_dir is None else str(cache_dir),
            cache_bytes=cache_bytes,
            cache_grace_s=cache_grace_s,
        )

    @property
    def cache_root(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def allows_folder(self, real: Path) -> bool:
        if self.adapter_roots is None:
            return True
        return any(real == Path(r).resolve() or Path(r).resolve() in real.parents for r in self.adapter_roots)

    def allows_hub_org(self, org: str) -> bool:
        return self.hub_orgs is None or org in self.hub_orgs

    def allows_object(self, url: ObjectURL) -> bool:
        if self.object_store_prefixes is None:
            return True
        return any(url.is_within(parse_object_url(p)) for p in self.object_store_prefixes)
