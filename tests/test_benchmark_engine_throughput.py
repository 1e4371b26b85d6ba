"""The engine throughput benchmark runs end to end on a tiny model: every system serves every token."""

from __future__ import annotations

import json
import operator

import peft as _peft  # noqa: F401  (the test extra installs it; missing is a failure)

from benchmarks import engine_throughput
from benchmarks.throughput import long_prompts, systems

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2, max_position_embeddings=256)


def test_engine_throughput_tiny(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(engine_throughput, "MODEL", TINY)
    monkeypatch.setattr(engine_throughput, "MAX_RUNNING", 4)
    monkeypatch.setattr(engine_throughput, "DECODE_BATCH", 4)
    monkeypatch.setattr(engine_throughput, "DECODE_CONTEXT", 16)
    monkeypatch.setattr(long_prompts, "LONG_PROMPT", 200)
    # transformers' KV cache sized for these requests (10 of at most 152 tokens: one 256-token page each), not from
    # the free memory: filling that cache's attention mask at start-up took most of this test's time
    monkeypatch.setattr(systems, "TRANSFORMERS_CB", {"num_blocks": 16, "max_batch_tokens": 512})
    out = tmp_path / "engine_throughput.json"
    assert engine_throughput.main(["--quick", "--requests", "10", "--threads", "1", "--json", str(out)]) == 0

    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    goals = {g["name"]: g for g in data["goals"]}
    assert list(goals) == ["engine_vs_transformers_cb", "engine_vs_peft_mixed", "kv_concurrency_gain",
                           "sampling_tok_s_ratio", "decode_vs_roofline", "short_ttft_p99_under_long_prompts"]
    for g in goals.values():  # each verdict is its measured number against its stated target
        op, bound = g["target"].split()
        assert isinstance(g["measured"], float) and g["measured"] > 0
        assert g["pass"] is {">=": operator.ge, "<=": operator.le}[op](g["measured"], float(bound)), g
        assert ("PASS" if g["pass"] else "FAIL") + f"  {g['name']}" in printed
    assert len(data["rows"]) == 6
    ours, base, poisson, contiguous, transformers, peft = data["rows"]
    assert [r["system"].split(",")[0] for r in data["rows"]] == ["ours"] * 4 + ["transformers CB", "PEFT generate"]
    assert "contiguous rows" in contiguous["system"] and "Poisson" in poisson["system"]
    assert all(r["output_tokens"] == ours["output_tokens"] for r in data["rows"])  # EOS ignored everywhere
    assert all(r["tok_per_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 for r in data["rows"])
    # at most MAX_RUNNING (4) requests run at a time; the contiguous rows hold 8 x the 256-token window of KV
    assert ours["max_concurrent"] == contiguous["max_concurrent"] == 4
    assert ours["peak_kv_mb"] < contiguous["peak_kv_mb"]
    decode = data["metadata"]["decode_step"]
    assert decode["batch"] == 4 and decode["step_ms"] > 0 and decode["gemm_floor_ms"] > 0
    assert (tmp_path / "engine_throughput.png").exists()
    alone, with_long = data["metadata"]["long_prompts"]
    assert alone["requests"] == with_long["requests"] == 10  # the short requests' latencies, both runs
    assert with_long["long_ttft_p50_ms"] > 0
    ratio = with_long["ttft_p99_ms"] / alone["ttft_p99_ms"]
    assert abs(goals["short_ttft_p99_under_long_prompts"]["measured"] - ratio) < 1e-9
    greedy, sampled = data["metadata"]["sampling"]
    assert "greedy" in greedy["system"] and "top_p 0.9" in sampled["system"]
    assert greedy["output_tokens"] == sampled["output_tokens"] == ours["output_tokens"]  # all 10 requests, batch <= 32
    assert abs(goals["sampling_tok_s_ratio"]["measured"] - sampled["tok_per_s"] / greedy["tok_per_s"]) < 1e-9
