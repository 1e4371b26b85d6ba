"""The simulator's settings and its request record (shared by the event loop and the routers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from routing.settings import DEFAULT_SETTINGS, RoutingSettings

from .costs import CostModel


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 8
    router: str = "affinity"
    slots: int = 8                  # max_loras_per_batch
    max_batch: int = 16             # running requests per replica = max_ongoing_requests
    max_lora_rank: int = 64
    eviction_policy: str = "lru"
    lag_s: float = 0.1              # pool event -> router view
    model_id_delay_s: Optional[float] = None  # multiplexing: a model-id push -> the routers have it (None: lag_s)
    paced_feed: bool = False        # the view router polls as live (feed.PollPacing), not every lag_s
    load_bound_epsilon: float = 0.25
    routing_tasks_per_replica: int = 2  # Serve routes at most this many waiting requests per replica at once
    routing_tasks_min: int = DEFAULT_SETTINGS.max_routing_tasks  # ... and the affinity router asks for at least this many
    optimistic_ttl_s: float = 3.0   # the router's default
    multiplex_timeout_s: float = 1.0  # Serve's RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S (x U(1, 2))
    backoff_initial_s: float = 0.025
    backoff_max_s: float = 0.5
    warmup_fraction: float = 0.25   # requests (by arrival) left out of the statistics
    max_bypass_steps: int = 16
    seed: int = 0
    costs: CostModel = field(default_factory=CostModel)
    prior_load_s: Optional[tuple[float, float]] = None  # affinity's (host, disk) load priors; None: from costs
    prior_request_s: Optional[float] = None             # affinity's request-time prior; None: from costs
    dispatch_s: float = 0.0         # the router's send -> the replica has it (Serve's handle call)
    read_threads: Optional[int] = None  # disk reads at once per product worker (its to_thread executor); None: any
    replica_id_seed: Optional[int] = None  # None: replica-0000...; else random ids as Serve draws them (ensembles)
    replica_ids: Optional[tuple[str, ...]] = None  # the live run's replica ids (fleet_replay); overrides the above
    adapter_names: Optional[str] = None  # format of adapter i's name, e.g. "demo-{}"; None: traces.adapter_uid
    routing: RoutingSettings = DEFAULT_SETTINGS  # the affinity router's and the plan's settings (as a live app's)
    host_standby_share: float = 0.5  # AppArgs.host_standby_share: plan-following replicas' standby copies at deploy


class SimRequest:
    """One request through the fleet; ``num_tokens`` and ``num_computed`` are what ``engine.scheduler``
    reads of a sequence (prompt plus tokens generated; leading tokens whose K/V are computed)."""

    __slots__ = ("i", "uid", "arrival", "in_len", "out_len", "rank", "blocked_steps", "attempt", "replica",
                 "t_dispatch", "t_submit", "t_admit", "t_first", "t_done", "loaded", "load_s", "disk",
                 "mux_start", "mux_tried_first", "mux_tried_fewest", "waiting", "num_computed", "generated", "kind")

    def __init__(self, i: int, uid: str, arrival: float, in_len: int, out_len: int, rank: int):
        self.i, self.uid, self.arrival, self.in_len, self.out_len, self.rank = i, uid, arrival, in_len, out_len, rank
        self.blocked_steps = 0
        self.attempt = 0
        self.replica = -1
        self.t_dispatch = self.t_submit = self.t_admit = self.t_first = self.t_done = 0.0
        self.num_computed = 0
        self.generated = 0
        self.loaded = self.disk = False
        self.load_s = 0.0
        self.mux_start: Optional[float] = None
        self.mux_tried_first = self.mux_tried_fewest = False
        self.waiting = False  # in the fleet's queue of requests waiting for capacity
        self.kind = ""  # the routing decision that placed it (affinity, spill, placement, ...; routers that say)

    @property
    def num_tokens(self) -> int:
        return self.in_len + self.generated
