"""Batched sampling: one pass over the step's rows, each row's randomness a function of its seed and position
alone, top-k and top-p honoured."""

from __future__ import annotations

import torch

from engine.sampling import sample_tokens, uniforms


def sample(logits, temps, top_ps, seeds, counters, top_ks=None, usable=None) -> torch.Tensor:
    return sample_tokens(logits, temps, top_ps, top_ks or [0] * len(temps), seeds, counters, usable)


def test_a_row_samples_the_same_tokens_alone_or_in_any_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    temps, top_ps, top_ks = [1.0, 0.0, 0.7, 1.3, 1.0, 0.5], [1.0, 1.0, 0.9, 0.5, 0.95, 1.0], [0, 0, 5, 0, 20, 3]
    seeds = [100 + i for i in range(6)]
    batched, alone = [], []
    for step in range(20):  # each step's uniform is the row's (seed, tokens generated so far)
        batched.append(sample(logits, temps, top_ps, seeds, [step] * 6, top_ks).tolist())
        alone.append([sample(logits[i:i + 1], temps[i:i + 1], top_ps[i:i + 1], seeds[i:i + 1], [step],
                             top_ks[i:i + 1]).item() for i in range(6)])
        shuffled = [5, 3, 1, 0, 4, 2]  # another batch order: each row still gets its own token
        again = sample(logits[shuffled], [temps[i] for i in shuffled], [top_ps[i] for i in shuffled],
                       [seeds[i] for i in shuffled], [step] * 6, [top_ks[i] for i in shuffled]).tolist()
        assert again == [batched[-1][i] for i in shuffled]
    assert batched == alone
    assert all(row[1] == int(logits[1].argmax()) for row in batched)  # the greedy row
    assert len({row[0] for row in batched}) > 1                        # the sampled rows do vary


def test_sampled_frequencies_follow_the_distribution_and_top_p_cuts_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    counts = torch.bincount(sample(logits, [1.0] * 4000, [1.0] * 4000, list(range(4000)), [0] * 4000),
                            minlength=4).float() / 4000
    assert (counts - probs).abs().max() < 0.03  # 4000 draws: a standard error of 0.008 at most
    nucleus = sample(logits, [1.0] * 4000, [0.75] * 4000, list(range(4000)), [0] * 4000)
    kept = torch.bincount(nucleus, minlength=4).float() / 4000
    assert kept[2] == 0 and kept[3] == 0  # 0.5 + 0.3 reach 0.75: the rest is cut
    assert abs(kept[0] - 0.5 / 0.8) < 0.03
    # one request's successive steps (one seed, counters 0..3999) follow the distribution too
    steps = torch.bincount(sample(logits, [1.0] * 4000, [1.0] * 4000, [7] * 4000, list(range(4000))),
                           minlength=4).float() / 4000
    assert (steps - probs).abs().max() < 0.03


def test_top_k_samples_only_the_k_most_likely_tokens():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # the most likely are tokens 1, 3, 2, 0
    logits = probs.log().repeat(4000, 1)
    seeds, zeros = list(range(4000)), [0] * 4000
    two = torch.bincount(sample(logits, [1.0] * 4000, [1.0] * 4000, seeds, zeros, [2] * 4000), minlength=4) / 4000
    assert two[0] == 0 and two[2] == 0 and abs(two[1] - 0.5 / 0.8) < 0.03
    # top-p cuts what top-k kept: of 0.95 kept by k=3, 0.7 of it (0.665) is reached by tokens 1 and 3
    both = torch.bincount(sample(logits, [1.0] * 4000, [0.7] * 4000, seeds, zeros, [3] * 4000), minlength=4) / 4000
    assert both[0] == 0 and both[2] == 0 and both[1] > 0.5
    assert sample(logits[:8], [1.5] * 8, [1.0] * 8, seeds[:8], zeros[:8], [1] * 8).tolist() == [1] * 8  # k=1: argmax
    every = sample(logits[:64], [1.0] * 64, [1.0] * 64, seeds[:64], zeros[:64], [4] * 64)  # k = vocab: no cut
    assert every.tolist() == sample(logits[:64], [1.0] * 64, [1.0] * 64, seeds[:64], zeros[:64]).tolist()


def test_uniforms_are_spread_evenly_and_depend_on_every_input():
    n = 1 << 14
    lo, hi, counter = torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    for u in (uniforms(lo, hi, counter), uniforms(counter + 3, hi, lo), uniforms(counter, lo, counter)):
        assert 0 <= u.min() and u.max() < 1
        bins = torch.bincount((u * 16).long(), minlength=16).float() / n
        assert (bins - 1 / 16).abs().max() < 0.01  # 16k draws: a standard error of 0.002 per bin
        assert len(set(u.tolist())) > 0.99 * n
    # a 64-bit seed's halves, and the seed's neighbours (seed + i for n > 1), give unrelated streams
    a = uniforms(torch.tensor([5] * 256), torch.tensor([0] * 256), torch.arange(256))
    b = uniforms(torch.tensor([5] * 256), torch.tensor([1] * 256), torch.arange(256))
    c = uniforms(torch.tensor([6] * 256), torch.tensor([0] * 256), torch.arange(256))
    for x, y in ((a, b), (a, c), (b, c)):
        assert abs(torch.corrcoef(torch.stack([x, y]))[0, 1]) < 0.2


def test_rows_with_non_finite_logits_do_not_poison_the_others():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    logits[1, 4] = float("nan")
    usable = torch.isfinite(logits).all(dim=-1)
    tokens = sample(logits, [1.0, 1.0, 1.0], [0.9, 0.9, 0.9], [1, 2, 3], [0, 0, 0], usable=usable)
    clean = sample(logits[[0, 2]], [1.0, 1.0], [0.9, 0.9], [1, 3], [0, 0])
    assert tokens[[0, 2]].tolist() == clean.tolist()


def test_the_inverse_cdf_never_picks_a_token_of_probability_zero():
    """Uniforms at both ends, with masked tokens (probability 0) first, inside and last in the row."""
    from engine.sampling import _inverse_cdf

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 4)
    u = torch.tensor([0.0, 0.25, 0.2500001, 1 - 2 ** -24])
    assert _inverse_cdf(probs, u)[:, 0].tolist() == [1, 3, 3, 3]
    masked_tail = torch.tensor([[1e-30, 3e-8, 1.0] + [0.0] * 5])  # the total is reached before the masked tail
    assert _inverse_cdf(masked_tail, torch.tensor([1 - 2 ** -24]))[:, 0].tolist() == [2]
