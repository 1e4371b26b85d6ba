"""The start-up check of captured decode graphs: capture every bucket, then replay batches against the eager step.

What can go wrong only on a card: a kernel that syncs or allocates on the host inside capture, a plan whose
buffers move, a FlashInfer version whose graph-mode plan does not rewrite what its captured kernel reads, a LoRA
grid that depends on the step. So after capturing, the check replays decode batches the capture never saw (other
sizes, so padding rows; other context lengths, so other pages; several adapters of different ranks in the pool's
slots, so a fixed plan with segments of length 0) and compares their logits with the eager forward of the same
rows. The pool holds no adapter yet when the engine checks (it is built a moment before): the adapters here are
random weights written into empty slots and zeroed after, as a load would leave them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch

from pool.memory_pool import EMPTY, LoRAMemoryPool

from .decode_graphs import DecodeGraphs
from .fast_paths import relative_error


@contextmanager
def random_adapters(pool: LoRAMemoryPool, seed: int) -> Iterator[list[int]]:
    """Random A/B of varied ranks in every slot but the last (left empty: the base model's rows, rank 0), while
    inside; every slot as it was (zeros, rank 0) after. Refuses a pool that holds anything."""
    if any(u is not EMPTY for u in pool.slot_to_uid):
        raise RuntimeError("the graph check writes into empty slots only: this pool holds adapters")
    g = torch.Generator().manual_seed(seed)
    slots = list(range(max(1, pool.slots - 1)))
    ranks = [max(1, pool.max_lora_rank >> (i % 3)) for i in slots]
    try:
        for slot, rank in zip(slots, ranks):
            for m in pool.a_buffers:
                a, bt = pool.a_buffers[m], pool.bt_buffers[m]
                a[:, slot, :rank].copy_(torch.randn(a[:, slot, :rank].shape, generator=g) * 0.05)
                bt[:, slot, :rank].copy_(torch.randn(bt[:, slot, :rank].shape, generator=g) * 0.05)
            pool.slot_ranks[slot] = rank
            pool.slot_scale_values[slot] = 0.5 + slot
        yield slots
    finally:
        for slot in slots:
            for m in pool.a_buffers:
                pool.a_buffers[m][:, slot].zero_()
                pool.bt_buffers[m][:, slot].zero_()
            pool.slot_ranks[slot] = 0
            pool.slot_scale_values[slot] = 0.0


def check_batches(sizes: Sequence[int]) -> list[int]:
    """Batch sizes to replay: one row, the largest bucket full, and one row short of it (a padded replay)."""
    return sorted({1, max(1, sizes[-1] - 1), sizes[-1]})


def graph_error(graphs: DecodeGraphs, seed: int, max_context: Optional[int] = None) -> float:
    """The largest relative difference of replayed logits from the eager forward's over ``check_batches``."""
    from .model_runner import SeqInput

    runner = graphs.runner
    alloc = runner.cache.allocator
    bs = runner.cache.block_size
    vocab = runner.config.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    longest = max(2, min(max_context or 3 * bs, 3 * bs))
    worst, checked = 0.0, 0
    with random_adapters(runner.pool, seed) as slots:
        for batch in check_batches(graphs.sizes):
            contexts = torch.randint(1, longest, (batch,), generator=g).tolist()
            if sum(alloc.blocks_for(c + 1) for c in contexts) > alloc.num_free:
                continue  # a cache too small for this batch: the smaller ones still check
            checked += 1
            tables = [[alloc.allocate() for _ in range(alloc.blocks_for(c + 1))] for c in contexts]
            try:
                rows = [slots[i % len(slots)] if i % 4 else runner.pool.slots - 1 for i in range(batch)]
                prompts = [torch.randint(3, vocab, (c,), generator=g).tolist() for c in contexts]
                runner.forward([SeqInput(t, p, 0, s) for t, p, s in zip(tables, prompts, rows)])
                tokens = torch.randint(3, vocab, (batch,), generator=g).tolist()
                seqs = [SeqInput(t, [tok], c, s) for t, tok, c, s in zip(tables, tokens, contexts, rows)]
                expected = runner.forward(seqs)   # eager: the runner holds no graphs during the check
                got = graphs.forward(seqs)        # the same rows, K/V written again with the same values
                worst = max(worst, relative_error(got, expected))
            finally:
                for t in tables:
                    alloc.free(t)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)  # a replay's launch failure surfaces here, inside the check
    if not checked:
        raise RuntimeError(f"{alloc.num_free} free KV blocks hold none of the check's batches: nothing was replayed")
    return worst
