"""Adapters in a Hugging Face hub repo, through huggingface_hub's own cache.

Only ``adapter_config.json`` and ``adapter_model.safetensors`` are downloaded: pickle
weights, tokenizer files and anything else in the repo never reach the node. The hub
path honours ``HF_HUB_OFFLINE``, ``HF_HOME``/``HF_HUB_CACHE`` and ``HF_TOKEN``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Optional

from ..adapter import CONFIG_FILE, WEIGHTS_FILE
from ..errors import (
    AdapterNotFoundError,
    LoRAFleetError,
    SourceAccessDeniedError,
    SourceNotAllowedError,
    SourceUnavailableError,
)
from .hub_budget import prune_hub_adapters, touch_snapshot
from .policy import SourcePolicy
from .resolved import ResolvedSource

log = logging.getLogger(__name__)
HUB_ALLOW_PATTERNS = [CONFIG_FILE, WEIGHTS_FILE]
_REPO_ID_RE = re.compile(r"[\w.-]+/[\w.-]+")


def is_hub_repo_id(source: str) -> bool:
    """Whether ``source`` has a hub repo id's shape (``org/name``); the one definition, for adapters and base models."""
    return bool(_REPO_ID_RE.fullmatch(source))


def resolve_hub_source(source: str, revision: Optional[str], policy: SourcePolicy) -> ResolvedSource:
    org = source.split("/", 1)[0]
    if not policy.allows_hub_org(org):
        raise SourceNotAllowedError(
            f"hub organisation {org!r} of {source!r} is not in the allowed list (this server's hub_orgs)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = Path(snapshot_download(repo_id=source, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS))
    except (RepositoryNotFoundError, RevisionNotFoundError, LocalEntryNotFoundError, HfHubHTTPError) as exc:
        raise hub_error(exc, f"hub adapter {source!r} (revision {revision or 'main'})") from exc
    touch_snapshot(path)
    try:
        prune_hub_adapters(policy.cache_bytes, keep=path, cache_dir=path.parents[2],
                           evict_grace_s=policy.cache_grace_s)  # <cache>/models--o--n/snapshots/<sha>
    except Exception as exc:   # a cache we cannot prune (read-only, corrupt) must not refuse the adapter
        log.warning("lorafleet: pruning hub adapter snapshots to %s bytes failed (%r)", policy.cache_bytes, exc)
    return ResolvedSource(path, "hub", path.name)


def hub_error(exc: BaseException, what: str) -> LoRAFleetError:
    """What a hub failure is: gated or refused (403), missing (404), or the hub down or rate-limiting
    (retry later: 503). An outage is never reported, or remembered by a resolver, as a missing adapter."""
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled

    if isinstance(exc, GatedRepoError):
        return SourceAccessDeniedError(f"{what} is gated: this server's token has no access ({exc})")
    status = _http_status(exc)
    offline = isinstance(exc.__cause__, OfflineModeIsEnabled)   # configured offline and not cached: not here
    if isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ is not None and not offline:
        status = _http_status(exc.__cause__) or 503   # the hub could not be reached, and nothing is cached
    if status in (401, 403):
        return SourceAccessDeniedError(f"{what}: access denied ({exc})")
    if status == 429 or (status is not None and status >= 500):
        return SourceUnavailableError(f"{what}: the hub is unavailable or rate-limiting (HTTP {status}); retry later")
    return AdapterNotFoundError(f"{what} not found: {exc}")


def _http_status(exc: BaseException) -> Optional[int]:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError) and getattr(exc, "response", None) is not None:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError)):
            return 404
        return exc.response.status_code
    return None
