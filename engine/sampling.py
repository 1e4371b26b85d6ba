"""Next-token choice for a whole step at once: greedy rows by one argmax, sampled rows by one inverse-CDF pass.

Sampled rows (temperature, top-k, top-p) share one softmax, one cumulative sum and one
``searchsorted`` (and one sort, over the rows that cut), and their parameters reach the
device in one copy. Each row's
randomness is one uniform number computed on the device from its request's seed and the
number of tokens it has generated (a counter-based hash, ``uniforms``), so a request's
tokens depend on its seed alone, never on what else is in the batch or on the device
(``seed + i`` for sample i of ``n`` reproduces that sample run alone), and drawing them
costs a handful of element-wise operations for the whole batch rather than one generator
call per row. Greedy and sampled tokens come back in one tensor, so a step costs one
device-to-host transfer whatever the mix (``output_processor.next_tokens``).
"""

from __future__ import annotations

import secrets
from typing import Optional, Sequence

import torch

from .host_copy import to_device

# Below this, dividing logits by the temperature overflows to inf (1e-50 did, failing the
# batch's sampling): it means "greedy" to every user, so it is greedy here.
GREEDY_BELOW = 1e-5
MASK32 = 0xFFFFFFFF
# lowbias32's multipliers (both below 2^31, so a 32-bit value times one stays below 2^63: exact in int64)
MIX_A, MIX_B = 0x21F0AAAD, 0x735A2D97
UNIFORM_BITS = 24  # a float32 in [0, 1) holds 24 bits exactly


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def fresh_seed() -> int:
    """A request without a seed samples with one drawn here (the process's RNG state is not touched)."""
    return secrets.randbits(64)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection on 32-bit values held in int64 that spreads each input bit over the output."""
    x = x ^ (x >> 16)
    x = (x * MIX_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_B) & MASK32
    return x ^ (x >> 15)


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) per row, a function of (64-bit seed as two 32-bit halves, counter) alone: the same on
    any device and in any batch. int64 inputs, each in [0, 2^32)."""
    h = _mix32(counters ^ 0x9E3779B9)
    h = _mix32(h ^ seed_lo)
    h = _mix32(h ^ seed_hi)
    return (h >> (32 - UNIFORM_BITS)).float() / float(1 << UNIFORM_BITS)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[rows, 1] column of the token each uniform picks in its row of (unnormalised, non-negative) ``probs``: the
    first whose running sum passes ``u`` times the total, and never one of probability 0 (a target that rounds up
    to the total takes the first column where the sum reaches it, the last one that adds anything)."""
    cumulative = torch.cumsum(probs, dim=-1)
    total = cumulative[:, -1:].contiguous()
    picks = torch.searchsorted(cumulative, u[:, None] * total, right=True)
    return torch.minimum(picks, torch.searchsorted(cumulative, total))


def sample_tokens(logits: torch.Tensor, temperatures: Sequence[float], top_ps: Sequence[float],
                  top_ks: Sequence[int], seeds: Sequence[int], counters: Sequence[int],
                  usable: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[rows] int64 tokens on ``logits``' device. Row i samples with ``seeds[i]`` (any int; its low 64 bits) at
    ``counters[i]`` (the tokens it has generated); ``top_ks[i]`` 0 keeps every token. ``usable`` (bool [rows], on
    the device): rows whose logits are finite; the others get a placeholder token (their caller reports an error
    for them), never a NaN in the shared softmax.

    Rows that cut (top-p below 1, top-k below the vocabulary) sort their probabilities, which costs most of a
    sampled step on the CPU (a stable sort of 32 x 32k probabilities takes ~100 ms on two cores); the others
    (OpenAI's default top-p 1) sample from the vocabulary in its own order. Which way a row goes depends on its
    own parameters alone, so its token still does not depend on the batch."""
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, t in enumerate(temperatures) if not is_greedy(t)]
    if not sampled:
        return tokens
    device, vocab = logits.device, logits.shape[-1]
    cuts = [i for i in sampled if top_ps[i] < 1 or 0 < top_ks[i] < vocab]
    rows = cuts + [i for i in sampled if i not in set(cuts)]  # the cutting rows first: slices of known size
    # every row's parameters in one host-to-device copy (float64 holds each 32-bit integer exactly)
    params = to_device(torch.tensor([rows, [temperatures[i] for i in rows], [top_ps[i] for i in rows],
                                     [top_ks[i] if 0 < top_ks[i] < vocab else vocab for i in rows],
                                     [seeds[i] & MASK32 for i in rows], [(seeds[i] >> 32) & MASK32 for i in rows],
                                     [counters[i] & MASK32 for i in rows]], dtype=torch.float64), device)
    index, temps, nucleus, top_k = params[0].long(), params[1].float(), params[2].float()[:, None], params[3].long()
    u = uniforms(params[4].long(), params[5].long(), params[6].long())
    sub = logits.index_select(0, index).float()
    if usable is not None:
        sub = torch.where(usable.index_select(0, index)[:, None], sub, torch.zeros((), device=device))
    probs = torch.softmax(sub / temps[:, None], dim=-1)
    n = len(cuts)
    chosen = []
    if n:
        # descending (stable: tied probabilities keep their order), so the cuts keep a prefix
        ordered, order = torch.sort(probs[:n], dim=-1, descending=True, stable=True)
        if any(0 < top_ks[i] < vocab for i in cuts):  # (read on the host: no row cuts, no pass over the vocabulary)
            ordered = ordered * (torch.arange(vocab, device=device)[None, :] < top_k[:n, None])
            nucleus = nucleus[:n] * ordered.sum(dim=-1, keepdim=True)  # top-p of what top-k kept
        ordered = ordered * ((torch.cumsum(ordered, dim=-1) - ordered) < nucleus[:n])  # keeps the most likely
        chosen.append(order.gather(1, _inverse_cdf(ordered, u[:n]))[:, 0])
    if n < len(rows):
        chosen.append(_inverse_cdf(probs[n:], u[n:])[:, 0])
    return tokens.index_copy(0, index, torch.cat(chosen))
