"""AppArgs is the one source of settings: the engine's config and the router's kwargs derive from it."""

from __future__ import annotations

from dataclasses import fields

import pytest
from pydantic import ValidationError

from deployments.config import AppArgs
from engine.config import EngineConfig
from routing.ray_router import check_router_kwargs

pytestmark = pytest.mark.unit


def test_engine_config_takes_every_value_from_app_args():
    args = AppArgs(max_loras_per_batch=7, max_batch_size=5, max_tokens_limit=99, max_bypass_steps=3,
                   eviction_policy="fifo", dtype="bfloat16", target_modules=["q_proj", "v_proj"])
    config = args.engine_config("r1")
    for f in fields(EngineConfig):
        if f.name == "replica_id":
            assert config.replica_id == "r1"
        elif f.name == "target_modules":
            assert config.target_modules == ("q_proj", "v_proj")
        else:
            assert getattr(config, f.name) == getattr(args, f.name), f.name


def test_engine_config_has_no_defaults_of_its_own():
    with pytest.raises(TypeError):
        EngineConfig(base_model="demo")  # type: ignore[call-arg]


@pytest.mark.parametrize("field,value", [("dtype", "float8"), ("device", "tpu"), ("eviction_policy", "random"),
                                         ("max_batch_sise", 4)])
def test_bad_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError) as err:
        AppArgs(**{field: value})
    assert field in str(err.value)


def test_router_kwargs_from_app_args_are_accepted():
    kwargs = AppArgs(routing={"tie_epsilon": 0.5, "grow_after_s": 10}).router_kwargs()
    assert kwargs == {"tie_epsilon": 0.5, "grow_after_s": 10}
    check_router_kwargs(kwargs)


def test_misspelt_router_kwarg_is_refused_naming_it():
    with pytest.raises(ValueError, match="tie_epsilom"):
        check_router_kwargs({"tie_epsilom": 0.5})


def test_misspelt_or_out_of_range_routing_setting_fails_the_app_args():
    with pytest.raises(ValidationError, match="tie_epsilom"):
        AppArgs(routing={"tie_epsilom": 0.5})
    with pytest.raises(ValidationError, match="target_utilization"):
        AppArgs(routing={"target_utilization": 1.5})
