"""The edge guard's probes: one unknown name at a time goes on to the ingress; the rest wait for its answer.

Pure asyncio, no Ray: an ``EdgeRoute`` whose registry copy is loaded (it holds no name, so every name is
unknown) and whose probes are answered by hand, as ``EdgeGuard`` learns from the ingress's hinted refusals.
The same route behind Serve's proxy, against a live ingress, is in test_edge_guard.py.
"""

from __future__ import annotations

import asyncio

from deployments.edge_guard import EdgeRoute, EdgeSettings, Stored

BUSY = Stored({"type": "http.response.start", "status": 429, "headers": []}, b"busy")


def loaded_route(probe_wait_s: float = 5.0) -> EdgeRoute:
    route = EdgeRoute("app", EdgeSettings(probe_wait_s=probe_wait_s))
    route.names = frozenset()
    route._follow = object()   # as if following the registry already: learn starts no directory poll
    return route


async def decide(route: EdgeRoute, model: str) -> tuple:
    stored, probe = await route.behind_probe(model)
    return model, stored, probe


def test_names_that_waited_on_a_probe_whose_answer_opened_no_window_go_on_one_at_a_time():
    async def scenario() -> None:
        route = loaded_route()
        _, first = await route.behind_probe("name-0")
        waiting = [asyncio.ensure_future(decide(route, f"name-{i}")) for i in range(1, 6)]
        await asyncio.sleep(0)
        route.probe_done(first)   # its answer opened no window (a 429 that came back with its window over)
        await asyncio.sleep(0.01)
        done = [w for w in waiting if w.done()]
        assert len(done) == 1
        model, stored, probe = done[0].result()
        assert stored is None and probe is route.probe   # the next probe, alone; the others wait on it
        route.learn({"app": "app", "unknown_for_s": 60.0, "rank": 0, "replicas": 1}, model, route.clock(),
                    BUSY)   # its answer: the rate refuses every unknown name for a minute
        route.probe_done(probe)
        rest = await asyncio.gather(*(w for w in waiting if w is not done[0]))
        assert [stored for _, stored, _ in rest] == [BUSY] * 4 and route.probe is None

    asyncio.run(scenario())


def test_a_name_waits_no_longer_than_probe_wait_s_in_all_then_goes_on():
    async def scenario() -> None:
        route = loaded_route(probe_wait_s=0.05)
        await route.behind_probe("name-0")   # a probe whose answer never comes
        started = route.clock()
        stored, probe = await route.behind_probe("name-1")
        assert stored is None and probe is None and 0.04 <= route.clock() - started < 1.0

    asyncio.run(scenario())
