import pytest

from pool.eviction import (
    FIFOEvictionPolicy,
    LRUEvictionPolicy,
    NoVictimError,
    SIEVEEvictionPolicy,
    get_eviction_policy,
)


def test_lru_victim_is_least_recently_used_candidate():
    p = LRUEvictionPolicy()
    for uid in ["a", "b", "c", "a"]:
        p.mark_used(uid)
    assert p.order() == ["b", "c", "a"]
    assert p.select_victim({"a", "b", "c"}) == "b"
    assert p.select_victim({"a", "c"}) == "c"
    assert p.eviction_count == 2
    assert p.total_accesses == 4


def test_fifo_is_not_refreshed_by_use_and_remove_resets_position():
    p = FIFOEvictionPolicy()
    for uid in ["a", "b", "c", "a", "a"]:
        p.mark_used(uid)
    assert p.order() == ["a", "b", "c"]
    assert p.select_victim({"a", "b", "c"}) == "a"
    p.remove("a")
    p.mark_used("a")  # reloaded: new position at the end
    assert p.order() == ["b", "c", "a"]
    assert p.total_accesses == 6


@pytest.mark.parametrize("name", ["lru", "fifo", "sieve"])
def test_base_model_is_never_tracked_and_chosen_last(name):
    p = get_eviction_policy(name)
    p.mark_used(None)
    p.mark_used("x")
    assert None not in p.order()
    assert p.select_victim({None, "x"}) == "x"
    assert p.select_victim({None}) is None
    assert p.eviction_count == 2


@pytest.mark.parametrize("name", ["lru", "fifo", "sieve"])
def test_no_candidate_is_an_error_not_an_assert(name):
    p = get_eviction_policy(name)
    p.mark_used("a")
    with pytest.raises(NoVictimError):
        p.select_victim({"zzz"})
    assert p.eviction_count == 0


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError) as err:
        get_eviction_policy("random")
    assert "'random'" in str(err.value) and "fifo" in str(err.value) and "lru" in str(err.value)


def test_lru_and_fifo_differ_exactly_where_use_refreshes():
    seq = ["a", "b", "c", "a"]  # a is reused after c
    lru, fifo = LRUEvictionPolicy(), FIFOEvictionPolicy()
    for uid in seq:
        lru.mark_used(uid)
        fifo.mark_used(uid)
    assert lru.select_victim({"a", "b", "c"}) == "b"
    assert fifo.select_victim({"a", "b", "c"}) == "a"
    # without reuse they agree
    lru2, fifo2 = LRUEvictionPolicy(), FIFOEvictionPolicy()
    for uid in ["a", "b", "c"]:
        lru2.mark_used(uid)
        fifo2.mark_used(uid)
    assert lru2.select_victim({"a", "b", "c"}) == fifo2.select_victim({"a", "b", "c"}) == "a"


def test_sieve_keeps_visited_entries_and_evicts_first_unvisited():
    p = SIEVEEvictionPolicy()
    for uid in ["a", "b", "c"]:
        p.mark_used(uid)
    p.mark_used("a")  # visited bit
    assert p.select_victim({"a", "b", "c"}) == "b"  # a is spared, its bit cleared
    p.remove("b")
    p.mark_used("d")
    # hand now at c (unvisited) -> c
    assert p.select_victim({"a", "c", "d"}) == "c"


def test_sieve_skips_non_candidates_without_clearing_them():
    p = SIEVEEvictionPolicy()
    for uid in ["a", "b"]:
        p.mark_used(uid)
    p.mark_used("a")
    p.mark_used("b")
    assert p.select_victim({"b"}) == "b"  # b's bit cleared on pass 1, chosen on pass 2
    assert p._visited["a"] is True
