"""A step's logits -> one token per sequence, its text delta sent to the caller, and finish reasons."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .penalties import apply_penalties, has_penalties, mask_tokens
from .request import TokenDelta, TokenLogprob
from .sampling import is_greedy, sample_tokens
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


def ending_tokens(seq: Sequence, eos_ids: set[int]) -> set[int]:
    """Tokens that end ``seq``: EOS (unless ``ignore_eos``) and its request's ``stop_token_ids``."""
    request = seq.request
    if not request.stop_token_ids:
        return set() if request.ignore_eos else eos_ids
    ends = set(request.stop_token_ids)
    return ends if request.ignore_eos else ends | eos_ids


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int], grammar=None) -> torch.Tensor:
    """The logits sampling sees: penalties, min_tokens' mask and grammars applied to the rows that use them
    (a copy when any does; ``logits`` itself stays raw for log-probabilities)."""
    penalised = [i for i, s in enumerate(seqs) if has_penalties(s.request)]
    # a finished response_format may only end: min_tokens does not hold its end back
    held = [i for i, s in enumerate(seqs) if len(s.output_ids) < s.request.min_tokens
            and (s.matcher is None or not s.matcher.is_completed())]
    constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not (penalised or held or constrained):
        return logits
    logits = logits.clone()
    if penalised:
        apply_penalties(logits, penalised, [seqs[i].request for i in penalised],
                        [seqs[i].prompt_ids for i in penalised], [seqs[i].output_ids for i in penalised])
    if held:
        mask_tokens(logits, held, [ending_tokens(seqs[i], eos_ids) for i in held])
    if constrained:
        grammar.apply(logits, constrained, [seqs[i].matcher for i in constrained])
    return logits


def next_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int] = frozenset(),
                grammar=None) -> list[Union[int, None, Exception]]:
    """Row ``i`` of ``logits`` picks ``seqs[i]``'s token; the whole step's choices (greedy and sampled) and which
    rows were finite come to the host in one transfer (``engine.sampling``).

    A row that cannot give a token (non-finite logits, a sampling error) yields its error
    instead, so one sequence's failure never fails the others in the batch. A request for
    no token at all (``max_tokens`` 0, echo scoring a prompt) yields None.
    """
    finite = torch.isfinite(logits).all(dim=-1)
    logits = process_logits(logits, seqs, eos_ids, grammar)
    requests = [seq.request for seq in seqs]
    try:
        chosen = sample_tokens(logits, [r.temperature for r in requests], [r.top_p for r in requests],
                               [r.top_k for r in requests], [seq.sample_seed for seq in seqs],
                               [len(seq.output_ids) for seq in seqs], finite)
        picked, ok = torch.stack([chosen, finite.to(chosen.dtype)]).tolist()  # the step's one transfer
        failure: Optional[Exception] = None
    except RuntimeError as exc:  # a sampling error fails the rows that sample, never the greedy ones
        picked, ok = logits.argmax(dim=-1).tolist(), finite.tolist()
        failure = exc
    tokens: list[Union[int, None, Exception]] = []
    for i, request in enumerate(requests):
        if request.max_tokens == 0:
            tokens.append(None)
        elif not ok[i]:
            tokens.append(FloatingPointError(f"request {request.request_id}: the model produced non-finite logits"))
        elif failure is not None and not is_greedy(request.temperature):
            tokens.append(failure)
        else:
            tokens.append(int(picked[i]))
    return tokens


def append_token(seq: Sequence, token: int, eos_ids: set[int], logprob: Optional[TokenLogprob] = None
                 ) -> Optional[str]:
    """Add ``token`` to ``seq`` and send its delta; returns "stop" or "length" when ``seq`` is done."""
    seq.output_ids.append(token)
    if seq.logprobs is not None and logprob is not None:
        logprob.text_offset = seq.detokenizer.num_chars
        seq.logprobs.append(logprob)
    if seq.matcher is not None and not seq.matcher.is_terminated():
        seq.matcher.accept_token(token)
    if token in ending_tokens(seq, eos_ids) or (seq.matcher is not None and seq.matcher.is_terminated()):
        text, stopped = seq.detokenizer.finish(), True
    else:
        text, stopped = seq.detokenizer.add(seq.output_ids)
    reason = "stop" if stopped else ("length" if len(seq.output_ids) >= seq.request.max_tokens else None)
    if reason == "length":
        text += seq.detokenizer.finish()
    seq.sink(TokenDelta(seq.request.request_id, token, text, reason, seq.choice_index, logprob))
    return reason
