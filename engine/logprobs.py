"""Log-probabilities of chosen tokens and of the most likely ones, for a whole step at once.

They come from the logits as the model gives them, after the adapter and before
temperature, penalties or a grammar's mask (OpenAI's and vLLM's definition), so they
can be checked against ``log_softmax`` of a reference model's logits. One
``log_softmax`` and one ``topk`` cover every row that asked; one transfer brings them to
the host.
"""

from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from .request import TokenLogprob


class TokenTexts:
    """A token id's text as the client sees it in ``tokens``/``top_logprobs`` (decoded alone, cached)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


def logprobs_of(logits: torch.Tensor, chosen: Seq[int], top_k: int, texts: TokenTexts) -> list[TokenLogprob]:
    """Row ``i`` of ``logits`` scored for token ``chosen[i]``, with its ``top_k`` most likely tokens."""
    if not len(chosen):
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(chosen), device=lp.device)[:, None]
    picked = lp.gather(1, index)[:, 0]
    if top_k > 0:
        top_values, top_ids = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
        packed = torch.cat([picked[:, None], top_values, top_ids.to(lp.dtype)], dim=1).tolist()  # one transfer
    else:
        packed = picked[:, None].tolist()
    k = (len(packed[0]) - 1) // 2
    out = []
    for token, row in zip(chosen, packed):
        top = [(int(i), texts(int(i)), v) for v, i in zip(row[1:1 + k], row[1 + k:])]
        out.append(TokenLogprob(int(token), texts(int(token)), row[0], top))
    return out


def step_logprobs(logits: torch.Tensor, requested: list[Optional[int]], tokens: list,
                  texts: TokenTexts) -> list[Optional[TokenLogprob]]:
    """For each row that asked (``requested[i]`` not None) and got a token: its ``TokenLogprob``."""
    rows = [i for i, k in enumerate(requested) if k is not None and isinstance(tokens[i], int)]
    out: list[Optional[TokenLogprob]] = [None] * len(requested)
    if not rows:
        return out
    top_k = max(requested[i] for i in rows)
    index = torch.tensor(rows, device=logits.device)
    scored = logprobs_of(logits.index_select(0, index), [tokens[i] for i in rows], top_k, texts)
    for i, lp in zip(rows, scored):
        lp.top = lp.top[:requested[i]]
        out[i] = lp
    return out


def prompt_logprobs(token_logits: torch.Tensor, prompt_ids: list[int], start: int, top_k: int,
                    texts: TokenTexts) -> list[TokenLogprob]:
    """Prompt tokens ``start + 1 ..`` scored by the logits of the tokens before them (``token_logits[j]``
    is position ``start + j``'s); position 0, which nothing predicts, comes first with no log-probability."""
    end = min(start + token_logits.shape[0], len(prompt_ids) - 1)  # the last prompt token predicts the output
    out = [TokenLogprob(prompt_ids[0], texts(prompt_ids[0]), None)] if start == 0 else []
    if end > start:
        out += logprobs_of(token_logits[:end - start], prompt_ids[start + 1:end + 1], top_k, texts)
    return out
