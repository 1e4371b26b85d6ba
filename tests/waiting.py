"""Waiting for a condition in tests: poll it until it holds, fail with a message at a deadline.

Deadlines are generous (tens of seconds on a loaded 2-core machine) because they only bound
a hung test; a test never asserts how fast something happened.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

import pytest

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, *, interval_s: float = 0.05,
               retry_on: tuple[type[BaseException], ...] = (),
               detail: Optional[Callable[[], object]] = None) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    ``retry_on`` exceptions count as "not yet" (e.g. an actor that is restarting). After
    ``timeout_s`` the test fails naming ``what``, the last value or exception seen and,
    if given, ``detail()`` (what still differs).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            last: object = predicate()
        except retry_on as exc:
            last = exc
        else:
            if last:
                return last  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            extra = f"; {detail()}" if detail is not None else ""
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r}{extra})")
        time.sleep(interval_s)
