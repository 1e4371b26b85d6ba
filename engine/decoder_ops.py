"""The decoder's small per-layer ops: RMSNorm, the residual add before it, and RoPE; torch's, or FlashInfer's fused
kernels on CUDA.

Why: on a GPU these are ~18 kernels a layer (RMSNorm in half precision: a cast, the norm, a cast back, the weight;
the residual add; RoPE's four ops per tensor, and the step's cos/sin), each a few microseconds of a card that moves
little data: ~500 of an 8B decode step's kernels. FlashInfer's ``fused_add_rmsnorm`` (the residual add and the next
norm in one pass, in place), ``rmsnorm`` and ``apply_rope_with_cos_sin_cache_inplace`` (q and k in one kernel, from a
cos/sin table built once at start) make them 3.

The residual is carried as vLLM and SGLang carry it: a block's output is not added to the residual stream where it
is made but inside the next norm (``add_norm``). The torch ops do the same additions in the same order as the plain
loop (``h + block``, then the norm), so on the CPU nothing changes. FlashInfer's ops are checked against the torch
ones at start (``fused_ops_error``) and serve only where they agree (``EngineTuning.fused_ops``); a norm that is not
Llama-style (Gemma's ``1 + weight``) or whose weight is in another dtype than the activations runs torch's either
way. FlashInfer sums the residual in fp32 and normalises that sum before rounding it (torch rounds first): about one
ulp apart, inside the check's half-precision tolerance.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .fused_ops import apply_rope, signed_sine
from .norms import is_llama_style, rms_norm


class TorchDecoderOps:
    """The reference: transformers' rotary embedding per step, ``engine.norms`` and ``engine.fused_ops``."""

    name = "torch"

    def __init__(self, rotary_emb: nn.Module):
        self.rotary_emb = rotary_emb
        self._cos: Optional[torch.Tensor] = None
        self._sin: Optional[torch.Tensor] = None

    def begin_step(self, h: torch.Tensor, positions: torch.Tensor) -> None:
        """The step's cos and (signed) sin for ``positions``, shared by every layer."""
        cos, sin = self.rotary_emb(h[None], positions[None])
        self._cos, self._sin = cos[0][:, None, :], signed_sine(sin[0][:, None, :])

    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(norm, x)

    def add_norm(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``."""
        h = residual + x
        return rms_norm(norm, h), h

    def rope(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [tokens, heads, head_dim] and ``k`` [tokens, kv_heads, head_dim] rotated to the step's positions."""
        return apply_rope(q, self._cos, self._sin), apply_rope(k, self._cos, self._sin)


class FlashInferDecoderOps(TorchDecoderOps):
    """FlashInfer's fused kernels (CUDA, half precision); the torch ops where a norm is not Llama-style."""

    name = "flashinfer"

    def __init__(self, rotary_emb: nn.Module, max_positions: int, device: torch.device):
        import flashinfer.norm
        import flashinfer.rope

        super().__init__(rotary_emb)
        self._norm, self._rope = flashinfer.norm, flashinfer.rope
        self.cos_sin_cache = cos_sin_table(rotary_emb, max_positions, device)
        self._positions: Optional[torch.Tensor] = None

    def begin_step(self, h: torch.Tensor, positions: torch.Tensor) -> None:
        self._positions = positions

    @staticmethod
    def _fusable(norm: nn.Module, x: torch.Tensor) -> bool:
        """A Llama-style norm whose weight has the activations' dtype (the kernels cast it unchecked) on rows."""
        return is_llama_style(norm) and norm.weight.dtype == x.dtype and x.dim() == 2

    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self._fusable(norm, x):
            return rms_norm(norm, x)
        return self._norm.rmsnorm(x, norm.weight, norm.variance_epsilon)

    def add_norm(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: ``residual += x``, then ``x = norm(residual)``; both are the caller's own (fresh) tensors."""
        if not self._fusable(norm, x):
            return super().add_norm(norm, x, residual)
        self._norm.fused_add_rmsnorm(x, residual, norm.weight, norm.variance_epsilon)
        return x, residual

    def rope(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _, head_dim = q.shape
        q, k = q.contiguous(), k.contiguous()
        self._rope.apply_rope_with_cos_sin_cache_inplace(self._positions, q.view(tokens, -1), k.view(tokens, -1),
                                                         head_dim, self.cos_sin_cache, is_neox=True)
        return q, k


def cos_sin_table(rotary_emb: nn.Module, max_positions: int, device: torch.device) -> torch.Tensor:
    """float32 [max_positions, rotary_dim]: each position's cosines (first half) and sines (second half), as FlashInfer
    reads them, from the model's own rotary embedding (so its scaling, Llama-3's or YaRN's, is in the table)."""
    positions = torch.arange(max_positions, device=device)[None]
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = rotary_emb(probe, positions)
    half = cos.shape[-1] // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1).float().contiguous()


def make_decoder_ops(decoder: nn.Module, fused: bool, max_positions: int, device: torch.device) -> TorchDecoderOps:
    """FlashInfer's ops when ``fused`` (the start-up check passed them), torch's otherwise."""
    if fused:
        return FlashInferDecoderOps(decoder.rotary_emb, max_positions, device)
    return TorchDecoderOps(decoder.rotary_emb)


def fused_ops_unsupported(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None where ``auto`` tries FlashInfer's norm and RoPE kernels, else why not."""
    if device.type != "cuda":
        return "FlashInfer's fused norm and RoPE run on CUDA: this engine is on the CPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashInfer's fused norm and RoPE are checked in half precision: this engine is {dtype}"
    return None


def fused_ops_error(model: nn.Module, device: torch.device, dtype: torch.dtype, max_positions: int,
                    seed: int) -> float:
    """The largest relative difference of FlashInfer's norm, residual norm and RoPE from torch's on random inputs
    shaped like the model's first layer (a norm it does not fuse is torch's on both sides)."""
    from .fast_paths import relative_error

    decoder = model.model
    layer = decoder.layers[0]
    attn = layer.self_attn
    head_dim = attn.head_dim
    heads, kv_heads = attn.q_proj.weight.shape[0] // head_dim, attn.k_proj.weight.shape[0] // head_dim
    hidden = decoder.embed_tokens.weight.shape[1]
    g = torch.Generator().manual_seed(seed)
    tokens = 7

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    reference = TorchDecoderOps(decoder.rotary_emb)
    fast = make_decoder_ops(decoder, True, max_positions, device)
    h, x = rand(tokens, hidden), rand(tokens, hidden)
    positions = torch.randint(0, max_positions, (tokens,), generator=g).to(device)
    q, k = rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim)
    for ops in (reference, fast):
        ops.begin_step(h, positions)
    worst = relative_error(fast.norm(layer.input_layernorm, h.clone()), reference.norm(layer.input_layernorm, h))
    expected = reference.add_norm(layer.post_attention_layernorm, x, h)
    got = fast.add_norm(layer.post_attention_layernorm, x.clone(), h.clone())
    worst = max([worst] + [relative_error(a, b) for a, b in zip(got, expected)])
    got_q, got_k = fast.rope(q.clone(), k.clone())
    want_q, want_k = reference.rope(q, k)
    worst = max(worst, relative_error(got_q, want_q), relative_error(got_k, want_k))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a launch failure surfaces here, inside the check
    return worst
