"""README.md's configuration table is AppArgs' field docstrings, rendered (``python -m deployments.config_table``)."""

from __future__ import annotations

from typing import Optional

import pytest
from pydantic import BaseModel, ConfigDict

from deployments.config import AppArgs
from deployments.config_table import README, UndocumentedSetting, render_readme, rows


def test_readme_table_is_current():
    text = README.read_text(encoding="utf-8")
    assert render_readme(text) == text, "README.md's configuration table is stale: run `python -m deployments.config_table`"


def test_every_setting_has_a_row():
    assert [name for name, _, _ in rows(AppArgs)] == list(AppArgs.model_fields)


class Inner(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    spread: float = 0.5
    """how far it spreads"""


class Outer(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    inner: Inner = Inner()
    size_bytes: int = 3 << 20
    """how big"""
    path: Optional[str] = None
    """where | when"""


def test_nested_settings_render_under_their_parent_and_values_read_plainly():
    assert list(rows(Outer)) == [("inner.spread", "0.5", "how far it spreads"), ("size_bytes", "3 MiB", "how big"),
                                 ("path", "unset", "where \\| when")]


def test_a_setting_without_a_docstring_is_refused():
    class Bare(BaseModel):
        knob: int = 1

    with pytest.raises(UndocumentedSetting, match="Bare.knob has no docstring"):
        list(rows(Bare))
