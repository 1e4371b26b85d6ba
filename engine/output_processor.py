"""A step's logits -> one token per sequence, its text delta sent to the caller, and finish reasons."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .request import TokenDelta
from .sampling import is_greedy, sample_next_token
from .sequence import Sequence


def eos_token_ids(tokenizer, model) -> set[int]:
    """Tokens that end a sequence: the tokenizer's EOS and any the model's generation config adds."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def next_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[Union[int, Exception]]:
    """Row ``i`` of ``logits`` picks ``seqs[i]``'s token: greedy ones share one device sync.

    A row that cannot give a token (non-finite logits, a sampling error) yields its error
    instead, so one sequence's failure never fails the others in the batch.
    """
    greedy = logits.argmax(dim=-1).tolist()
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    tokens: list[Union[int, Exception]] = []
    for i, seq in enumerate(seqs):
        request = seq.request
        if not finite[i]:
            tokens.append(FloatingPointError(f"request {request.request_id}: the model produced non-finite logits"))
        elif is_greedy(request.temperature):
            tokens.append(greedy[i])
        else:
            try:
                tokens.append(sample_next_token(logits[i], request.temperature, request.top_p, seq.generator))
            except RuntimeError as exc:
                tokens.append(exc)
    return tokens


def append_token(seq: Sequence, token: int, eos_ids: set[int]) -> Optional[str]:
    """Add ``token`` to ``seq`` and send its delta; returns "stop" or "length" when ``seq`` is done."""
    seq.output_ids.append(token)
    if token in eos_ids:
        text, stopped = seq.detokenizer.finish(), True
    else:
        text, stopped = seq.detokenizer.add(seq.output_ids)
    reason = "stop" if stopped else ("length" if len(seq.output_ids) >= seq.request.max_tokens else None)
    if reason == "length":
        text += seq.detokenizer.finish()
    seq.sink(TokenDelta(seq.request.request_id, token, text, reason))
    return reason
