"""What a router reads of a request: its adapter and its prompt's length (no Ray at run time).

Serve hands the router a ``PendingRequest`` whose first argument is the request object
(``engine.request.GenerateRequest`` or anything with the same fields). The ingress resolved
the request's adapter once (``resolved``: the registry entry's name and uid); the router
reads that entry's name, which is what its views key by, and looks nothing up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ray.serve.request_router import PendingRequest


def request_adapter(pending_request: Optional[PendingRequest]) -> Optional[str]:
    """The registry entry serving the request: ``args[0].resolved.name`` once the ingress resolved it, else
    the name the caller gave (``args[0].adapter``: a direct call to the workers); None for the base model."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    resolved = getattr(request, "resolved", None)
    adapter = getattr(resolved, "name", None) if resolved is not None else getattr(request, "adapter", None)
    return adapter if isinstance(adapter, str) else None


CHARS_PER_TOKEN = 4  # a text prompt's length in tokens, estimated (English BPE averages about four characters)


def request_prompt_tokens(request: object) -> int:
    """The prompt's tokens: counted when the request carries token ids, else estimated from its text
    (``CHARS_PER_TOKEN``); 0 when there is none. The router prices the prefill a prompt adds to its
    replica's queue with it, so an estimate within tens of percent is enough and tokenizing here is not."""
    token_ids = getattr(request, "token_ids", None)
    if token_ids:
        return len(token_ids)
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, str):
        return len(prompt) // CHARS_PER_TOKEN
    messages = getattr(request, "messages", None) or ()
    chars = sum(len(m.get("content") or "") for m in messages
                if isinstance(m, dict) and isinstance(m.get("content"), str))
    return chars // CHARS_PER_TOKEN
