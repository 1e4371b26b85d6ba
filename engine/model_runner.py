"""One forward pass over a step's requests: prefill for new ones, decode for running ones.

The decoder's own modules (embedding, norms, projections, MLP, rotary embedding) come
from the ``transformers`` model; this file only orchestrates attention over the paged KV
cache (``engine.attention``), so Llama, Mistral (GQA, sliding window) and Qwen2 (q/k/v
bias) share one path. Tokens are laid out grouped by pool slot, which is what lets the
LoRA layers work on contiguous segments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pool.memory_pool import LoRAMemoryPool

from .attention import make_attention
from .attention_layout import StepLayout
from .cpu_gemm import project
from .decoder_ops import make_decoder_ops
from .fused_ops import act_mul
from .host_copy import to_device
from .kv_cache import PagedKVCache
from .lora_layers import LoRABatchContext, LoRASegment, fused_projections
from .norms import rms_norm

if TYPE_CHECKING:
    from .decode_graphs import DecodeGraphs

log = logging.getLogger(__name__)


@dataclass
class SeqInput:
    """The tokens one request feeds this step, at positions ``start_pos``... of its block table's blocks."""

    block_table: list[int]
    token_ids: list[int]
    start_pos: int
    slot: int
    scored: bool = False  # echo: every token's logits are read after the forward (``ModelRunner.token_logits``)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("triton is not installed: LoRA runs as a loop over adapters on CUDA")
        return False
    return True


def window_of(attn: nn.Module, config) -> Optional[int]:
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(config, "sliding_window", None)


