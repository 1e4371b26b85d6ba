"""Shared fixtures: demo assets built once per session, in a temp folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests' helper modules


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lorafleet-demo")
    os.environ["LORAFLEET_DEMO_DIR"] = str(root)  # Ray workers started later inherit it
    return root


@pytest.fixture(scope="session")
def demo_assets(demo_root):
    from engine.demo import ensure_demo_assets

    return ensure_demo_assets(demo_root, num_adapters=6)
