"""Adapters in a Hugging Face hub repo, through huggingface_hub's own cache.

Only ``adapter_config.json`` and ``adapter_model.safetensors`` are downloaded: pickle
weights, tokenizer files and anything else in the repo never reach the node. The hub
path honours ``HF_HUB_OFFLINE``, ``HF_HOME``/``HF_HUB_CACHE`` and ``HF_TOKEN``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from ..adapter import CONFIG_FILE, WEIGHTS_FILE
from ..errors import AdapterNotFoundError, SourceNotAllowedError
from .policy import SourcePolicy
from .resolved import ResolvedSource

HUB_ALLOW_PATTERNS = [CONFIG_FILE, WEIGHTS_FILE]
_REPO_ID_RE = re.compile(r"[\w.-]+/[\w.-]+")


def is_hub_repo_id(source: str) -> bool:
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
        raise AdapterNotFoundError(f"hub adapter {source!r} (revision {revision or 'main'}) not found: {exc}") from exc
    return ResolvedSource(path, "hub", path.name)
