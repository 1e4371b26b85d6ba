"""A request's life inside the engine: prompt, generated tokens, KV blocks, output sink."""

from __future__ import annotations

from typing import Callable, Optional, Union

from .detokenizer import IncrementalDetokenizer
from .request import GenerateRequest, GenerateResult, TokenDelta, TokenLogprob
from .sampling import fresh_seed

SinkItem = Union[TokenDelta, GenerateResult, BaseException]


class Sequence:
    def __init__(self, request: GenerateRequest, uid: Optional[str], prompt_ids: list[int],
                 detokenizer: IncrementalDetokenizer, sink: Callable[[SinkItem], None]):
        self.request = request
        self.uid = uid
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.detokenizer = detokenizer
        self.sink = sink
        self.block_table: list[int] = []       # KV blocks holding positions 0.. of prompt + output
        self.num_computed = 0                  # leading tokens whose K/V are in those blocks
        self.block_digests: list[bytes] = []   # prefix digests of the full blocks (engine.block_allocator)
        self.blocked_steps = 0
        self.cancel_reason: Optional[BaseException] = None
        self.tokens_at_cancel = 0              # output tokens when it was cancelled (steps spent after: the rest)
        # what its sampled tokens are a function of, with its output position (engine.sampling.uniforms)
        self.sample_seed: int = request.seed if request.seed is not None else fresh_seed()
        # per-request output features (engine.sample_group, engine.logprobs, engine.grammar)
        self.group = None                      # the SampleGroup of an n > 1 request
        self.choice_index = 0
        self.forked = False                    # its n - 1 siblings were made (once, after its prefill)
        self.logprobs: Optional[list[TokenLogprob]] = [] if request.logprobs is not None else None
        self.prompt_logprobs: Optional[list[TokenLogprob]] = [] if request.prompt_logprobs is not None else None
        self.prompt_text: Optional[str] = None  # set with prompt_logprobs (echo)
        self.matcher = None                    # the grammar matcher of a response_format request

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    def next_input(self) -> tuple[list[int], int]:
        """(tokens to feed, their first position): every token whose K/V is not cached yet.

        The prompt (less any cached prefix) at first, then the last token; after a
        preemption, the prompt and the output so far again (recomputed).
        """
        return self.token_at(self.num_computed, self.num_tokens), self.num_computed

    def result(self, finish_reason: str) -> GenerateResult:
        return GenerateResult(
            request_id=self.request.request_id,
            adapter=self.request.served_name,
            text=self.detokenizer.text,
            token_ids=list(self.output_ids),
            finish_reason=finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            prompt_text=self.prompt_text,
        )
