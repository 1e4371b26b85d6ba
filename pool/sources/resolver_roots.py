"""Resolver roots: where an unregistered adapter name is looked for on its first request.

A root is an absolute local folder, an ``s3://``/``gs://`` prefix, or a hub organisation;
the candidate source for name ``x`` is ``root/x`` in each case. Roots only propose sources:
the allow-lists still decide what may be loaded.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from ..errors import InvalidAdapterSourceError
from .urls import parse_object_url, url_scheme

_HUB_ORG_RE = re.compile(r"[\w.-]+")


def resolver_root_kind(root: str) -> str:
    """"object", "local" or "hub"; ValueError for anything else."""
    if url_scheme(root) is not None:
        try:
            parse_object_url(root)
        except InvalidAdapterSourceError as exc:
            raise ValueError(f"adapter resolver {root!r}: {exc}") from None
        return "object"
    if root.startswith("/"):
        return "local"
    if _HUB_ORG_RE.fullmatch(root) and root not in (".", ".."):
        return "hub"
    raise ValueError(f"adapter resolver {root!r} is neither an absolute folder, an s3:// or gs:// prefix, "
                     f"nor a hub organisation")


def candidate_source(root: str, name: str) -> str:
    """The source ``root`` proposes for adapter ``name``."""
    kind = resolver_root_kind(root)
    if kind == "object":
        return f"{parse_object_url(root).url}/{name}"
    if kind == "local":
        return f"{root.rstrip('/')}/{name}"
    return f"{root}/{name}"


def validate_resolver_roots(roots: Optional[Sequence[str]]) -> Optional[list[str]]:
    """Config-time check (ValueError naming the bad root)."""
    if roots is None:
        return None
    for root in roots:
        resolver_root_kind(root)
    return list(roots)
