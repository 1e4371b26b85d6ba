"""The application builder that serve_config.yaml's ``import_path`` names.

``deployments.app:build_app`` receives ``applications[].args`` (validated by ``AppArgs``)
and wires ingress -> workers (routed by ``AdapterAffinityRouter``) and the directory.
"""

from __future__ import annotations

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from .config import AppArgs
from .directory_actor import AdapterDirectoryActor
from .ingress import LoRAFleetIngress
from .worker import LoRAWorker


def build_app(args: dict) -> Application:
    parsed = AppArgs(**(args or {}))
    plain = parsed.model_dump()
    directory = AdapterDirectoryActor.bind()
    worker = LoRAWorker.options(
        max_ongoing_requests=parsed.max_batch_size,  # spill only when a holder's batch is really full
        max_queued_requests=parsed.max_queued_requests,
        request_router_config=RequestRouterConfig(
            request_router_class="routing.ray_router:AdapterAffinityRouter",
            request_router_kwargs={"load_bound_epsilon": parsed.load_bound_epsilon},
            request_routing_stats_period_s=1.0,
        ),
    ).bind(plain, directory)
    return LoRAFleetIngress.bind(plain, worker, directory)
