"""A request's life inside the engine: prompt, generated tokens, KV row, output sink."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from .detokenizer import IncrementalDetokenizer
from .request import GenerateRequest, GenerateResult, TokenDelta

SinkItem = Union[TokenDelta, GenerateResult, BaseException]


class Sequence:
    def __init__(self, request: GenerateRequest, uid: Optional[str], prompt_ids: list[int],
                 detokenizer: IncrementalDetokenizer, sink: Callable[[SinkItem], None], device: torch.device):
        self.request = request
        self.uid = uid
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.detokenizer = detokenizer
        self.sink = sink
        self.row: Optional[int] = None
        self.blocked_steps = 0
        self.cancel_reason: Optional[BaseException] = None
        self.generator: Optional[torch.Generator] = None
        if request.temperature > 0:
            # sampling runs on the logits' device, so the generator lives there too
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(request.seed if request.seed is not None else torch.seed())

    def next_input(self) -> tuple[list[int], int]:
        """(tokens to feed, their first position): the prompt at first, then the last token."""
        if not self.output_ids:
            return self.prompt_ids, 0
        return [self.output_ids[-1]], len(self.prompt_ids) + len(self.output_ids) - 1

    def result(self, finish_reason: str) -> GenerateResult:
        return GenerateResult(
            request_id=self.request.request_id,
            adapter=self.request.adapter,
            text=self.detokenizer.text,
            token_ids=list(self.output_ids),
            finish_reason=finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
        )
