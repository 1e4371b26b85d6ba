"""Discrete-event fleet simulator for ``benchmarks.cluster_sim``.

The simulated replicas run the project's own code: ``pool.memory_pool.LoRAMemoryPool``
(no tensors) for slots and eviction, ``engine.scheduler.Scheduler`` for admission,
``routing.directory.AdapterDirectory`` fed by the pools' events after a lag, and
``routing.view.RouterView`` + ``routing.router_state.LocalRouterState`` +
``routing.policy.choose_replicas`` for "our" router. Costs (disk read, slot copy, prefill,
decode) are ``costs.CostModel``'s, charged where the engine pays them (``replica``: the
same time model ``benchmarks/live/emulated.py`` sleeps); the baseline routers in ``routers``
are small implementations of other systems' logic, for comparison. ``fleet_replay`` replays
a ``fleet_live`` run on this simulator and ``fleet_agreement`` judges the match.
``cpu_fleet`` is ``routing_live``'s own setup (closed-loop clients, CPU-bound engines and
control plane on shared cores: a different time model on the same ``events.EventLoop``) and ``live_check``
compares it with a live run. ``fleet_bound`` is the lower bound on loads no router can beat;
``scale_events`` adds and removes replicas mid-run (cold or warm-started), ``autoscale`` drives
the replica count with ``routing.autoscale``'s rules; ``scale_scenario``, ``autoscale_scenario``
and ``elastic_runs`` are cluster_sim's experiments on them.
"""

from .costs import CostModel
from .fleet import SimConfig, SimResult, Simulator, run_sim
from .routers import ROUTERS

__all__ = ["CostModel", "SimConfig", "SimResult", "Simulator", "run_sim", "ROUTERS"]
