"""The deployment options ``build_fleet`` derives from ``AppArgs``, written here and nowhere else.

A LoRAWorker admits as many requests as its engine batches (``max_ongoing_requests`` =
``max_batch_size``: spill to another replica only when a holder's batch is really full), plus
``engine_queue`` that wait in its engine in arrival order (0 by default), plus ``routing.oldest_queue``
places in that queue that routers keep for the fleet's oldest request waiting for the replica (1), drains as
long as a request may run (``graceful_shutdown_timeout_s`` = ``request_timeout_s`` + a margin), and is
routed by ``AdapterAffinityRouter``. Serve lets a serve config's ``deployments:`` section override any
option the code set, so a copy there could silently disagree with the args it was derived from. The
YAMLs therefore leave these out, and each deployment checks, as it starts, that what Serve gave it is
what ``build_fleet`` decided (``check_deployment``): a contradiction fails the deploy naming both values.

No Ray import at module level: ``manifests/render.py`` reads the drain from here too.
"""

from __future__ import annotations

from typing import Any, Optional

DRAIN_MARGIN_S = 10.0  # beyond request_timeout_s, for a replica's goodbye and the drain itself
ROUTER_CLASS = "routing.ray_router:AdapterAffinityRouter"
# a repair path beside the directory feed: each period the controller collects every replica's
# stats and pushes them to every router, which costs each of them CPU (measured: ~7 ms a push)
ROUTING_STATS_PERIOD_S = 5.0
DRAINED_DEPLOYMENTS = ("LoRAWorker", "LoRAFleetIngress")  # they hold requests: a drain must outlast one
ROUTER = "request_router_config"
# each derived option -> where its value comes from (what the error tells a user to change instead)
DERIVED_FROM = {
    "max_ongoing_requests": "args.max_batch_size + args.engine_queue + args.routing.oldest_queue",
    "max_queued_requests": "args.max_queued_requests",
    "graceful_shutdown_timeout_s": f"args.request_timeout_s + {DRAIN_MARGIN_S:g} s",
    f"{ROUTER}.request_router_class": "build_fleet (the adapter-affinity router)",
    f"{ROUTER}.request_router_kwargs": "AppArgs.router_kwargs()",
    f"{ROUTER}.request_routing_stats_period_s": "deployments.derived_options.ROUTING_STATS_PERIOD_S",
}


class DerivedOptionConflict(ValueError):
    """A serve config's ``deployments:`` section set an option ``build_fleet`` derives, to another value."""


def graceful_shutdown_s(request_timeout_s: float) -> float:
    """How long Serve lets a stopping replica finish: the longest request it may have admitted, plus the margin."""
    return request_timeout_s + DRAIN_MARGIN_S


def worker_options(parsed) -> dict:
    """LoRAWorker's derived deployment options for ``parsed`` (an ``AppArgs``)."""
    from ray.serve.config import RequestRouterConfig

    return {
        "max_ongoing_requests": parsed.max_batch_size + parsed.engine_queue + parsed.routing.oldest_queue,
        "max_queued_requests": parsed.max_queued_requests,
        "graceful_shutdown_timeout_s": graceful_shutdown_s(parsed.request_timeout_s),
        ROUTER: RequestRouterConfig(request_router_class=ROUTER_CLASS, request_router_kwargs=parsed.router_kwargs(),
                                    request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
    }


def ingress_options(parsed) -> dict:
    """The ingress's derived deployment options: it waits for the workers' answers, so it drains as long."""
    return {"graceful_shutdown_timeout_s": graceful_shutdown_s(parsed.request_timeout_s)}


def _read(options: Any, path: str) -> Any:
    """``path`` ("a" or "a.b") of an options dict or of Serve's ``DeploymentConfig``; None where it is unset."""
    value = options
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
        if value is None:
            return None
    return value


def expected(options: dict) -> dict[str, Any]:
    """The derived options as ``build_fleet`` finally set them (its callers may override some), as plain values
    keyed by path: what the deployment checks its own config against when it starts."""
    return {path: _read(options, path) for path in DERIVED_FROM if _read(options, path) is not None}


def check_deployment(deployment: str, config: Any, wanted: Optional[dict[str, Any]]) -> None:
    """Fail the deploy when Serve's config for ``deployment`` (its ``DeploymentConfig``) differs from ``wanted``
    (``expected`` of build_fleet's options) in a derived option: a serve config restated it with another value."""
    for path, value in (wanted or {}).items():
        actual = _read(config, path)
        if actual != value:
            raise DerivedOptionConflict(
                f"{deployment}: the serve config's deployments: section sets {path} = {actual!r}, but build_fleet "
                f"derives {value!r} from {DERIVED_FROM[path]}; delete {path.split('.')[0]} from the deployments: "
                f"section (build_fleet sets it) or change what it is derived from")
