"""InputProcessor: a ``GenerateRequest`` -> (the request as the engine runs it, adapter uid, prompt token ids),
or an error naming the field.

Everything a request can get wrong is found here, on the caller's thread, before the
request reaches the scheduler: so a bad request costs no step and changes nothing. The
caller's request is never changed: a ``max_tokens`` the engine fills in goes into a copy.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .adapters import ReplicaAdapters
from .config import EngineConfig
from .errors import InvalidRequestError
from .request import GenerateRequest
from .request_checks import check_output_params


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, config: EngineConfig,
                 adapters: ReplicaAdapters):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.config = config  # read on every request: max_tokens_limit is a live setting
        self.adapters = adapters  # the uid of a request that came with a name only

    def process(self, request: GenerateRequest) -> tuple[GenerateRequest, Optional[str], list[int]]:
        """(request, uid, prompt ids); the uid is the one the request carries (``resolved``), resolved here only
        for callers that gave a name alone, and None for the base model. Whether the uid is still live is
        checked when the request is queued (``ReplicaAdapters.acquire``), atomically with counting it."""
        if request.max_tokens is not None and (not isinstance(request.max_tokens, int) or request.max_tokens < 0):
            raise InvalidRequestError("max_tokens",
                                      f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        check_output_params(request, self.vocab_size)
        if request.max_tokens is not None and request.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequestError("max_tokens", f"max_tokens {request.max_tokens} exceeds this server's limit "
                                                    f"{self.config.max_tokens_limit}")
        if request.temperature < 0:
            raise InvalidRequestError("temperature", f"temperature must be >= 0, got {request.temperature}")
        if not 0 < request.top_p <= 1:
            raise InvalidRequestError("top_p", f"top_p must be in (0, 1], got {request.top_p}")
        if not isinstance(request.top_k, int) or request.top_k < 0:
            raise InvalidRequestError("top_k", f"top_k must be an integer >= 0 (0: every token), got {request.top_k!r}")
        uid = request.resolved.uid if request.resolved is not None else self.adapters.resolve(request.adapter)
        ids = self.prompt_ids(request)
        if request.max_tokens is None:  # what the context leaves, capped (the engine's copy of the request)
            request = dataclasses.replace(request, max_tokens=min(self.config.max_tokens_limit,
                                                                  self.max_model_len - len(ids)))
            if request.max_tokens <= 0:
                raise InvalidRequestError("messages" if request.messages is not None else "prompt", f"the prompt ({len(ids)} tokens) leaves no room in the "
                                                      f"context window of {self.max_model_len} tokens")
        if len(ids) + request.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the context "
                              f"window of {self.max_model_len} tokens")
        return request, uid, ids

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt as token ids: given ids (checked against the vocabulary), chat messages or text."""
        if request.token_ids is not None:
            ids = list(request.token_ids)
            if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in ids):
                raise InvalidRequestError("prompt", f"prompt token ids must be integers in [0, {self.vocab_size})")
        elif request.messages is not None:
            ids = self._chat_ids(request.messages)
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt) if request.prompt else []
        else:
            raise InvalidRequestError("prompt", "one of prompt, token_ids or messages is required")
        if not ids or (request.prompt is not None and not request.prompt):
            raise InvalidRequestError("prompt", "prompt must not be empty")
        return ids

    def _chat_ids(self, messages: list) -> list[int]:
        if not messages:
            raise InvalidRequestError("messages", "messages must not be empty")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # jinja errors: a role the template refuses, a bad field
            raise InvalidRequestError("messages", f"messages do not fit the chat template: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
