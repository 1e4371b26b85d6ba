"""Host-to-device copies that never make the host wait for the GPU.

A copy from pageable memory makes torch synchronise the stream (the host waits until the
step's forward has finished), so every per-step parameter tensor the engine builds on the
host goes through pinned memory and a non-blocking copy on CUDA. The caching host
allocator keeps the pinned block alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: from pinned memory, without a sync, on CUDA; as it is elsewhere."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
