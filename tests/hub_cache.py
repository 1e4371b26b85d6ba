"""Build a Hugging Face hub cache on disk (no network), the layout huggingface_hub reads offline."""

from __future__ import annotations

import shutil
from pathlib import Path


def add_to_hub_cache(cache_dir: Path, repo_id: str, folder: Path, commit: str, ref: str = "main") -> Path:
    """Place ``folder``'s files as snapshot ``commit`` of model repo ``repo_id``, with ``refs/{ref}``."""
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in Path(folder).iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot
