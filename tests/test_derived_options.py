"""The worker's and ingress's deployment options are derived once, by build_fleet, from AppArgs; a serve config
whose ``deployments:`` section contradicts one fails the deploy, naming both values."""

from __future__ import annotations

import pytest
from conftest import FLEET_ARGS
from fleet_helpers import delete_app
from ray import serve
from ray.serve._private.config import DeploymentConfig

from deployments.config import AppArgs
from deployments.derived_options import (ROUTER, ROUTER_CLASS, DerivedOptionConflict, check_deployment, expected,
                                         graceful_shutdown_s, worker_options)


def test_worker_options_follow_the_args():
    parsed = AppArgs(max_batch_size=5, max_queued_requests=40, request_timeout_s=60, routing={"tie_epsilon": 0.5})
    options = worker_options(parsed)
    assert options["max_ongoing_requests"] == 5 + 1 and options["max_queued_requests"] == 40  # + oldest_queue
    assert options["graceful_shutdown_timeout_s"] == graceful_shutdown_s(60) > 60   # a drain outlasts a request
    assert options[ROUTER].request_router_class == ROUTER_CLASS
    assert options[ROUTER].request_router_kwargs == parsed.router_kwargs() == {"tie_epsilon": 0.5}


def test_an_engine_queue_is_admitted_beyond_the_rows_and_must_fit_the_engine():
    assert worker_options(AppArgs(max_batch_size=8, engine_queue=2))["max_ongoing_requests"] == 11  # + oldest_queue 1
    assert worker_options(AppArgs(max_batch_size=8, routing={"oldest_queue": 0}))["max_ongoing_requests"] == 8
    with pytest.raises(ValueError, match=r"engine_queue \+ routing.oldest_queue \(8 \+ 1\) must not exceed "
                                         r"max_waiting_requests \(8\)"):
        AppArgs(engine_queue=8, max_waiting_requests=8)


def serve_config(**options) -> DeploymentConfig:
    """Serve's own config object, as the replica reads it (``get_replica_context()._deployment_config``)."""
    return DeploymentConfig(**options)


def test_a_config_as_build_fleet_decided_passes():
    options = worker_options(AppArgs(max_batch_size=8))
    check_deployment("LoRAWorker", serve_config(**options), expected(options))
    check_deployment("LoRAWorker", serve_config(max_ongoing_requests=3), None)  # told nothing: nothing to check


def test_a_contradicting_value_fails_naming_both_numbers():
    options = worker_options(AppArgs(max_batch_size=8))
    with pytest.raises(DerivedOptionConflict, match=r"max_ongoing_requests = 16, but build_fleet derives 9 from "
                                                    r"args\.max_batch_size \+ args\.engine_queue \+ "
                                                    r"args\.routing\.oldest_queue"):
        check_deployment("LoRAWorker", serve_config(**{**options, "max_ongoing_requests": 16}), expected(options))
    with pytest.raises(DerivedOptionConflict, match=r"graceful_shutdown_timeout_s = 150.0, but build_fleet derives 130"):
        check_deployment("LoRAWorker", serve_config(**{**options, "graceful_shutdown_timeout_s": 150}),
                         expected(options))


def test_a_router_config_restated_in_part_fails():
    """A ``request_router_config`` in the YAML replaces the whole object: what it leaves out falls to Serve's
    defaults (here the stats period, 10 s), which contradicts what build_fleet set."""
    from ray.serve.config import RequestRouterConfig

    options = worker_options(AppArgs())
    partial = RequestRouterConfig(request_router_class=ROUTER_CLASS, request_router_kwargs=AppArgs().router_kwargs())
    with pytest.raises(DerivedOptionConflict, match="request_routing_stats_period_s = 10, but build_fleet derives 5.0"):
        check_deployment("LoRAWorker", serve_config(**{**options, ROUTER: partial}), expected(options))


def test_serve_refuses_to_start_a_worker_whose_options_contradict_the_derived_ones(ray_cluster):
    """Serve applies a serve config's ``deployments:`` section on top of what build_fleet set; the same happens
    here through ``.options`` after build_fleet's decision, and the replica refuses to start."""
    from deployments.worker import LoRAWorker

    parsed = AppArgs(**FLEET_ARGS)
    decided = worker_options(parsed)
    app = LoRAWorker.options(**{**decided, "max_ongoing_requests": 16, "num_replicas": 1,
                                "ray_actor_options": {"num_cpus": 0}}).bind(parsed.model_dump(), None, expected(decided))
    try:
        with pytest.raises(RuntimeError) as failure:
            serve.run(app, name="contradiction", route_prefix=None)
        assert "LoRAWorker" in str(failure.value)
        message = serve.status().applications["contradiction"].deployments["LoRAWorker"].message  # its traceback
        assert f"max_ongoing_requests = 16, but build_fleet derives {decided['max_ongoing_requests']}" in message
    finally:
        delete_app("contradiction")
