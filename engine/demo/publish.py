"""Demo assets on disk: each folder built privately, then published with one atomic rename.

``ensure_demo_assets`` is called by every replica that serves ``base_model: demo``, so
concurrent callers must never see a half-written folder, and a finished one is reused.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from pool.shapes import LoRAModelShape

from .adapters import ADAPTER_FILES, DemoAdapterSpec, demo_adapter_spec, write_demo_adapter
from .model import ARCHITECTURES, MODEL_FILES, write_tiny_model

# Bump when the generated content changes, so stale caches are not reused.
ASSETS_VERSION = 1


@dataclass(frozen=True)
class DemoAssets:
    """Where the demo model and its adapters (name -> folder) live."""

    model_dir: Path
    adapters: dict[str, Path]


def default_demo_root() -> Path:
    """``$LORAFLEET_DEMO_DIR``, else ``~/.cache/lorafleet/demo``."""
    env = os.environ.get("LORAFLEET_DEMO_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lorafleet" / "demo"


def _is_complete(folder: Path, files: Iterable[str]) -> bool:
    return all((folder / f).is_file() for f in files)


def publish_folder(target: Path, files: Sequence[str], build: Callable[[Path], object]) -> Path:
    """Make ``target`` exist, complete, built by ``build`` unless it already is.

    ``build`` writes into a private temp folder beside ``target`` that is then renamed into
    place. The rename is atomic, so readers see a whole folder or none, and when several
    processes race, the first rename wins and the others discard their copies.
    """
    if target.exists():
        if _is_complete(target, files):
            return target
        raise RuntimeError(f"{target} exists but lacks some of {list(files)}; delete it to rebuild the demo assets")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        build(tmp)
        # mkdtemp (and some writers) make things private; a shared cache should be readable
        os.chmod(tmp, 0o755)
        for file in tmp.rglob("*"):
            os.chmod(file, 0o755 if file.is_dir() else 0o644)
        try:
            os.rename(tmp, target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not _is_complete(target, files):
        raise RuntimeError(f"{target} is incomplete after publishing; delete it to rebuild the demo assets")
    return target


def ensure_demo_assets(
    root: Optional[str | os.PathLike] = None,
    *,
    num_adapters: int = 6,
    arch: str = "llama",
) -> DemoAssets:
    """Create the demo model and adapters ``demo-0`` .. ``demo-{N-1}`` under ``root`` if missing.

    Idempotent and safe to call from many processes at once (each Serve replica does).
    Layout: ``root/{arch}-v{ASSETS_VERSION}/model`` and ``.../adapters/demo-{i}``.
    """
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown demo architecture {arch!r}; choose one of {ARCHITECTURES}")
    if num_adapters < 0:
        raise ValueError(f"num_adapters must be >= 0, got {num_adapters}")
    base = (Path(root).expanduser() if root is not None else default_demo_root()).absolute()
    base = base / f"{arch}-v{ASSETS_VERSION}"

    model_dir = publish_folder(base / "model", MODEL_FILES, lambda tmp: write_tiny_model(tmp, arch))
    config = AutoConfig.from_pretrained(model_dir)

    adapters: dict[str, Path] = {}
    for index in range(num_adapters):
        spec = demo_adapter_spec(index)
        shape = LoRAModelShape.from_hf_config(config, spec.target_modules)

        def build(tmp: Path, spec: DemoAdapterSpec = spec, shape: LoRAModelShape = shape) -> Path:
            return write_demo_adapter(
                tmp,
                shape,
                rank=spec.rank,
                target_modules=spec.target_modules,
                alpha=spec.alpha,
                use_rslora=spec.use_rslora,
                seed=spec.seed,
                base_model_path=model_dir,
            )

        adapters[spec.name] = publish_folder(base / "adapters" / spec.name, ADAPTER_FILES, build)
    return DemoAssets(model_dir=model_dir, adapters=adapters)
