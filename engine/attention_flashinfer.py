"""FlashInfer's paged attention for the engine on CUDA (fp16/bf16), reading the ``page_major`` cache as it is.

An optional dependency (``pip install -e '.[gpu]'``); ``engine.attention.choose_backend``
picks it when it is installed and the engine runs on CUDA in half precision.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .attention_layout import StepLayout


class FlashInferPagedAttention:
    """FlashInfer's paged prefill kernel for every token of a step (decode rows are prefills of one token).

    The plan's index arrays are built on the host: ``plan`` reads them there anyway and
    copies them to the device once, so passing device tensors would only add a sync.
    """

    name = "flashinfer"
    WORKSPACE_BYTES = 128 << 20

    def __init__(self, cache, num_heads: int, num_kv_heads: int, head_dim: int):
        import flashinfer

        self.cache = cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._flashinfer = flashinfer
        self._workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=cache.k.device)
        self._wrappers: dict[Optional[int], object] = {}

    def begin_step(self, layout: StepLayout, windows: Sequence[Optional[int]], scale: float) -> None:
        bs = layout.block_size
        qo, kv_indptr, indices, last = [0], [0], [], []
        for table, n, total in zip(layout.tables, layout.counts, layout.kv_lens):
            nb = -(-total // bs)
            qo.append(qo[-1] + n)
            indices.extend(table[:nb])
            kv_indptr.append(kv_indptr[-1] + nb)
            last.append(total - (nb - 1) * bs)
        host = dict(dtype=torch.int32, device="cpu")
        qo_t, kv_t = torch.tensor(qo, **host), torch.tensor(kv_indptr, **host)
        idx_t, last_t = torch.tensor(indices, **host), torch.tensor(last, **host)
        for window in set(windows):
            wrapper = self._wrappers.get(window)
            if wrapper is None:
                wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND")
                self._wrappers[window] = wrapper
            # HF's sliding_window w: a query sees itself and the w - 1 keys before it (window_left is inclusive)
            wrapper.plan(qo_t, kv_t, idx_t, last_t, self.num_heads, self.num_kv_heads, self.head_dim, bs,
                         causal=True, window_left=(window - 1) if window else -1, sm_scale=scale,
                         q_data_type=self.cache.k.dtype, kv_data_type=self.cache.k.dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout,
                 window: Optional[int], scale: float) -> torch.Tensor:
        """Attention output [tokens, heads * head_dim]; the step's K/V are already in the cache."""
        o = self._wrappers[window].run(q.contiguous(), (self.cache.k[layer], self.cache.v[layer]))
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
