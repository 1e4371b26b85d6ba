"""The start-up check of the Triton LoRA kernels: every variant serving will launch, against the torch loop.

Serving launches the kernels with one to three fused slices (``lora_layers.kernel_groups``)
and a ``BLOCK_R`` fixed by the step's largest rank, so the variants are (group, BLOCK_R)
for every BLOCK_R up to ``max_lora_rank``'s; the check runs each on random weights in
scratch buffers shaped like the pool's (the pool's own slots hold zeros at start, which
would hide wrong numbers), with a prefill segment over two token tiles and a decode row,
split-K on. Triton also compiles a variant per pointer-alignment class, so a pool layer
whose buffers fall in another class than the scratch ones gets one launch on its real
buffers too (they are only read). After this, serving compiles nothing.
"""

from __future__ import annotations

import torch

from pool.memory_pool import LoRAMemoryPool

from .fast_paths import relative_error
from .lora_layers import LoRASegment, add_segment_loop, kernel_groups
from .lora_plan import SegmentPlan

PREFILL_TOKENS = 17  # two token tiles of BLOCK_M 16
ALIGN_BYTES = 16


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN_BYTES == 0


def lora_kernel_error(pool: LoRAMemoryPool, target_programs: int, seed: int) -> float:
    """The largest relative difference of the kernels from the torch segment loop over every variant."""
    from . import lora_triton  # ImportError here when Triton is missing: the check fails, torch serves

    if pool.slots < 2:
        raise ValueError("one pool slot: a step never has two adapters, the kernels would never run")
    device, dtype = pool.device, pool.dtype
    g = torch.Generator().manual_seed(seed)
    slots, max_rank = pool.slots, pool.max_lora_rank
    groups = kernel_groups(pool.shape.modules)
    worst = 0.0
    for block_r in lora_triton.RANK_BLOCKS:
        rank = min(block_r, max_rank)
        if lora_triton.rank_block(rank) != block_r:
            break  # past max_lora_rank's variant
        segments = [LoRASegment(slots - 1, 0, PREFILL_TOKENS, rank, 0.5),
                    LoRASegment(slots - 2, PREFILL_TOKENS, PREFILL_TOKENS + 1, max(1, rank // 2), 2.0)]
        tokens = PREFILL_TOKENS + 1
        plan = SegmentPlan.build(segments, device, tokens)
        for group in groups:
            shape = pool.shape.modules[group[0]]
            x = torch.randn(tokens, shape.in_features, generator=g).to(device, dtype)
            a = [torch.randn(slots, max_rank, shape.in_features, generator=g).to(device, dtype) for _ in group]
            widths = [pool.shape.modules[m].out_features for m in group]
            bt = [torch.randn(slots, max_rank, w, generator=g).to(device, dtype) for w in widths]
            base = [torch.randn(tokens, w, generator=g).to(device, dtype) for w in widths]
            got = [b.clone() for b in base]
            lora_triton.add_lora_slices(x, a, bt, plan, got, target_programs)
            for a_i, bt_i, b, out in zip(a, bt, base, got):
                expected = b.clone()
                add_segment_loop(x, a_i, bt_i, segments, expected)
                worst = max(worst, relative_error(out, expected))
            _compile_alignment_classes(lora_triton, pool, group, x, base, plan, target_programs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a launch failure surfaces here, inside the check
    return worst


def _compile_alignment_classes(lora_triton, pool: LoRAMemoryPool, group: tuple[str, ...], x: torch.Tensor,
                               base: list[torch.Tensor], plan: SegmentPlan, target_programs: int) -> None:
    """One launch on the first pool layer of each pointer-alignment class the scratch buffers did not cover."""
    seen = {tuple([True] * (2 * len(group)))}  # the scratch buffers: fresh allocations, aligned
    for layer in range(pool.shape.num_layers):
        a = [pool.a_buffers[m][layer] for m in group]
        bt = [pool.bt_buffers[m][layer] for m in group]
        key = tuple(_aligned(t) for t in a + bt)
        if key not in seen:
            seen.add(key)
            lora_triton.add_lora_slices(x, a, bt, plan, [b.clone() for b in base], target_programs)
