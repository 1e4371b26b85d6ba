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
    paths = {"attention": {"intended": "flashinfer", "used": "flashinfer"},
             "cuda_graphs": {"intended": "cuda_graphs", "used": "torch"},   # tried, failed its check
             "cpu_gemm": {"intended": "torch", "used": "torch"}}            # never tried on CUDA
    big = {"decode_b64": {"step_over_gemms": 1.7}, "long_prompts": {"finished": gpu_check.LONG_PROMPTS},
           "lora_compiles_after_ready": 2, "fast_paths": paths}
    goals = gpu_check.judge({"failed": 0}, {"max_logit_diff": 0.02, "greedy_equal": 11, "requests": 12}, big)
    assert [g["pass"] for g in goals] == [True, True, False, False, True, False, False]
    assert goals[-1]["measured"] == 1
    unread = gpu_check.judge(None, None, {**big, "lora_compiles_after_ready": None})
    assert unread[-2]["pass"] is None and unread[-3]["pass"] is True  # a Triton whose caches it cannot read
    assert goals[2]["measured"] == pytest.approx(11 / 12)


def test_the_cuda_test_files_exist_and_missing_modules_are_named():
    from pathlib import Path

    root = Path(gpu_check.__file__).resolve().parent.parent
    assert all((root / f).is_file() for f in gpu_check.CUDA_TESTS)
    assert gpu_check.missing_modules(["torch", "no_such_module_here"]) == ["no_such_module_here"]



def test_compiled_lora_variants_reads_tritons_kernel_caches():
    """The count gpu_check compares before and after serving reads Triton's own caches: an int, 0 where nothing has
    launched the kernels compiled (on the CPU they only run interpreted, in a module reloaded for it)."""
    pytest.importorskip("triton")
    from benchmarks.gpu_profile import compiled_lora_variants

    count = compiled_lora_variants()
    assert isinstance(count, int) and (count == 0 or torch.cuda.is_available())
