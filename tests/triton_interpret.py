"""Run ``engine.lora_triton``'s kernels under Triton's interpreter (on the CPU, where nothing compiles)."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Iterator

import pytest


@contextmanager
def interpreted_lora_kernels() -> Iterator[object]:
    """``engine.lora_triton`` reloaded with ``TRITON_INTERPRET=1`` (read when its kernels are decorated), then
    reloaded as it was, so a CUDA run later in the session gets compiled kernels again."""
    pytest.importorskip("triton")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    import engine.lora_triton as kernels

    try:
        yield importlib.reload(kernels)
    finally:
        mp.undo()
        importlib.reload(kernels)
