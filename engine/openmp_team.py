"""Keep the engine thread the process's only OpenMP team on the CPU: free other threads' teams after their torch work.

Why: torch's CPU wheels run intra-op parallelism on GNU OpenMP (libgomp), and every thread that runs a parallel
torch op keeps a team of worker threads for the rest of its life. libgomp counts the workers of every team, and
once they outnumber the CPUs it makes idle workers spin only 100 times (``GOMP_SPINCOUNT``'s throttled count)
before sleeping on a futex, instead of ~300,000: each of a decode step's hundreds of small parallel ops then
waits for a futex wake-up. A replica's engine thread has its team, and the thread that built the model (or
registered an adapter, or measured a step) keeps one too: two teams of 2 on 2 cores. Measured on 2 cores, batch
32 over 8 adapters, same process alternating: ``silu_`` on [32, 2816] 105 -> 37 us with the other thread's team
freed, the decode step 66 -> 53 ms (min of 5 rounds; ``aten::sum``, ``bmm``, ``baddbmm_``, ``mul_`` 2-3x slower
throttled). This is why the step was 15-20% slower once the engine had served (its thread then had a team).

``omp_pause_resource_all(omp_pause_soft)`` (OpenMP 5.0) frees the calling thread's team; its next parallel op
makes a new one. Only the libgomp already loaded in the process is touched; elsewhere (macOS' libomp, a build
without OpenMP) this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what the next region would rebuild anyway

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_looked = False


def loaded_libgomp(maps: Path = Path("/proc/self/maps")) -> Optional[str]:
    """The path of the libgomp this process has loaded (torch's bundled one on its CPU wheels), or None."""
    try:
        text = maps.read_text()
    except OSError:  # not Linux
        return None
    for line in text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and "/libgomp" in fields[5] and ".so" in fields[5]:
            return fields[5].strip()
    return None


def _libgomp() -> Optional[ctypes.CDLL]:
    global _library, _looked
    with _lock:
        if not _looked:
            path = loaded_libgomp()  # None before torch is imported: looked for again next time
            if path is not None:
                _looked = True
                try:
                    library = ctypes.CDLL(path)
                    library.omp_pause_resource_all.argtypes = [ctypes.c_int]
                    library.omp_pause_resource_all.restype = ctypes.c_int
                    _library = library
                except (OSError, AttributeError) as exc:  # an old libgomp without OpenMP 5.0's pause
                    log.info("cannot free OpenMP teams (%s): a second thread's team may slow the engine", exc)
        return _library


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP worker threads (none to free is fine); False where it cannot.

    Call it on a thread other than the engine's once its torch work is done (building the model, reading an
    adapter); never on the engine thread between steps (its team would be rebuilt every step)."""
    library = _libgomp()
    return library is not None and library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
