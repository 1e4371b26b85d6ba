"""Every routing tunable lives in ``RoutingSettings``: typed, bounded, one unit each, documented from itself."""

from dataclasses import fields
from pathlib import Path

import pytest

from routing.settings import DEFAULT_SETTINGS, FEED, PLAN, POLICY, RoutingSettings, markdown_table

UNITS = {"s", "count", "share", "row waits", "request times", "replicas", "factor", "s per token"}
DOC = Path(__file__).resolve().parents[1] / "docs" / "routing_settings.md"


def test_every_setting_has_one_known_unit_a_group_and_a_doc():
    for f in fields(RoutingSettings):
        assert f.metadata["unit"] in UNITS, f.name
        assert f.metadata["group"] in (POLICY, FEED, PLAN), f.name
        assert len(f.metadata["doc"]) > 10, f.name
        assert f.name.endswith("_s") == (f.metadata["unit"] == "s"), f"{f.name}: seconds and only seconds end in _s"


def test_unknown_names_are_refused_naming_them_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown routing settings \['tie_epsilom'\].*tie_epsilon"):
        RoutingSettings.from_mapping({"tie_epsilom": 1.0})


@pytest.mark.parametrize("name,value,needle", [
    ("tie_epsilon", -0.1, ">= 0"), ("poll_timeout_s", 0.0, "> 0"), ("target_utilization", 1.5, "<= 1"),
    ("candidate_width", 0, ">= 1"), ("spill_headroom", 1.5, "whole count"), ("grow_after_s", "5", "number"),
])
def test_out_of_range_values_are_refused_naming_the_setting_and_the_bound(name, value, needle):
    with pytest.raises(ValueError, match=name) as err:
        RoutingSettings.from_mapping({name: value})
    assert needle in str(err.value)


def test_busy_hysteresis_must_not_be_inverted():
    with pytest.raises(ValueError, match="busy_below"):
        RoutingSettings(busy_above=0.5, busy_below=0.7)


def test_changed_carries_only_what_differs_and_rebuilds_the_same_settings():
    s = RoutingSettings(tie_epsilon=1.0, grow_after_s=2.0)
    assert s.changed() == {"tie_epsilon": 1.0, "grow_after_s": 2.0}
    assert RoutingSettings.from_mapping(s.changed()) == s
    assert DEFAULT_SETTINGS.changed() == {}


def test_the_reference_table_is_generated_and_current():
    table = markdown_table()
    for f in fields(RoutingSettings):
        assert f"| `{f.name}` |" in table
    assert DOC.read_text() == table, "regenerate: python -m routing.settings --write docs/routing_settings.md"
