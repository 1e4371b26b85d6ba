"""The LoRA compute benchmark runs end to end on a tiny model and its correctness check holds."""

from __future__ import annotations

import json

import pytest

import peft  # noqa: F401  (the test extra installs it; missing is a failure)
import transformers  # noqa: F401  (the test extra installs it; missing is a failure)

from benchmarks import common, lora_compute  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=256)


def test_lora_compute_tiny(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(lora_compute, "MODEL", TINY)
    monkeypatch.setattr(lora_compute, "DECODE_BATCH", 16)
    monkeypatch.setattr(lora_compute, "DECODE_CONTEXT", 8)
    monkeypatch.setattr(lora_compute, "PREFILL_LEN", 12)
    out = tmp_path / "lora_compute.json"
    assert lora_compute.main(["--quick", "--layers", "2", "--repeats", "1", "--json", str(out)]) == 0

    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    goals = {g["name"]: g for g in data["goals"]}
    assert list(goals) == ["decode: 8 adapters / base step", "decode: PEFT mixed / ours 8 adapters",
                           "prefill: PEFT mixed / ours 8 adapters", "max |logit diff| vs PEFT mixed"]
    for g in goals.values():  # the printed verdict is the stored one
        assert f"{common.verdict(g['pass']):4s}  {g['name']}" in printed
    rows = {row["case"]: row for row in data["rows"]}
    overhead = goals["decode: 8 adapters / base step"]
    assert overhead["measured"] == pytest.approx(rows["ours: 8 adapters"]["decode_vs_our_base"])
    assert overhead["pass"] == (overhead["measured"] <= lora_compute.DECODE_GOAL)
    speedup = goals["prefill: PEFT mixed / ours 8 adapters"]
    assert speedup["measured"] == pytest.approx(rows["peft: 8 adapters mixed"]["prefill_ms"]
                                                / rows["ours: 8 adapters"]["prefill_ms"])
    assert goals["max |logit diff| vs PEFT mixed"]["pass"] is True
    assert [row["case"] for row in data["rows"]] == [f"{impl}: {case}" for impl, case in lora_compute.CASES]
    assert all(row["decode_ms"] > 0 and row["prefill_ms"] > 0 for row in data["rows"])
    check = data["metadata"]["correctness"]
    assert check["ok"]
    assert check["adapter_effect"] > 100 * max(check["decode_max_abs_diff"], check["prefill_max_abs_diff"])
