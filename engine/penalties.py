"""Per-request logit processing on the batched logits: penalties, min_tokens, a grammar's mask.

Each feature is one tensor operation over the rows that use it (per-row values as
vectors, token counts by one ``scatter_add``): the Python side only gathers the rows'
parameters and token ids, never loops over the vocabulary. The raw logits stay as they
are (log-probabilities are reported from them); processing works on a copy, made only
when some row needs it.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .host_copy import to_device
from .request import GenerateRequest


def has_penalties(request: GenerateRequest) -> bool:
    return bool(request.presence_penalty or request.frequency_penalty or request.repetition_penalty != 1.0)


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids as a [rows, longest] host tensor (0-padded) and the mask of real entries."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = True
    return ids, mask


def token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] counts of each token id in each row's list (the ids reach the device in one copy)."""
    ids, mask = _padded(rows)
    packed = to_device(torch.cat([ids, mask.long()]), device)
    counts = torch.zeros(len(rows), vocab_size, device=device)
    return counts.scatter_add_(1, packed[:len(rows)], packed[len(rows):].float())


def apply_penalties(logits: torch.Tensor, rows: list[int], requests: list[GenerateRequest],
                    prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """In place on ``logits[rows]``: repetition (prompt and output tokens), then frequency and presence (output).
    Which penalties apply is read on the host, and every per-row value reaches the device in one copy, so the step
    never waits for the GPU here."""
    device, vocab = logits.device, logits.shape[-1]
    params = to_device(torch.tensor([rows, [r.repetition_penalty for r in requests],
                                     [r.frequency_penalty for r in requests], [r.presence_penalty for r in requests]],
                                    dtype=torch.float64), device)
    index, rep, freq, presence = params[0].long(), *(p.float()[:, None] for p in params[1:])
    sub = logits.index_select(0, index).float()
    counts = token_counts(outputs, vocab, device)
    if any(r.repetition_penalty != 1.0 for r in requests):
        seen = (counts + token_counts(prompts, vocab, device)) > 0
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
    sub = sub - freq * counts - presence * (counts > 0).float()
    logits.index_copy_(0, index, sub.to(logits.dtype))


def mask_tokens(logits: torch.Tensor, rows: list[int], token_sets: list[Iterable[int]]) -> None:
    """In place: row ``rows[i]`` may not pick any token of ``token_sets[i]`` (min_tokens holding EOS back)."""
    pairs = [(r, t) for r, tokens in zip(rows, token_sets) for t in tokens if 0 <= t < logits.shape[-1]]
    if pairs:
        where = to_device(torch.tensor(pairs, dtype=torch.long).t().contiguous(), logits.device)
        logits[where[0], where[1]] = float("-inf")
