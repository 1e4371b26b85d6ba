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
        self._wrappers: dict[Optional[int], object] = {}  # window -> the eager steps' wrapper
        self._graph_wrappers: dict[int, dict[Optional[int], object]] = {}  # rows -> window -> CUDA-graph wrapper
        self._active = self._wrappers  # the wrappers the last ``begin_step`` planned

    def prepare_graph(self, rows: int, max_pages: int, windows: Sequence[Optional[int]]) -> None:
        """Wrappers in CUDA-graph mode for decode batches of exactly ``rows`` rows holding at most ``max_pages`` pages
        in all: their index arrays live in fixed buffers that ``begin_step(..., graph_rows=rows)`` plans into, so a
        graph captured over their ``run`` reads each step's plan (``engine.decode_graphs``)."""
        device = self.cache.k.device
        wrappers = {}
        for window in set(windows):
            wrappers[window] = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "HND", use_cuda_graph=True,
                qo_indptr_buf=torch.empty(rows + 1, dtype=torch.int32, device=device),
                paged_kv_indptr_buf=torch.empty(rows + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buf=torch.empty(max_pages, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buf=torch.empty(rows, dtype=torch.int32, device=device))
        self._graph_wrappers[rows] = wrappers

    def begin_step(self, layout: StepLayout, windows: Sequence[Optional[int]], scale: float,
                   graph_rows: Optional[int] = None) -> None:
        """Plan the step on the eager wrappers, or on the CUDA-graph wrappers of ``graph_rows`` rows (the layout then
        has exactly that many decode rows)."""
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
        self._active = self._wrappers if graph_rows is None else self._graph_wrappers[graph_rows]
        for window in set(windows):
            wrapper = self._active.get(window)
            if wrapper is None:
                wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND")
                self._active[window] = wrapper
            # HF's sliding_window w: a query sees itself and the w - 1 keys before it (window_left is inclusive)
            wrapper.plan(qo_t, kv_t, idx_t, last_t, self.num_heads, self.num_kv_heads, self.head_dim, bs,
                         causal=True, window_left=(window - 1) if window else -1, sm_scale=scale,
                         q_data_type=self.cache.k.dtype, kv_data_type=self.cache.k.dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout,
                 window: Optional[int], scale: float) -> torch.Tensor:
        """Attention output [tokens, heads * head_dim]; the step's K/V are already in the cache."""
        o = self._active[window].run(q.contiguous(), (self.cache.k[layer], self.cache.v[layer]))
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
