"""Random operation sequences against LoRAMemoryPool; invariants hold after every step."""

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pool.errors import LoRAFleetError
from pool.memory_pool import EMPTY

from pool_helpers import check_invariants, make_pool, pool_state

NAMES = list("ABCDEFGH")
UIDS = st.sampled_from([None, *NAMES, "unknown"])


class PoolMachine(RuleBasedStateMachine):
    @initialize(slots=st.integers(1, 5), policy=st.sampled_from(["lru", "fifo", "sieve"]))
    def setup(self, slots, policy):
        self.pool, self.bank = make_pool(slots=slots, names=NAMES, policy=policy,
                                         ranks={n: 1 + i % 4 for i, n in enumerate(NAMES)})
        self.slots = slots

    def _attempt(self, op, *args):
        """Run op; if it is refused, the pool must be exactly as before."""
        before = pool_state(self.pool)
        try:
            return op(*args), True
        except LoRAFleetError:
            assert pool_state(self.pool) == before
            return None, False
        except ValueError:  # pinning the base model
            assert pool_state(self.pool) == before
            return None, False

    @rule(uids=st.sets(UIDS, max_size=6), keep_running=st.booleans())
    def prepare(self, uids, keep_running):
        cur = set(uids) | (set(self.pool.active) if keep_running else set())
        valid = self.pool.validate_lora_batch(cur) and "unknown" not in cur
        evictable_unkept = {u for u in self.pool.uid_to_slot if u is not None and u not in cur
                            and u not in self.pool.pinned and u not in self.pool.kept}
        kept_before = {u for u in self.pool.kept if self.pool.is_resident(u)}
        result, ok = self._attempt(self.pool.prepare_lora_batch, cur)
        assert ok == valid
        if ok and any(not self.pool.is_resident(u) for u in kept_before - cur):
            # a kept adapter went: then no adapter that was not kept could have gone instead
            assert not any(self.pool.is_resident(u) for u in evictable_unkept)
        if ok:
            assert set(result) == cur
            assert self.pool.active == frozenset(cur)
            for uid, slot in result.items():
                assert self.pool.slot_to_uid[slot] == uid
                if uid is not None:
                    w = self.bank.weights[uid]
                    for m in w.a:
                        assert torch.equal(self.pool.a_buffers[m][:, slot, : w.rank].cpu(), w.a[m])  # CUDA pool, host bank

    @rule()
    def release(self):
        self.pool.release_batch()

    @rule(uid=UIDS)
    def pin(self, uid):
        was_pinned = uid in self.pool.pinned
        _, ok = self._attempt(self.pool.pin, uid)
        if ok:
            assert uid in self.pool.pinned
        elif uid is not None and uid != "unknown" and not was_pinned and len(self.pool.pinned) < self.slots - 1:
            # refused only for lack of an evictable slot
            evictable = [u for u in self.pool.uid_to_slot if u not in self.pool.active and u not in self.pool.pinned]
            assert not evictable and EMPTY not in self.pool.slot_to_uid

    @rule(uid=UIDS)
    def load(self, uid):
        """A load outside any batch (warm-up): refused only for the base model, an unknown uid, or when every
        slot holds the running batch's or a pinned adapter; it never touches the batch or counts a hit."""
        was_resident, active = self.pool.is_resident(uid), self.pool.active
        counters = self.pool.snapshot().counters
        room = EMPTY in self.pool.slot_to_uid or any(u not in active and u not in self.pool.pinned
                                                      for u in self.pool.uid_to_slot)
        slot, ok = self._attempt(self.pool.load, uid)
        assert ok == (uid is not None and uid != "unknown" and (was_resident or room))
        assert self.pool.active == active
        after = self.pool.snapshot().counters
        assert (after.hits, after.misses) == (counters.hits, counters.misses)
        if ok:
            assert self.pool.slot_to_uid[slot] == uid
            assert after.loads == counters.loads + (not was_resident)

    @rule(uid=UIDS)
    def unpin(self, uid):
        _, ok = self._attempt(self.pool.unpin, uid)
        if ok:
            assert uid not in self.pool.pinned

    @rule(uids=st.sets(st.sampled_from(NAMES), max_size=5))
    def keep(self, uids):
        """Kept adapters change only which victim goes first: validity and refusals stay the same (the
        ``prepare`` rule checks them), and a victim is never kept while an unkept adapter could go."""
        self.pool.keep(uids)
        assert self.pool.kept == frozenset(uids)

    @rule(uid=UIDS)
    def unload(self, uid):
        active = uid in self.pool.active
        _, ok = self._attempt(self.pool.remove, uid)
        assert ok != active
        if ok:
            assert not self.pool.is_resident(uid)

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "pool"):
            check_invariants(self.pool)
            snap = self.pool.snapshot()
            assert snap.free_slots + len(snap.resident) + (snap.base_slot is not None) == self.slots


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
