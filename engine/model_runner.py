"""One forward pass over a step's requests: prefill for new ones, decode for running ones.

The decoder's own modules (embedding, norms, projections, MLP, rotary embedding) come
from the ``transformers`` model; this file only orchestrates attention over the
per-request KV cache, so Llama, Mistral (GQA, sliding window) and Qwen2 (q/k/v bias)
share one path. Tokens are laid out grouped by pool slot, which is what lets the LoRA
layers work on contiguous segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pool.memory_pool import LoRAMemoryPool

from .kv_cache import KVCache
from .lora_layers import LoRABatchContext, LoRASegment


@dataclass
class SeqInput:
    """The tokens one request feeds this step, starting at cache position ``start_pos``."""

    row: int
    token_ids: list[int]
    start_pos: int
    slot: int


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _window_of(attn: nn.Module, config) -> Optional[int]:
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(config, "sliding_window", None)


class ModelRunner:
    def __init__(self, model: nn.Module, pool: LoRAMemoryPool, kv_cache: KVCache, context: LoRABatchContext):
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
        self.windows = [_window_of(layer.self_attn, self.config) for layer in self.decoder.layers]
        self.device = next(model.parameters()).device
        # The gathered LoRA form pays in memory copies to save kernel launches: measured slower on CPU
        # (benchmarks.lora_compute: 8 adapters 1.26x base vs 1.05-1.10x with the segment loop), so the
        # CPU keeps the loop; on CUDA launches dominate small decode steps.
        self.gather_device = self.device if self.device.type == "cuda" else None

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], all_logits: bool = False) -> torch.Tensor:
        """Logits of each request's last token (or of every token with ``all_logits``), in input order."""
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        ordered = [seqs[i] for i in order]
        plan = _StepPlan(ordered, self.device)
        self.context.set_segments(self._segments(ordered, plan.starts), self.gather_device)
        try:
            hidden = self._decoder_forward(plan)
        finally:
            self.context.set_segments([])
        if all_logits:
            logits = self.model.lm_head(hidden)
            pieces = [logits[plan.starts[j]:plan.starts[j] + len(s.token_ids)] for j, s in enumerate(ordered)]
            result: list = [None] * len(seqs)
            for j, i in enumerate(order):
                result[i] = pieces[j]
            return torch.cat(result, dim=0)
        last = torch.tensor([plan.starts[j] + len(s.token_ids) - 1 for j, s in enumerate(ordered)], device=self.device)
        logits = self.model.lm_head(hidden.index_select(0, last))
        inverse = torch.empty(len(order), dtype=torch.long, device=self.device)
        inverse[torch.tensor(order, device=self.device)] = torch.arange(len(order), device=self.device)
        return logits.index_select(0, inverse)

    def _segments(self, ordered: list[SeqInput], starts: list[int]) -> list[LoRASegment]:
        segments: list[LoRASegment] = []
        for seq, start in zip(ordered, starts):
            end = start + len(seq.token_ids)
            if segments and segments[-1].slot == seq.slot:
                segments[-1].end = end
            else:
                segments.append(LoRASegment(seq.slot, start, end, self.pool.slot_ranks[seq.slot],
                                            self.pool.slot_scale_values[seq.slot]))
        return segments

    def _decoder_forward(self, plan: "_StepPlan") -> torch.Tensor:
        h = self.decoder.embed_tokens(plan.input_ids)
        cos, sin = self.decoder.rotary_emb(h[None], plan.positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]
        T = h.shape[0]
        for li, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(T, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.cache.k[li, plan.rows, plan.positions] = k
            self.cache.v[li, plan.rows, plan.positions] = v
            o = self._attention(li, q, plan, attn.scaling)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.decoder.norm(h)

    def _attention(self, li: int, q: torch.Tensor, plan: "_StepPlan", scale: float) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, device=q.device, dtype=q.dtype)
        window = self.windows[li]
        kc, vc = self.cache.k[li], self.cache.v[li]
        if plan.decode_tokens is not None:
            L = plan.decode_max_len
            keys = kc[plan.decode_rows, :L].transpose(1, 2)   # [B, KV, L, hd]
            values = vc[plan.decode_rows, :L].transpose(1, 2)
            key_pos = torch.arange(L, device=q.device)
            qpos = plan.decode_lengths - 1
            mask = key_pos[None, :] <= qpos[:, None]
            if window:
                mask &= key_pos[None, :] > (qpos[:, None] - window)
            qd = q.index_select(0, plan.decode_tokens)[:, :, None, :]  # [B, H, 1, hd]
            od = F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask[:, None, None, :],
                                                scale=scale, enable_gqa=True)
            out[plan.decode_tokens] = od.reshape(od.shape[0], -1)
        for token_start, n, row, start_pos in plan.prefills:
            total = start_pos + n
            qp = q[token_start:token_start + n].transpose(0, 1)[None]  # [1, H, n, hd]
            keys = kc[row, :total].transpose(0, 1)[None]
            values = vc[row, :total].transpose(0, 1)[None]
            qpos = torch.arange(start_pos, total, device=q.device)
            key_pos = torch.arange(total, device=q.device)
            mask = key_pos[None, :] <= qpos[:, None]
            if window:
                mask &= key_pos[None, :] > (qpos[:, None] - window)
            op = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask[None, None], scale=scale,
                                                enable_gqa=True)
            out[token_start:token_start + n] = op[0].transpose(0, 1).reshape(n, -1)
        return out


class _StepPlan:
    """Flattened token layout of one step plus the attention groups."""

    def __init__(self, ordered: list[SeqInput], device: torch.device):
        ids, positions, rows, self.starts = [], [], [], []
        decode_tokens, decode_rows, decode_lengths = [], [], []
        self.prefills: list[tuple[int, int, int, int]] = []
        for seq in ordered:
            start = len(ids)
            self.starts.append(start)
            n = len(seq.token_ids)
            ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + n))
            rows.extend([seq.row] * n)
            if n == 1:
                decode_tokens.append(start)
                decode_rows.append(seq.row)
                decode_lengths.append(seq.start_pos + 1)
            else:
                self.prefills.append((start, n, seq.row, seq.start_pos))
        self.input_ids = torch.tensor(ids, device=device)
        self.positions = torch.tensor(positions, device=device)
        self.rows = torch.tensor(rows, device=device)
        if decode_tokens:
            self.decode_tokens = torch.tensor(decode_tokens, device=device)
            self.decode_rows = torch.tensor(decode_rows, device=device)
            self.decode_lengths = torch.tensor(decode_lengths, device=device)
            self.decode_max_len = max(decode_lengths)
        else:
            self.decode_tokens = None
