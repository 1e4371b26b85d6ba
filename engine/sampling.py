"""Next-token choice for a whole step at once: greedy rows by one argmax, sampled rows by one inverse-CDF pass.

Sampled rows (temperature, top-p) share one softmax, one sort, one cumulative sum and one
``searchsorted``; each row's randomness is one uniform
number drawn from its own request's generator, so a request's tokens depend on its seed
alone, never on what else is in the batch (``seed + i`` for sample i of ``n`` reproduces
that sample run alone). Greedy and sampled tokens come back in one tensor, so a step costs
one device-to-host transfer whatever the mix (``output_processor.next_tokens``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

# Below this, dividing logits by the temperature overflows to inf (1e-50 did, failing the
# batch's sampling): it means "greedy" to every user, so it is greedy here.
GREEDY_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def sample_tokens(logits: torch.Tensor, temperatures: Sequence[float], top_ps: Sequence[float],
                  generators: Sequence[Optional[torch.Generator]], usable: Optional[torch.Tensor] = None
                  ) -> torch.Tensor:
    """[rows] int64 tokens on ``logits``' device. ``usable`` (bool [rows], on the device): rows whose logits are
    finite; the others get a placeholder token (their caller reports an error for them), never a NaN in the
    shared softmax."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, t in enumerate(temperatures) if not is_greedy(t)]
    if not rows:
        return tokens
    device = logits.device
    # the rows' index, temperatures and top-p in one host-to-device copy, from pinned memory on CUDA (a pageable
    # copy would wait for the forward to finish: a host sync)
    params = torch.tensor([rows, [temperatures[i] for i in rows], [top_ps[i] for i in rows]], dtype=torch.float64)
    params = params.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else params
    index, temps, nucleus = params[0].long(), params[1].float(), params[2].float()[:, None]
    sub = logits.index_select(0, index).float()
    if usable is not None:
        sub = torch.where(usable.index_select(0, index)[:, None], sub, torch.zeros((), device=device))
    probs = torch.softmax(sub / temps[:, None], dim=-1)
    # every row in descending order (top-p or not): the inverse CDF then maps a uniform to the same token whatever
    # the batch (stable, so tied probabilities keep their order too)
    probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    probs = probs * ((torch.cumsum(probs, dim=-1) - probs) < nucleus)  # keeps the most likely token
    cumulative = torch.cumsum(probs, dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=generators[i], device=device) for i in rows])
    targets = uniforms * cumulative[:, -1]
    kept = (probs > 0).sum(dim=-1, keepdim=True).clamp(min=1)  # a target rounded up to the total takes the last kept
    picks = torch.minimum(torch.searchsorted(cumulative, targets[:, None], right=True), kept - 1)
    return tokens.index_copy(0, index, order.gather(1, picks)[:, 0])
