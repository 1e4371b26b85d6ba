"""Incremental text for streaming, with stop strings held back until they cannot match.

Each new token is decoded once, in context (``tokenizers``' ``DecodeStream``, which holds
an incomplete UTF-8 sequence until it completes), so a step costs O(1) in the length of
the output instead of re-decoding it all. Stop strings are searched only in the text not
yet streamed: a stop that began in streamed text would have been held back (see ``_held``).
When generation ends, one full decode settles what the stream still held.
"""

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


class _WindowDecoder:
    """For tokenizers without a ``tokenizers`` backend: decode a short window of recent tokens.

    The text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is what the tokens
    after ``read`` add (the window gives the decoder the context it needs for spacing).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def step(self, token_id: int) -> Optional[str]:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


class _StreamDecoder:
    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> Optional[str]:
        return self.stream.step(self.backend, token_id)


def _decoder_for(tokenizer):
    if getattr(tokenizer, "backend_tokenizer", None) is not None:
        try:
            return _StreamDecoder(tokenizer)
        except ImportError:  # tokenizers older than DecodeStream (0.21)
            pass
    return _WindowDecoder(tokenizer)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self._decoder = _decoder_for(tokenizer)
        self._ids: list[int] = []
        self._pending = 0           # tokens fed whose text the decoder has not produced yet
        self._emitted: list[str] = []
        self._emitted_chars = 0
        self._held = ""             # decoded, not streamed: a possible start of a stop string
        self._stopped = False

    @property
    def num_chars(self) -> int:
        """len(self.text), without joining it."""
        return self._emitted_chars + len(self._held)

    @property
    def text(self) -> str:
        """Everything decoded so far (the stop string and what followed it excluded once hit)."""
        return "".join(self._emitted) + self._held

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Feed the tokens of ``token_ids`` (all generated so far) not seen yet; return (new safe text, stop hit)."""
        if self._stopped:
            return "", True
        chunks = []
        for token in token_ids[len(self._ids):]:
            self._ids.append(token)
            piece = self._decoder.step(token)
            if piece is None:
                self._pending += 1
            else:
                self._pending = 0
                chunks.append(piece)
        return self._accept("".join(chunks))

    def finish(self) -> str:
        """Everything not yet streamed (the held-back tail once generation ends)."""
        if self._stopped:
            return ""
        tail = ""
        if self._pending:
            known = self.text
            full = self.tokenizer.decode(self._ids, skip_special_tokens=True)
            if full.startswith(known):
                tail = full[len(known):]
            self._pending = 0
        delta, _ = self._accept(tail, final=True)
        return delta

    def _accept(self, new: str, final: bool = False) -> tuple[str, bool]:
        buf = self._held + new
        hit: Optional[int] = None
        for stop in self.stops:
            idx = buf.find(stop)
            if idx != -1 and (hit is None or idx < hit):
                hit = idx
        if hit is not None:
            self._stopped = True
            return self._emit(buf[:hit], ""), True
        safe = len(buf) if final else len(buf) - _partial_stop_suffix(buf, self.stops)
        return self._emit(buf[:safe], buf[safe:]), False

    def _emit(self, out: str, held: str) -> str:
        if out:
            self._emitted.append(out)
            self._emitted_chars += len(out)
        self._held = held
        return out
