"""Run ``engine.lora_triton``'s kernels under Triton's interpreter on the CPU (where nothing compiles); on a CUDA
machine they run compiled, on ``DEVICE``."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the kernel tests put their tensors


@contextmanager
def interpreted_lora_kernels() -> Iterator[object]:
    """``engine.lora_triton`` as it is on CUDA (compiled); on the CPU reloaded with ``TRITON_INTERPRET=1`` (read
    when its kernels are decorated), then reloaded as it was, so the rest of the session sees it unchanged."""
    pytest.importorskip("triton")
    import engine.lora_triton as kernels

    if DEVICE.type == "cuda":
        yield kernels  # compiled: the real thing
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        yield importlib.reload(kernels)
    finally:
        mp.undo()
        importlib.reload(kernels)
