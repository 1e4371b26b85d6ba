"""Run ``engine.lora_triton``'s kernels under Triton's interpreter on the CPU (where nothing compiles); on a CUDA
machine they run compiled, on ``DEVICE``."""

from __future__ import annotations

import importlib
import inspect
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


class _RecordingKernel:
    """A Triton kernel that, on each launch, adds the key Triton's compile cache would file the launch under to
    ``seen``, then launches the real kernel."""

    def __init__(self, kernel, name: str, unspecialised: tuple[str, ...], seen: set):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        self._kernel, self._name, self._seen = kernel, name, seen
        self._params = list(inspect.signature(kernel.fn).parameters.values())
        self._unspecialised = unspecialised
        self._specialise = lambda value, specialise: native_specialize_impl(BaseBackend, value, False, specialise, True)

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        values = dict(zip((p.name for p in self._params), args), **kwargs)
        key = []
        for p in self._params:
            if "constexpr" in str(p.annotation):
                key.append((p.name, "constexpr", values[p.name]))
            else:
                key.append((p.name, *self._specialise(values[p.name], p.name not in self._unspecialised)))
        return (self._name, *key)

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def run(*args, **kwargs):
            self._seen.add(self._key(args, kwargs))
            return launch(*args, **kwargs)

        return run


@contextmanager
def recorded_variants(kernels) -> Iterator[set]:
    """Inside: every launch of ``kernels``' (``engine.lora_triton``) two kernels is filed in the yielded set under
    the specialisation key Triton computes for it (its own ``native_specialize_impl``, with the arguments the
    module leaves unspecialised): a launch whose key is not in the set yet is one that compiles on a GPU."""
    seen: set = set()
    mp = pytest.MonkeyPatch()
    for name, unspecialised in (("_shrink_kernel", kernels.SHRINK_UNSPECIALISED),
                                ("_expand_kernel", kernels.EXPAND_UNSPECIALISED)):
        mp.setattr(kernels, name, _RecordingKernel(getattr(kernels, name), name, unspecialised, seen))
    try:
        yield seen
    finally:
        mp.undo()
