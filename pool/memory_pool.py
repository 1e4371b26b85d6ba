"""LoRAMemoryPool: a fixed number of adapter slots in accelerator memory.

Semantics follow SGLang's ``mem_pool.py`` (see docs/design.md, "The pool"): the base model
(uid ``None``) takes a real, all-zero slot; a batch's adapters are never victims; pinned
adapters are never victims; victims are chosen by the eviction policy, adapters before the
base slot. Every operation checks everything it can before it changes anything, so a
refused call leaves the pool exactly as it was.

Layout: for each target module, ``a_buffers[m]`` is ``[layers, slots, max_rank, in]`` and
``bt_buffers[m]`` is B transposed, ``[layers, slots, max_rank, out]``. Keeping B
transposed makes a rank-r load one contiguous ``[:r]`` copy per module and layer block,
and the engine's second matmul reads a row-major ``[r, out]`` matrix.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Callable, Iterable, Optional

import torch

from .adapter import LoRAAdapterWeights
from .device import default_device
from .errors import (
    AdapterInUseError,
    AdapterNotFoundError,
    BatchTooLargeError,
    NoEvictableSlotError,
    PinRefusedError,
    RankTooLargeError,
)
from .events import PoolCounters, PoolEvent, PoolSnapshot
from .eviction import EvictionPolicy, Uid, get_eviction_policy
from .shapes import LoRAModelShape


class _Empty:
    def __repr__(self) -> str:
        return "EMPTY"


EMPTY = _Empty()  # a free slot; None is a real uid (the base model)

FetchWeights = Callable[[str], LoRAAdapterWeights]
EventListener = Callable[[PoolEvent], None]


def batch_order(uids: Iterable[Uid]) -> list[Uid]:
    """Deterministic order (``None`` first, then sorted) so the same batch always gets the same slots."""
    uids = set(uids)
    return ([None] if None in uids else []) + sorted(u for u in uids if u is not None)


class LoRAMemoryPool:
    def __init__(
        self,
        shape: LoRAModelShape,
        max_loras_per_batch: int,
        max_lora_rank: int,
        fetch_weights: FetchWeights,
        *,
        eviction_policy: str | EvictionPolicy = "lru",
        device: Optional[torch.device | str] = None,
        dtype: torch.dtype = torch.float32,
        replica_id: str = "local",
    ):
        if max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {max_loras_per_batch}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        self.shape = shape
        self.slots = max_loras_per_batch
        self.max_lora_rank = max_lora_rank
        self.device = default_device(device) if not isinstance(device, torch.device) else device
        self.dtype = dtype
        self.replica_id = replica_id
        self._fetch_weights = fetch_weights
        self.eviction_policy = (
            get_eviction_policy(eviction_policy) if isinstance(eviction_policy, str) else eviction_policy
        )
        L, S, R = shape.num_layers, self.slots, max_lora_rank
        self.a_buffers = {
            m: torch.zeros(L, S, R, s.in_features, device=self.device, dtype=dtype) for m, s in shape.modules.items()
        }
        self.bt_buffers = {
            m: torch.zeros(L, S, R, s.out_features, device=self.device, dtype=dtype) for m, s in shape.modules.items()
        }
        self.slot_ranks: list[int] = [0] * S
        self.slot_scalings = torch.zeros(S, device=self.device, dtype=torch.float32)
        self.slot_scale_values: list[float] = [0.0] * S  # host copy: the engine reads it without a device sync
        self.uid_to_slot: dict[Uid, int] = {}
        self.slot_to_uid: list[object] = [EMPTY] * S
        self.pinned: set[str] = set()
        self.kept: frozenset[str] = frozenset()  # evicted only when nothing else can go (the plan places them here)
        self.active: frozenset[Uid] = frozenset()
        self.counters = PoolCounters()
        self._loads_by_uid: Counter = Counter()  # ``counters.loads`` per adapter (dropped when it leaves the replica)
        self.recent_load_seconds: deque[float] = deque(maxlen=4096)  # drained by metrics exporters
        self._seq = 0
        self._listeners: list[EventListener] = []
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ queries

    def get_slot(self, uid: Uid) -> int:
        try:
            return self.uid_to_slot[uid]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {uid!r} is not resident in this pool") from None

    def is_resident(self, uid: Uid) -> bool:
        return uid in self.uid_to_slot

    def free_slots(self) -> int:
        return sum(1 for u in self.slot_to_uid if u is EMPTY)

    def validate_lora_batch(self, uids: Iterable[Uid]) -> bool:
        """Whether a batch with these uids can be prepared without touching pinned slots."""
        uids = set(uids)
        if len(uids) > self.slots:
            return False
        pinned_in_batch = sum(1 for u in uids if u is not None and u in self.pinned)
        return len(uids) - pinned_in_batch <= self.slots - len(self.pinned)

    def loads_by_adapter(self) -> dict[str, int]:
        """Slot loads per adapter on this replica (``counters.loads`` by uid): which adapters thrash here."""
        with self._lock:
            return dict(self._loads_by_uid)

    def snapshot(self) -> PoolSnapshot:
        with self._lock:
            c = self.counters
            return PoolSnapshot(
                replica_id=self.replica_id,
                seq=self._seq,
                slots=self.slots,
                resident={u: s for u, s in self.uid_to_slot.items() if u is not None},
                pinned=frozenset(self.pinned),
                free_slots=self.free_slots(),
                eviction_policy=self.eviction_policy.name,
                counters=PoolCounters(c.hits, c.misses, c.loads, c.evictions, c.unloads, c.load_seconds),
                base_slot=self.uid_to_slot.get(None),
            )

    # ------------------------------------------------------------------ events

    def subscribe(self, listener: EventListener) -> None:
        """Call ``listener`` with every event, in ``seq`` order, under the pool's lock."""
        self._listeners.append(listener)

    def _emit(self, kind: str, uid: str, slot: int) -> None:
        self._seq += 1
        event = PoolEvent(kind, uid, slot, self.replica_id, self._seq, time.time())
        for listener in self._listeners:
            listener(event)

    # ------------------------------------------------------------------ batch

    def prepare_lora_batch(self, cur_uids: Iterable[Uid]) -> dict[Uid, int]:
        """Make every uid in ``cur_uids`` (new | running) resident; return uid -> slot.

        Raises (changing nothing) ``BatchTooLargeError`` if the batch cannot fit beside the
        pinned adapters, and any adapter error from fetching weights.
        """
        order = batch_order(cur_uids)
        # weights are fetched before the lock is taken, so a slow fetch never blocks snapshot()/pin()
        prefetched = {u: self._timed_weights(u) for u in order if u is not None and u not in self.uid_to_slot}
        with self._lock:
            cur = set(order)
            if not self.validate_lora_batch(cur):
                raise BatchTooLargeError(
                    f"batch needs {len(cur)} slots ({sum(1 for u in cur if u in self.pinned)} of them pinned) "
                    f"but the pool has {self.slots} slots with {len(self.pinned)} pinned"
                )
            missing = [u for u in order if u not in self.uid_to_slot]
            fetched = {u: prefetched.get(u) or self._timed_weights(u) for u in missing if u is not None}
            entering = [u for u in order if u is not None and u not in self.active]
            for uid in order:
                if uid not in missing:
                    self.eviction_policy.mark_used(uid)
            for uid in missing:
                # claim first, then mark: a newcomer must not sit in the policy's queue while its
                # own victim is chosen (SIEVE's hand would otherwise land on it)
                slot = self._claim_slot(protected=cur, last=uid is None)
                self.eviction_policy.mark_used(uid)
                if uid is None:
                    self._write_base(slot)
                else:
                    weights, fetch_seconds = fetched[uid]
                    self._load_into(slot, uid, weights, fetch_seconds)
            hits = sum(1 for u in entering if u not in missing)
            self.counters.hits += hits
            self.counters.misses += len(entering) - hits
            self.active = frozenset(cur)
            return {u: self.uid_to_slot[u] for u in order}

    def retain_batch(self, uids: Iterable[Uid]) -> None:
        """The running batch shrank to ``uids`` (finished requests left); the rest become evictable."""
        with self._lock:
            self.active = self.active & frozenset(uids)

    def release_batch(self) -> None:
        """Nothing is running: every unpinned adapter becomes evictable again."""
        with self._lock:
            self.active = frozenset()

    def set_eviction_policy(self, policy: EvictionPolicy) -> None:
        """Switch policies live; residents enter the new one in slot order (their history is not portable)."""
        with self._lock:
            for slot in range(self.slots):
                uid = self.slot_to_uid[slot]
                if uid is not EMPTY:
                    policy.mark_used(uid)
            self.eviction_policy = policy

    def keep(self, uids: Iterable[str]) -> None:
        """Adapters to evict last: a victim is chosen among the others first (the policy's order), and
        among these only when no other adapter can go. Unlike a pin it holds no slot and refuses nothing;
        the worker keeps what the fleet's placement plan puts on this replica, so traffic the plan could
        not place churns the remaining slots instead of evicting placements that will be asked for again."""
        with self._lock:
            self.kept = frozenset(u for u in uids if u is not None)

    def load(self, uid: str) -> int:
        """Load ``uid`` into a slot outside any batch (a warm-up or a plan's read-ahead); return its slot.

        Why a call of its own: warming a replica used to send a one-token request only to get an
        adapter into a slot. Like ``pin``, the slot is an empty one, else the policy's victim among
        adapters that are neither in the running batch nor pinned; a refusal changes nothing. It counts
        as a load (``counters.loads``), never as a hit or a miss: no request asked for it.
        """
        if uid is None:
            raise ValueError("the base model (uid None) is loaded by the batches that use it")
        weights = None if uid in self.uid_to_slot else self._timed_weights(uid)  # fetched before the lock
        with self._lock:
            if uid in self.uid_to_slot:
                self.eviction_policy.mark_used(uid)
                return self.uid_to_slot[uid]
            return self._load_outside_batch(uid, *(weights or self._timed_weights(uid)))

    # ------------------------------------------------------------------ pinning

    def pin(self, uid: str) -> int:
        """Load (if needed) and pin ``uid``; return its slot.

        At most ``slots - 1`` adapters may be pinned, so unpinned adapters never starve.
        """
        if uid is None:
            raise ValueError("the base model (uid None) cannot be pinned")
        with self._lock:
            if uid in self.pinned:
                return self.uid_to_slot[uid]
            if len(self.pinned) >= self.slots - 1:
                raise PinRefusedError(
                    f"cannot pin {uid!r}: {len(self.pinned)} of {self.slots} slots are pinned and at least one "
                    f"slot must stay unpinned so other adapters can run"
                )
            if uid not in self.uid_to_slot:
                self._load_outside_batch(uid, *self._timed_weights(uid))
            self.pinned.add(uid)
            slot = self.uid_to_slot[uid]
            self._emit("pin", uid, slot)
            return slot

    def unpin(self, uid: str) -> bool:
        """Unpin ``uid``; returns whether it was pinned. Unknown uids are an error."""
        with self._lock:
            if uid not in self.uid_to_slot:
                raise AdapterNotFoundError(f"adapter {uid!r} is not resident in this pool")
            if uid not in self.pinned:
                return False
            self.pinned.discard(uid)
            self._emit("unpin", uid, self.uid_to_slot[uid])
            return True

    # ------------------------------------------------------------------ unload

    def remove(self, uid: str) -> bool:
        """Unload ``uid`` from its slot; returns whether it was resident.

        Refused while the current batch uses it: the caller waits for in-flight requests.
        """
        with self._lock:
            if uid in self.active:
                raise AdapterInUseError(f"adapter {uid!r} is used by the running batch; unload it when the batch ends")
            self._loads_by_uid.pop(uid, None)
            slot = self.uid_to_slot.get(uid)
            if slot is None:
                return False
            self.pinned.discard(uid)
            self._free(slot, uid)
            self.counters.unloads += 1
            self._emit("unload", uid, slot)
            return True

    # ------------------------------------------------------------------ internals

    def _timed_weights(self, uid: str) -> tuple[LoRAAdapterWeights, float]:
        started = time.perf_counter()
        weights = self._checked_weights(uid)
        return weights, time.perf_counter() - started

    def _checked_weights(self, uid: str) -> LoRAAdapterWeights:
        weights = self._fetch_weights(uid)
        if weights.rank > self.max_lora_rank:
            raise RankTooLargeError(weights.name, weights.rank, self.max_lora_rank)
        return weights

    def _load_outside_batch(self, uid: str, weights: LoRAAdapterWeights, fetch_seconds: float) -> int:
        """Called with the lock held: claim a slot the running batch does not use, then load ``uid``."""
        slot = self._claim_slot(protected=self.active | {uid})
        self.eviction_policy.mark_used(uid)
        self._load_into(slot, uid, weights, fetch_seconds)
        return slot

    def _claim_slot(self, protected: frozenset[Uid] | set[Uid], last: bool = False) -> int:
        """An empty slot (the first; the last with ``last``), else the policy's victim among unprotected, unpinned
        residents. The base model takes the last empty slot: its rows do no LoRA work, and in the first one it would
        split the adapters' slots into two runs, which a CPU decode step's LoRA runs as two ``bmm`` pairs per module
        instead of one (``engine.lora_padded``)."""
        order = range(self.slots - 1, -1, -1) if last else range(self.slots)
        for slot in order:
            if self.slot_to_uid[slot] is EMPTY:
                return slot
        candidates = {u for u in self.uid_to_slot if u not in protected and u not in self.pinned}
        if not candidates:
            raise NoEvictableSlotError(
                f"all {self.slots} slots hold pinned adapters or adapters of the running batch"
            )
        unkept = {u for u in candidates if u is not None and u not in self.kept}
        victim = self.eviction_policy.select_victim(unkept or candidates)
        slot = self.uid_to_slot[victim]
        self._free(slot, victim)
        if victim is not None:
            self.counters.evictions += 1
            self._emit("evict", victim, slot)
        return slot

    def _free(self, slot: int, uid: Uid) -> None:
        del self.uid_to_slot[uid]
        self.slot_to_uid[slot] = EMPTY
        self.eviction_policy.remove(uid)

    def _write_base(self, slot: int) -> None:
        old = self.slot_ranks[slot]
        if old:
            for m in self.a_buffers:
                self.a_buffers[m][:, slot, :old].zero_()
                self.bt_buffers[m][:, slot, :old].zero_()
        self.slot_ranks[slot] = 0
        self.slot_scalings[slot] = 0.0
        self.slot_scale_values[slot] = 0.0
        self.uid_to_slot[None] = slot
        self.slot_to_uid[slot] = None

    def _load_into(self, slot: int, uid: str, weights: LoRAAdapterWeights, fetch_seconds: float) -> None:
        """Copy A into ``[:r]`` and B into ``[:r]`` (transposed); zero what the adapter lacks."""
        started = time.perf_counter()
        r, old = weights.rank, self.slot_ranks[slot]
        for m, a_buf in self.a_buffers.items():
            bt_buf = self.bt_buffers[m]
            if m in weights.a:
                a_buf[:, slot, :r].copy_(weights.a[m], non_blocking=True)
                bt_buf[:, slot, :r].copy_(weights.bt[m], non_blocking=True)
                if old > r:
                    a_buf[:, slot, r:old].zero_()
                    bt_buf[:, slot, r:old].zero_()
            else:  # a module the adapter lacks must not keep the previous adapter's weights
                a_buf[:, slot, : max(r, old)].zero_()
                bt_buf[:, slot, : max(r, old)].zero_()
        self.slot_ranks[slot] = r
        self.slot_scalings[slot] = weights.scaling
        self.slot_scale_values[slot] = weights.scaling
        self.uid_to_slot[uid] = slot
        self.slot_to_uid[slot] = uid
        seconds = fetch_seconds + (time.perf_counter() - started)
        self.counters.loads += 1
        self._loads_by_uid[uid] += 1
        self.counters.load_seconds += seconds
        self.recent_load_seconds.append(seconds)
        self._emit("load", uid, slot)
