"""benchmarks.gpu_check runs where no GPU is: it parses, reports its preflight, and leaves every GPU goal unjudged."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA path is what gpu_check itself runs")
def test_without_cuda_it_skips_cleanly_and_judges_nothing(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA device visible" in printed and "missing required: none" in printed
    goals = json.loads(out.read_text())["goals"]
    assert [g["name"] for g in goals] == list(gpu_check.GOAL_NAMES)
    assert all(g["pass"] is None and g["measured"] is None for g in goals)


def test_goals_are_judged_from_what_ran():
    big = {"decode_b64": {"step_over_gemms": 1.7}, "long_prompts": {"finished": gpu_check.LONG_PROMPTS}}
    goals = gpu_check.judge({"failed": 0}, {"max_logit_diff": 0.02, "greedy_equal": 11, "requests": 12}, big)
    assert [g["pass"] for g in goals] == [True, True, False, False, True]
    assert goals[2]["measured"] == pytest.approx(11 / 12)


def test_the_cuda_test_files_exist_and_missing_modules_are_named():
    from pathlib import Path

    root = Path(gpu_check.__file__).resolve().parent.parent
    assert all((root / f).is_file() for f in gpu_check.CUDA_TESTS)
    assert gpu_check.missing_modules(["torch", "no_such_module_here"]) == ["no_such_module_here"]