class ModelRunner:
    def __init__(self, model: nn.Module, pool: LoRAMemoryPool, kv_cache: PagedKVCache, context: LoRABatchContext,
                 lora_kernels: Optional[bool] = None, sparse_scores: bool = False, fused_ops: bool = False,
                 max_positions: Optional[int] = None):
        """``lora_kernels``: run multi-adapter steps' LoRA on the Triton kernels (the engine passes its start-up
        check's decision, ``engine.fast_paths``); None: on CUDA when Triton imports. ``sparse_scores``: the torch
        attention's decode scores as ``sampled_addmm`` (its start-up check's decision). ``fused_ops``: norms and
        RoPE on FlashInfer's kernels (``engine.decoder_ops``), for positions below ``max_positions``."""
        self.model = model
        self.decoder = model.model
        self.config = model.config
        self.pool = pool
        self.cache = kv_cache
        self.context = context
        attn0 = self.decoder.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.num_heads = attn0.q_proj.weight.shape[0] // self.head_dim
        self.num_kv_heads = attn0.k_proj.weight.shape[0] // self.head_dim
        self.scaling = attn0.scaling
        self.windows = [window_of(layer.self_attn, self.config) for layer in self.decoder.layers]
        self.device = next(model.parameters()).device
        self.attention = make_attention(kv_cache, self.num_heads, self.num_kv_heads, self.head_dim, sparse_scores)
        self.ops = make_decoder_ops(self.decoder, fused_ops,
                                    max_positions or getattr(self.config, "max_position_embeddings", 2048), self.device)
        # The segmented Triton LoRA kernels (two launches per projection group whatever the number of adapters)
        # where the start-up check passed; else the torch segment loop
        if lora_kernels is None:
            lora_kernels = self.device.type == "cuda" and triton_available()
        self.kernel_device = self.device if lora_kernels else None
        self.graphs: Optional["DecodeGraphs"] = None  # captured decode steps, once the engine's check passed them

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], all_logits: bool = False) -> torch.Tensor:
        """Logits of each request's last token (or of every token with ``all_logits``), in input order.

        Unless a request is ``scored`` (or ``all_logits``), the last layer runs its attention output and MLP on
        each request's last token only: the other tokens' K/V are all later steps read, and their hidden states
        nobody reads (on a 4-layer model a fifth of a prompt token's GEMMs; 1/L of them on L layers)."""
        if self.graphs is not None and not all_logits and self._graphs_take(seqs):
            return self._replay(seqs)
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        ordered = [seqs[i] for i in order]
        layout = StepLayout([s.block_table for s in ordered], [s.start_pos for s in ordered], [len(s.token_ids) for s in ordered],
                            self.cache.block_size, self.device, decode_gathers=self.attention.name == "torch")
        starts = layout.token_offsets
        input_ids = to_device(torch.tensor([t for s in ordered for t in s.token_ids]), self.device)
        decode = layout.num_tokens == len(ordered)  # every request feeds one token
        self.context.set_segments(self._segments(ordered, starts), self.kernel_device, num_tokens=layout.num_tokens,
                                  decode_on=self.device if decode else None)
        last_rows = [starts[j] + len(s.token_ids) - 1 for j, s in enumerate(ordered)]
        keep_all = all_logits or any(s.scored for s in seqs) or decode
        try:
            self.attention.begin_step(layout, self.windows, self.scaling)
            hidden = self._decoder_forward(input_ids, layout, None if keep_all else (ordered, last_rows))
        finally:
            self.context.set_segments([])
        # for token_logits: every token's hidden state, when it was kept
        self._last_step = (hidden, starts, order, [len(s.token_ids) for s in ordered]) if keep_all else None
        if all_logits:
            logits = self._project(self.model.lm_head, hidden)
            pieces = [logits[starts[j]:starts[j] + len(s.token_ids)] for j, s in enumerate(ordered)]
            result: list = [None] * len(seqs)
            for j, i in enumerate(order):
                result[i] = pieces[j]
            return torch.cat(result, dim=0)
        if keep_all and not decode:  # a decode step's rows already are its last tokens
            hidden = hidden.index_select(0, to_device(torch.tensor(last_rows), self.device))
        logits = self._project(self.model.lm_head, hidden)
        if order == list(range(len(order))):  # the inputs came in slot order: no reordering
            return logits
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return logits.index_select(0, to_device(inverse, self.device))

    def _graphs_take(self, seqs: list[SeqInput]) -> bool:
        """A decode step (one token per row, none scored) that fits a captured bucket."""
        return (len(seqs) <= self.graphs.max_rows and all(len(s.token_ids) == 1 and not s.scored for s in seqs))

    def _replay(self, seqs: list[SeqInput]) -> torch.Tensor:
        """The step through its captured graph; one that raises drops the graphs for good (logged) and runs eagerly."""
        self._last_step = None  # a graph keeps no hidden states to re-read (scored rows never replay)
        try:
            return self.graphs.forward(seqs)
        except Exception:
            log.exception("a captured decode step failed: decode steps run eagerly from now on")
            graphs, self.graphs = self.graphs, None
            graphs.release()
            return self.forward(seqs)

    @torch.inference_mode()
    def token_logits(self, index: int) -> torch.Tensor:
        """Logits of every token request ``index`` (its place in the last ``forward``'s input) fed then."""
        if self._last_step is None:
            raise RuntimeError("the last forward kept only each request's last token: mark the request scored")
        hidden, starts, order, lengths = self._last_step
        j = order.index(index)
        return self._project(self.model.lm_head, hidden[starts[j]:starts[j] + lengths[j]])

    def _project(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)``; a plain ``nn.Linear`` (lm_head, an untargeted projection) as the LoRA layers run their base
        (``LoRABatchContext.base_linear``: oneDNN on the CPU when its start-up check passed)."""
        return project(module, x, self.context.base_linear)

    def _segments(self, ordered: list[SeqInput], starts: list[int],
                  lengths: Optional[list[int]] = None) -> list[LoRASegment]:
        segments: list[LoRASegment] = []
        for i, (seq, start) in enumerate(zip(ordered, starts)):
            end = start + (len(seq.token_ids) if lengths is None else lengths[i])
            if segments and segments[-1].slot == seq.slot:
                segments[-1].end = end
            else:
                segments.append(LoRASegment(seq.slot, start, end, self.pool.slot_ranks[seq.slot],
                                            self.pool.slot_scale_values[seq.slot]))
        return segments

    def _decoder_forward(self, input_ids: torch.Tensor, layout: StepLayout,
                         last_only: Optional[tuple[list[SeqInput], list[int]]] = None) -> torch.Tensor:
        """Every token's final hidden state; with ``last_only`` (the ordered inputs and each one's last row), the
        last layer's attention output and MLP run on those rows only, and only they come back."""
        h = self.decoder.embed_tokens(input_ids)
        ops = self.ops
        ops.begin_step(h, layout.positions)
        T = h.shape[0]
        linear = self.context.base_linear
        block_out: Optional[torch.Tensor] = None  # the last MLP's output, added to the residual inside the next norm
        for li, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            if block_out is None:
                x = ops.norm(layer.input_layernorm, h)
            else:
                x, h = ops.add_norm(layer.input_layernorm, block_out, h)
            q, k, v = fused_projections([attn.q_proj, attn.k_proj, attn.v_proj], x, linear)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.view(T, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
                q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
            q, k = ops.rope(q, k)
            self.cache.write(li, layout.write_blocks, layout.write_offsets, k, v)
            o = self.attention(li, q, k, v, layout, self.windows[li], attn.scaling)
            if last_only is not None and li == len(self.decoder.layers) - 1:
                ordered, rows = last_only
                keep = to_device(torch.tensor(rows), self.device)
                h, o = h.index_select(0, keep), o.index_select(0, keep)
                self.context.set_segments(self._segments(ordered, list(range(len(rows))), [1] * len(rows)),
                                          self.kernel_device, num_tokens=len(rows), decode_on=self.device)
            x, h = ops.add_norm(layer.post_attention_layernorm, project(attn.o_proj, o, linear), h)
            mlp = layer.mlp
            gate, up = fused_projections([mlp.gate_proj, mlp.up_proj], x, linear)
            block_out = project(mlp.down_proj, act_mul(mlp.act_fn, gate, up), linear)
        out, _ = ops.add_norm(self.decoder.norm, block_out, h)
        return out
