"""Incremental text for streaming, with stop strings held back until they cannot match."""

from __future__ import annotations

from typing import Optional


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.text = ""       # full decoded text so far (stop string excluded once hit)
        self.emitted = 0     # characters already streamed

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Decode ``token_ids`` (all generated so far); return (new safe text, stop hit)."""
        full = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        hit: Optional[int] = None
        for stop in self.stops:
            idx = full.find(stop)
            if idx != -1 and (hit is None or idx < hit):
                hit = idx
        if hit is not None:
            self.text = full[:hit]
            return self._flush(len(self.text)), True
        self.text = full
        safe = len(full) - _partial_stop_suffix(full, self.stops)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            safe = min(safe, len(full) - 1)
        return self._flush(safe), False

    def finish(self) -> str:
        """Everything not yet streamed (the held-back tail once generation ends)."""
        return self._flush(len(self.text))

    def _flush(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta
