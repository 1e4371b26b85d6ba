"""Next-token choice: greedy at (near-)zero temperature, else temperature + nucleus (top-p)."""

from __future__ import annotations

from typing import Optional

import torch

# Below this, dividing logits by the temperature overflows to inf (1e-50 did, failing the
# batch's sampling): it means "greedy" to every user, so it is greedy here.
GREEDY_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def sample_next_token(logits: torch.Tensor, temperature: float, top_p: float,
                      generator: Optional[torch.Generator]) -> int:
    if is_greedy(temperature):
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        keep = cumulative - sorted_probs < top_p  # always keeps the most likely token
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(sorted_idx[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
