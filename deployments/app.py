"""The application builder that serve_config.yaml's ``import_path`` names.

``deployments.app:build_app`` receives ``applications[].args`` (validated by ``AppArgs``)
and wires ingress -> workers (routed by ``AdapterAffinityRouter``) and the directory.
"""

from __future__ import annotations

from typing import Optional

from ray.serve import Application

from routing.ray_router import check_router_kwargs

from .config import AppArgs
from . import derived_options as derived
from .directory_actor import AdapterDirectoryActor
from .ingress import LoRAFleetIngress
from .quota_lease_actor import QuotaLeaseActor
from .worker import LoRAWorker


def build_app(args: dict) -> Application:
    return build_fleet(AppArgs(**(args or {})))


def build_fleet(parsed: AppArgs, worker_options: Optional[dict] = None, ingress_options: Optional[dict] = None,
                directory_options: Optional[dict] = None) -> Application:
    """The application graph. Every deployment option derivable from ``parsed`` is set here (``derived_options``); the
    overrides replace LoRAWorker's / the ingress's / the directory's options (tests, benchmarks). Each
    deployment is told what was decided and refuses to start when a serve config's ``deployments:``
    section changed a derived option."""
    plain = parsed.model_dump()
    directory = AdapterDirectoryActor.options(**(directory_options or {})).bind(routing=parsed.routing.changed())
    worker_opts = {**derived.worker_options(parsed), **(worker_options or {})}
    check_router_kwargs(worker_opts[derived.ROUTER].request_router_kwargs)
    worker = LoRAWorker.options(**worker_opts).bind(plain, directory, derived.expected(worker_opts))
    quota_leases = QuotaLeaseActor.bind(parsed.quota_lease_batch, parsed.quota_lease_ttl_s, parsed.quota_recall_wait_s)
    ingress_opts = {**derived.ingress_options(parsed), **(ingress_options or {})}
    return LoRAFleetIngress.options(**ingress_opts).bind(plain, worker, directory, quota_leases,
                                                          derived.expected(ingress_opts))
