"""wait_until: returns what the condition returned, retries what it is told to, fails naming what it waited for."""

import itertools

import pytest

from waiting import wait_until


def test_returns_the_first_truthy_value():
    calls = itertools.count()
    assert wait_until(lambda: [n for n in [next(calls)] if n >= 3], 10, "three calls", interval_s=0) == [3]


def test_retries_the_listed_exceptions_only():
    attempts = iter([ConnectionError("restarting"), ConnectionError("restarting"), "up"])

    def probe():
        item = next(attempts)
        if isinstance(item, Exception):
            raise item
        return item

    assert wait_until(probe, 10, "the service", interval_s=0, retry_on=(ConnectionError,)) == "up"
    with pytest.raises(KeyError):
        wait_until(lambda: {}["missing"], 10, "a key", interval_s=0)


def test_fails_at_the_deadline_naming_what_and_the_last_state():
    with pytest.raises(pytest.fail.Exception, match=r"0\.05 s waiting for the queue to drain \(last: 0; 3 left\)"):
        wait_until(lambda: 0, 0.05, "the queue to drain", interval_s=0.01, detail=lambda: "3 left")
