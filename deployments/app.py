"""The application builder that serve_config.yaml's ``import_path`` names.

``deployments.app:build_app`` receives ``applications[].args`` (validated by ``AppArgs``)
and wires ingress -> workers (routed by ``AdapterAffinityRouter``) and the directory.
"""

from __future__ import annotations

from typing import Optional

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from routing.ray_router import check_router_kwargs

from .config import AppArgs
from .directory_actor import AdapterDirectoryActor
from .ingress import LoRAFleetIngress
from .quota_lease_actor import QuotaLeaseActor
from .worker import LoRAWorker

DRAIN_MARGIN_S = 10.0  # beyond request_timeout_s, for a replica's goodbye and the drain itself


def build_app(args: dict) -> Application:
    return build_fleet(AppArgs(**(args or {})))


def build_fleet(parsed: AppArgs, worker_options: Optional[dict] = None,
                ingress_options: Optional[dict] = None, directory_options: Optional[dict] = None) -> Application:
    """The application graph; ``worker_options`` / ``ingress_options`` / ``directory_options`` override
    LoRAWorker's / the ingress's / the directory's deployment options (tests, scripts)."""
    plain = parsed.model_dump()
    directory = AdapterDirectoryActor.options(**(directory_options or {})).bind(routing=parsed.routing.changed())
    drain = dict(graceful_shutdown_timeout_s=parsed.request_timeout_s + DRAIN_MARGIN_S)  # finish what was admitted
    options = dict(
        **drain,
        max_ongoing_requests=parsed.max_batch_size,  # spill only when a holder's batch is really full
        max_queued_requests=parsed.max_queued_requests,
        request_router_config=RequestRouterConfig(
            request_router_class="routing.ray_router:AdapterAffinityRouter",
            request_router_kwargs=parsed.router_kwargs(),
            # a repair path beside the directory feed: each period the controller collects every replica's
            # stats and pushes them to every router, which costs each of them CPU (measured: ~7 ms a push)
            request_routing_stats_period_s=5.0,
        ),
    )
    options.update(worker_options or {})
    check_router_kwargs(options["request_router_config"].request_router_kwargs)
    worker = LoRAWorker.options(**options).bind(plain, directory)
    quota_leases = QuotaLeaseActor.bind(parsed.quota_lease_batch, parsed.quota_lease_ttl_s, parsed.quota_recall_wait_s)
    return LoRAFleetIngress.options(**{**drain, **(ingress_options or {})}).bind(plain, worker, directory,
                                                                                  quota_leases)
