"""Plan-driven prefetch decisions and plan-move accounting (pure)."""

from __future__ import annotations

from routing.plan import PlacementPlan, holder_moves, planned_on
from routing.prefetch import Prefetch, prefetches


def test_only_new_holders_read_ahead_and_only_free_slots_are_filled():
    out = prefetches(["a", "b", "c", "d"], before={"a"}, resident={"b"}, staged={"d"}, free_slots=1)
    assert out == [Prefetch("c", True)]  # d is staged already and no slot is left for it
    assert prefetches(["c", "d"], before=(), resident=(), staged=(), free_slots=0) == \
        [Prefetch("c", False), Prefetch("d", False)]
    assert prefetches(["c", "d"], before=(), resident=(), staged={"c", "d"}, free_slots=2) == \
        [Prefetch("c", True), Prefetch("d", True)]
    assert prefetches(["a"], before={"a"}, resident=(), staged=(), free_slots=4) == []


def test_moves_count_holders_added_to_placed_adapters():
    old = PlacementPlan(1, {"a": ("r1",), "b": ("r1", "r2")})
    new = PlacementPlan(2, {"a": ("r2",), "b": ("r1", "r2", "r3"), "c": ("r3",)})
    assert holder_moves(old, new) == {"a": 1, "b": 1}  # c's first placement is no move
    assert planned_on(new, "r3") == ["b", "c"] and planned_on(new, "r9") == []
