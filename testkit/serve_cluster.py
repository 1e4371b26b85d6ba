"""Serve on a local Ray cluster, its HTTP proxy on a reserved port (``testkit.ports``), up and answering.

Ray must already be initialised (tests and benchmarks choose their own CPUs and system config), with
``testkit.ports.REUSE_PORT_ENV`` in the environment before ``ray.init`` so that every Ray process inherits it.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
import warnings

from .ports import HOST

SERVE_START_DEADLINE_S = 300.0  # Serve waits 60 s for its HTTP proxy; a starved machine can need longer
PROXY_POLL_S = 0.5


def start_serve(http_port: int, deadline_s: float = SERVE_START_DEADLINE_S) -> None:
    """``serve.start`` with the proxy on ``http_port``, given until our own deadline rather than Serve's 60 s.

    When Serve's wait times out, its controller lives on and keeps starting the proxy: the next
    ``serve.start`` connects to that controller, and we then wait for the proxy to answer.
    """
    from ray import serve

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            serve.start(http_options={"host": HOST, "port": http_port})
            break
        except TimeoutError as exc:
            if time.monotonic() >= deadline:
                raise
            warnings.warn(f"serve.start: {exc}; retrying until {deadline_s:g} s have passed")
    while not proxy_answers(http_port):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Serve's HTTP proxy on port {http_port} did not answer within {deadline_s:g} s")
        time.sleep(PROXY_POLL_S)


def proxy_answers(http_port: int) -> bool:
    """Whether Serve's proxy answers HTTP at all (with no app deployed yet it answers 503)."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{http_port}/-/routes", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:  # refused, reset or timed out: not up yet
        return False


def stop_serve() -> None:
    """Serve, then Ray (Ray even when Serve's shutdown fails)."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
