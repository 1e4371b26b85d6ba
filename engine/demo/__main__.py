"""``python -m engine.demo PATH [--adapters N] [--arch ARCH]``: write the demo assets and say what they are."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from .adapters import demo_adapter_spec
from .model import ARCHITECTURES
from .publish import ensure_demo_assets


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m engine.demo PATH [--adapters N] [--arch ARCH]``."""
    parser = argparse.ArgumentParser(prog="python -m engine.demo",
                                     description="Write lorafleet's demo model and adapters.")
    parser.add_argument("path", type=Path, help="root folder of the demo assets")
    parser.add_argument("--adapters", type=int, default=6, help="number of demo adapters (default 6)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama", help="model architecture (default llama)")
    args = parser.parse_args(argv)

    assets = ensure_demo_assets(args.path, num_adapters=args.adapters, arch=args.arch)
    size = sum(f.stat().st_size for f in assets.model_dir.iterdir() if f.is_file())
    print(f"model ({args.arch}, {size / 1e6:.2f} MB): {assets.model_dir}")
    for index, (name, folder) in enumerate(assets.adapters.items()):
        spec = demo_adapter_spec(index)
        flags = " rslora" if spec.use_rslora else ""
        targets = ",".join(spec.target_modules)
        print(f"adapter {name}: r={spec.rank} alpha={spec.alpha:g}{flags} targets={targets} {folder}")


if __name__ == "__main__":
    main()
