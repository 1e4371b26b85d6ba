"""The request object every layer passes along: one definition, read by engine, router, ingress.

Requests and results are frozen: a layer that adds something (the ingress's resolved adapter,
the engine's filled-in ``max_tokens``, the worker's replica id) makes a new object with
``dataclasses.replace``, so no caller ever sees its own object change under it.

The adapter travels here rather than in Serve's ``multiplexed_model_id`` because
``@serve.batch`` splits batches by that id.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional, Union

ChatMessage = dict  # {"role": ..., "content": ...}
MAX_LOGPROBS = 20  # top log-probabilities per token at most (as OpenAI's top_logprobs)


@dataclass(frozen=True)
class AdapterRef:
    """An adapter name resolved once, at the ingress: the registry entry that serves the request and the
    uid minted at that entry's registration.

    Why both: routers key their views by the entry name, while pools, engines and events key by uid.
    Carrying the uid means no later hop looks the name up again, and a request resolved before a
    re-registration names the old uid, which the worker refuses instead of serving other weights.
    """

    name: str  # the registry entry (a version's entry is ``name@label``)
    uid: str   # ``routing.identity.mint_uid``'s, from that registration


@dataclass(frozen=True)
class GenerateRequest:
    adapter: Optional[str] = None  # the adapter name the caller asked for, or None for the base model
    prompt: Optional[str] = None
    token_ids: Optional[list[int]] = None
    messages: Optional[list[ChatMessage]] = None
    max_tokens: Optional[int] = 16  # None: what the context window leaves, capped by max_tokens_limit
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # sample from the k most likely tokens only (0: every token)
    seed: Optional[int] = None  # choice i of n samples with seed + i
    stop: Union[str, list[str], None] = None
    n: int = 1                                  # parallel samples of one prompt (prefilled once)
    logprobs: Optional[int] = None              # None: none; k: the chosen token's and the top k (0..20)
    prompt_logprobs: Optional[int] = None       # the same for each prompt token (echo); allows max_tokens 0
    presence_penalty: float = 0.0               # -2..2, subtracted once from every generated token's logit
    frequency_penalty: float = 0.0              # -2..2, subtracted per occurrence in the output
    repetition_penalty: float = 1.0             # > 0; prompt and output tokens' logits divided (or multiplied)
    min_tokens: int = 0                         # EOS and stop_token_ids masked until this many tokens
    stop_token_ids: Optional[list[int]] = None  # more tokens that end the sequence, as EOS does
    ignore_eos: bool = False                    # EOS does not end the sequence (max_tokens does)
    response_format: Optional[dict] = None      # {"type": "json_object"} or {"type": "json_schema", ...}
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    resolved: Optional[AdapterRef] = None       # set once, by whoever resolved ``adapter`` (the ingress's gate)

    @property
    def served_name(self) -> Optional[str]:
        """The registry entry that serves this request: the resolved one, else the name asked for."""
        return self.resolved.name if self.resolved is not None else self.adapter

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


@dataclass
class ReplicaTarget:
    """Routes a call to one named replica (introspection, per-replica admin); routers honour it."""

    target_replica: str


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (after the adapter, before temperature and penalties),
    with the ``top`` most likely tokens at that position as (token id, text, log-probability)."""

    token_id: int
    token: str
    logprob: Optional[float]  # None for the first prompt token (nothing predicts it)
    top: list[tuple[int, str, float]] = field(default_factory=list)
    text_offset: Optional[int] = None  # where its text starts in the choice's text (generated tokens)


@dataclass
class TokenDelta:
    """One streamed step: new text (stop strings held back until they cannot match)."""

    request_id: str
    token_id: int
    text: str
    finish_reason: Optional[str] = None  # "length" | "stop" | None while running
    index: int = 0                        # which of the request's n choices
    logprob: Optional[TokenLogprob] = None


@dataclass
class Choice:
    """One of a request's n samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: Optional[list[TokenLogprob]] = None


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    adapter: Optional[str]  # the registry entry that served it (``GenerateRequest.served_name``)
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    replica_id: Optional[str] = None  # the worker that served it (its copy of the engine's result)
    logprobs: Optional[list[TokenLogprob]] = None         # choice 0's, when asked
    prompt_logprobs: Optional[list[TokenLogprob]] = None  # when asked (echo)
    prompt_text: Optional[str] = None                     # the prompt decoded, with prompt_logprobs
    choices: list[Choice] = field(default_factory=list)   # all n; text/token_ids/finish_reason are choice 0's

    @property
    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
