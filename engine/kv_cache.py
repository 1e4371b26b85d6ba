"""A fixed-capacity KV cache: one row per running request.

The simplest correct shape (DESIGN.md "Hard parts"): rows are allocated at admission and
freed when a request finishes; a decode step reads each row up to its length under a
mask. Kept behind this small interface so a paged cache can replace it.
"""

from __future__ import annotations

import torch


class KVCacheFullError(RuntimeError):
    pass


class KVCache:
    def __init__(self, num_layers: int, max_rows: int, max_len: int, kv_heads: int, head_dim: int,
                 *, device: torch.device, dtype: torch.dtype):
        shape = (num_layers, max_rows, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_rows = max_rows
        self.max_len = max_len
        self._free = list(range(max_rows - 1, -1, -1))

    def allocate(self) -> int:
        if not self._free:
            raise KVCacheFullError(f"all {self.max_rows} KV rows are in use")
        return self._free.pop()

    def release(self, row: int) -> None:
        self._free.append(row)
