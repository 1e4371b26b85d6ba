"""Where adapter files come from: local folders, hub repos and object stores.

``resolve_adapter_source`` turns a source string into a local folder the loader reads,
after checking it against the allow-lists, so every kind of source is refused or fetched
the same way before any adapter file is parsed.
"""

from __future__ import annotations

from typing import Optional

from ..errors import AdapterNotFoundError, SourceNotAllowedError
from .hub import HUB_ALLOW_PATTERNS, is_hub_repo_id, resolve_hub_source
from .local import looks_local, resolve_local_source
from .node_cache import CacheFetch, NodeDownloadCache
from .object_store import FETCHED_FILES, content_version, resolve_object_source
from .policy import SourcePolicy, default_cache_dir, validate_object_store_prefixes
from .resolved import ResolvedSource
from .resolver_roots import candidate_source, resolver_root_kind, validate_resolver_roots
from .urls import ObjectURL, parse_object_url, url_scheme


def resolve_adapter_source(source: str, revision: Optional[str] = None,
                           policy: SourcePolicy = SourcePolicy(), max_bytes: Optional[int] = None) -> ResolvedSource:
    """A local folder holding ``source``'s adapter files, or a typed refusal that names why; an object-store
    file larger than ``max_bytes`` (by its listing) is refused before it is downloaded."""
    if url_scheme(source) is not None:
        url = parse_object_url(source)
        if not policy.allows_object(url):
            raise SourceNotAllowedError(
                f"adapter source {url.url} is outside the allowed object-store prefixes "
                f"(this server's object_store_prefixes)")
        return resolve_object_source(url, revision, NodeDownloadCache(policy.cache_root, max_bytes=policy.cache_bytes,
                                                                       evict_grace_s=policy.cache_grace_s), max_bytes)
    if looks_local(source):
        return resolve_local_source(source, policy)
    if is_hub_repo_id(source):
        return resolve_hub_source(source, revision, policy)
    raise AdapterNotFoundError(
        f"adapter source {source!r} is neither an existing folder, a hub repo id, nor an s3:// or gs:// URL")


__all__ = [
    "CacheFetch", "FETCHED_FILES", "HUB_ALLOW_PATTERNS", "NodeDownloadCache", "ObjectURL", "ResolvedSource",
    "SourcePolicy", "candidate_source", "content_version", "default_cache_dir", "parse_object_url",
    "resolve_adapter_source", "resolver_root_kind", "validate_object_store_prefixes", "validate_resolver_roots",
]
