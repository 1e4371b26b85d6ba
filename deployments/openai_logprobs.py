"""Log-probabilities in OpenAI's two body shapes: completions' parallel lists and chat's per-token objects."""

from __future__ import annotations

from typing import Optional

from engine.request import TokenLogprob


def completion_logprobs(prompt: list[TokenLogprob], generated: list[TokenLogprob], generated_offset: int) -> dict:
    """``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` over the echoed prompt (if any), then
    the generated tokens. Offsets index the choice's ``text``: the prompt's by its tokens' texts, the
    generated ones from the engine (where each token's text starts), shifted by ``generated_offset``
    (the echoed prompt's length)."""
    tokens, values, tops, offsets = [], [], [], []
    position = 0
    for lp in prompt:
        offsets.append(position)
        position += len(lp.token)
    for lp in generated:
        offsets.append(generated_offset + (lp.text_offset or 0))
    for lp in [*prompt, *generated]:
        tokens.append(lp.token)
        values.append(lp.logprob)
        tops.append(None if lp.logprob is None else {text: value for _, text, value in lp.top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _token_entry(token: str, logprob: Optional[float]) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(generated: list[TokenLogprob]) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}``, as chat completions return them."""
    content = [{**_token_entry(lp.token, lp.logprob),
                "top_logprobs": [_token_entry(text, value) for _, text, value in lp.top]} for lp in generated]
    return {"content": content, "refusal": None}
