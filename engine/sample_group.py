"""``n`` > 1: parallel samples of one prompt, the prompt prefilled once and its KV blocks shared.

The request runs as one sequence until its prefill step has produced the logits of its
last prompt token; then it forks. Each child takes references to the prompt's full KV
blocks and a copy of the partial last one (it writes its own tokens there), and samples
its first token from the same logits row with its own seed (``seed + i``). A child that
finds no free block or batch place waits in the queue as a plain sequence instead (its
prompt's full blocks still come from the prefix cache). The caller sees deltas tagged
with their choice index, and one result once all ``n`` have finished; a failure of any
sample fails the request and cancels the others.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional

import torch

from .request import Choice, GenerateResult, TokenDelta
from .sequence import Sequence, SinkItem


class SampleGroup:
    def __init__(self, n: int, sink: Callable[[SinkItem], None], cancel: Callable[[Sequence], None]):
        self.n = n
        self._sink = sink
        self._cancel = cancel
        self.members: list[Sequence] = []
        self._results: dict[int, GenerateResult] = {}
        self._settled = False
        self._lock = threading.Lock()

    def sink_for(self, index: int) -> Callable[[SinkItem], None]:
        def sink(item: SinkItem) -> None:
            if isinstance(item, TokenDelta):
                item.index = index
                if not self._settled:
                    self._sink(item)
            elif isinstance(item, GenerateResult):
                with self._lock:
                    self._results[index] = item
                    done = len(self._results) == self.n and not self._settled
                    self._settled = self._settled or done
                if done:
                    self._sink(merge_results([self._results[i] for i in range(self.n)]))
            else:
                with self._lock:
                    first, self._settled = not self._settled, True
                if first:
                    self._sink(item)
                    for member in self.members:
                        if member.cancel_reason is None and index != member.choice_index:
                            self._cancel(member)
        return sink


def merge_results(results: list[GenerateResult]) -> GenerateResult:
    """One result for the caller: choice 0's fields as before, every choice in ``choices``, usage summed."""
    head = results[0]
    choices = [Choice(i, r.text, r.token_ids, r.finish_reason, r.logprobs) for i, r in enumerate(results)]
    return dataclasses.replace(head, completion_tokens=sum(r.completion_tokens for r in results), choices=choices)


def copy_block(cache, src: int, dst: int) -> None:
    """Block ``dst`` of every layer's K and V becomes a copy of block ``src``."""
    axis = 1 if cache.layout == "page_major" else 2  # the block axis of [layers, ...] (engine.kv_cache)
    for tensor in (cache.k, cache.v):
        tensor.index_copy_(axis, torch.tensor([dst], device=tensor.device),
                           tensor.index_select(axis, torch.tensor([src], device=tensor.device)))


def child_of(parent: Sequence, index: int, make_sequence: Callable) -> Sequence:
    """Sample ``index`` of ``parent``'s request: its own seed (``seed + index``), the same prompt."""
    request = parent.request
    seed = None if request.seed is None else request.seed + index
    child_request = dataclasses.replace(request, seed=seed, n=1, prompt_logprobs=None)  # the parent scores it
    child = make_sequence(child_request, parent.uid, parent.prompt_ids, parent.group.sink_for(index))
    child.choice_index = index
    child.group = parent.group
    parent.group.members.append(child)
    return child


def share_prompt_blocks(parent: Sequence, child: Sequence, cache) -> bool:
    """Give ``child`` ``parent``'s prompt K/V (parent must be just prefilled); False if no block is free."""
    allocator = cache.allocator
    full = parent.num_computed // cache.block_size
    partial = len(parent.block_table) > full
    if partial and allocator.num_free < 1:
        return False
    for block in parent.block_table[:full]:
        allocator.share(block)
    child.block_table = parent.block_table[:full]
    if partial:
        block = allocator.allocate()
        copy_block(cache, parent.block_table[full], block)
        child.block_table.append(block)
    child.num_computed = parent.num_computed
    child.block_digests = list(parent.block_digests)
    cache.note_usage()
    return True


def fork_ready(running: list[Sequence], logits: torch.Tensor, fork: Callable[[Sequence, int], Optional[Sequence]]
               ) -> tuple[list[Sequence], torch.Tensor]:
    """Fork every just-prefilled sequence whose request wants ``n`` > 1: children that joined the batch
    sample from their parent's logits row this step (so ``running`` and ``logits`` grow together)."""
    rows: list[int] = []
    joined: list[Sequence] = []
    for i, seq in enumerate(running):
        if seq.group is None or seq.choice_index != 0 or seq.forked or seq.output_ids or seq.cancel_reason:
            continue
        if seq.num_computed < len(seq.prompt_ids):  # a prefill still in chunks: its last logits are not here yet
            continue
        seq.forked = True
        for index in range(1, seq.group.n):
            child = fork(seq, index)
            if child is not None:
                joined.append(child)
                rows.append(i)
    if not joined:
        return running, logits
    index = torch.tensor(list(range(len(running))) + rows, device=logits.device)
    return running + joined, logits.index_select(0, index)
