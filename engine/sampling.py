"""Next-token choice: greedy at temperature 0, else temperature + nucleus (top-p)."""

from __future__ import annotations

from typing import Optional

import torch


def sample_next_token(logits: torch.Tensor, temperature: float, top_p: float,
                      generator: Optional[torch.Generator]) -> int:
    if temperature == 0.0:
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
