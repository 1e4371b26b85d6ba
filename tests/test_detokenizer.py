"""Incremental detokenization: streamed pieces add up to a full decode; stop strings are held back and cut."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.demo import build_tokenizer
from engine.detokenizer import IncrementalDetokenizer, _WindowDecoder

TOKENIZER = build_tokenizer()
VOCAB = len(TOKENIZER)
token_lists = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)


def stream(det: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    """Feed ids one step at a time, as the engine does; (deltas, stop hit)."""
    deltas = []
    for i in range(1, len(ids) + 1):
        text, stopped = det.add(ids[:i])
        deltas.append(text)
        if stopped:
            return deltas, True
    deltas.append(det.finish())
    return deltas, False


def first_stop_cut(ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """The oracle: generation stops at the first token after which any stop string is in the text.

    The cut is at the earliest stop string then present: a longer stop that would only have
    completed later (``"a a"`` after ``" "`` already matched) never gets the chance.
    """
    for k in range(1, len(ids) + 1):
        text = TOKENIZER.decode(ids[:k], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], True
    return TOKENIZER.decode(ids, skip_special_tokens=True), False


@settings(max_examples=300, deadline=None)
@given(token_lists)
def test_streamed_text_is_the_full_decode(ids):
    det = IncrementalDetokenizer(TOKENIZER, [])
    deltas, stopped = stream(det, ids)
    full = TOKENIZER.decode(ids, skip_special_tokens=True)
    assert not stopped
    assert "".join(deltas) == full == det.text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abc \u00e9\u2713", min_size=1, max_size=30), st.lists(
    st.text(alphabet="abc \u00e9", min_size=1, max_size=3), min_size=1, max_size=2))
@example("a a", [" ", "a a"])  # CI's find: the longer stop never completes, " " cuts first
def test_stop_strings_are_cut_and_never_streamed(text, stops):
    ids = TOKENIZER.encode(text)
    det = IncrementalDetokenizer(TOKENIZER, stops)
    deltas, stopped = stream(det, ids)
    expected, hit = first_stop_cut(ids, stops)
    streamed = "".join(deltas)
    assert stopped == hit
    assert streamed == expected == det.text
    for i in range(len(deltas)):  # no prefix of the stream ever contained a stop string
        assert not any(s in "".join(deltas[:i + 1]) for s in stops)


def test_partial_stop_is_held_until_it_cannot_match():
    det = IncrementalDetokenizer(TOKENIZER, ["abc"])
    ids = TOKENIZER.encode("xab")
    assert det.add(ids[:2]) == ("x", False)
    assert det.add(ids[:3]) == ("", False)        # "ab" may start "abc": held
    ids2 = TOKENIZER.encode("xabd")
    assert det.add(ids2) == ("abd", False)        # "abd" cannot: released
    assert det.finish() == ""


def test_incomplete_utf8_waits_and_finish_flushes_it():
    check = TOKENIZER.encode("\u2713")            # one character, several byte tokens
    det = IncrementalDetokenizer(TOKENIZER, [])
    assert det.add(check[:2]) == ("", False)
    assert det.add(check) == ("\u2713", False)
    det2 = IncrementalDetokenizer(TOKENIZER, [])
    det2.add(check[:2])
    assert det2.finish() == TOKENIZER.decode(check[:2], skip_special_tokens=True)  # the replacement char


def test_each_step_decodes_only_the_new_token():
    """No full re-decode per step: the cost of a step does not grow with the output."""
    calls = []

    class CountingTokenizer:
        backend_tokenizer = TOKENIZER.backend_tokenizer

        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return TOKENIZER.decode(ids, **kwargs)

    det = IncrementalDetokenizer(CountingTokenizer(), ["zzz"])
    ids = TOKENIZER.encode("hello world " * 40)
    for i in range(1, len(ids) + 1):
        det.add(ids[:i])
    assert calls == []
    det.finish()
    assert det.text == TOKENIZER.decode(ids, skip_special_tokens=True)


@settings(max_examples=200, deadline=None)
@given(token_lists)
def test_window_decoder_for_tokenizers_without_a_backend(ids):
    decoder = _WindowDecoder(TOKENIZER)
    pieces = [decoder.step(t) for t in ids]
    text = "".join(p for p in pieces if p)
    assert TOKENIZER.decode(ids, skip_special_tokens=True).startswith(text)
