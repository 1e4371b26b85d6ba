"""The request object every layer passes along: one definition, read by engine, router, ingress.

The router reads only ``.adapter``; the adapter name travels here rather than in Serve's
``multiplexed_model_id`` because ``@serve.batch`` splits batches by that id.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional, Union

ChatMessage = dict  # {"role": ..., "content": ...}


@dataclass
class GenerateRequest:
    adapter: Optional[str] = None  # a registered adapter name, or None for the base model
    prompt: Optional[str] = None
    token_ids: Optional[list[int]] = None
    messages: Optional[list[ChatMessage]] = None
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

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
class TokenDelta:
    """One streamed step: new text (stop strings held back until they cannot match)."""

    request_id: str
    token_id: int
    text: str
    finish_reason: Optional[str] = None  # "length" | "stop" | None while running


@dataclass
class GenerateResult:
    request_id: str
    adapter: Optional[str]
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    replica_id: Optional[str] = None  # set by the worker that served it

    @property
    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
