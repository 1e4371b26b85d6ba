"""Batched sampling: one pass over the step's rows, each row's randomness its own request's, top-p honoured."""

from __future__ import annotations

import torch

from engine.sampling import sample_tokens


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_row_samples_the_same_tokens_alone_or_in_any_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    temps, top_ps = [1.0, 0.0, 0.7, 1.3, 1.0, 0.5], [1.0, 1.0, 0.9, 0.5, 0.95, 1.0]
    batched, alone = [], []
    gens = [gen(100 + i) for i in range(6)]
    solo_gens = [gen(100 + i) for i in range(6)]
    for _ in range(20):  # steps: each draws one uniform per sampled row from that row's generator
        batched.append(sample_tokens(logits, temps, top_ps, gens).tolist())
        alone.append([sample_tokens(logits[i:i + 1], temps[i:i + 1], top_ps[i:i + 1], solo_gens[i:i + 1]).item()
                      for i in range(6)])
    assert batched == alone
    assert all(row[1] == int(logits[1].argmax()) for row in batched)  # the greedy row
    assert len({row[0] for row in batched}) > 1                        # the sampled rows do vary


def test_sampled_frequencies_follow_the_distribution_and_top_p_cuts_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    gens = [gen(i) for i in range(4000)]
    counts = torch.bincount(sample_tokens(logits, [1.0] * 4000, [1.0] * 4000, gens), minlength=4).float() / 4000
    assert (counts - probs).abs().max() < 0.03  # 4000 draws: a standard error of 0.008 at most
    nucleus = sample_tokens(logits, [1.0] * 4000, [0.75] * 4000, [gen(i) for i in range(4000)])
    kept = torch.bincount(nucleus, minlength=4).float() / 4000
    assert kept[2] == 0 and kept[3] == 0  # 0.5 + 0.3 reach 0.75: the rest is cut
    assert abs(kept[0] - 0.5 / 0.8) < 0.03


def test_rows_with_non_finite_logits_do_not_poison_the_others():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    logits[1, 4] = float("nan")
    usable = torch.isfinite(logits).all(dim=-1)
    tokens = sample_tokens(logits, [1.0, 1.0, 1.0], [0.9, 0.9, 0.9], [gen(1), gen(2), gen(3)], usable)
    clean = sample_tokens(logits[[0, 2]], [1.0, 1.0], [0.9, 0.9], [gen(1), gen(3)])
    assert tokens[[0, 2]].tolist() == clean.tolist()
