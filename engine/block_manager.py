"""KV blocks for sequences: prefix reuse at admission, one more block as a sequence grows, release.

The scheduler asks what admitting a sequence would cost (``admission_cost``, in blocks
taken from the free count, cached prefix blocks included) before it ``allocate``s; a
running sequence asks ``growth_needed`` before each step. After a forward, ``commit``
records which tokens' K/V are now cached and registers the blocks that became full, so a
later request with the same adapter uid and prefix (or this one, after a preemption)
finds them.
"""

from __future__ import annotations

from typing import Optional

from .block_allocator import block_digest
from .kv_cache import PagedKVCache
from .sequence import Sequence

WATERMARK_FRACTION = 0.01  # blocks kept free at admission while others run, so decode growth rarely preempts


class BlockManager:
    def __init__(self, cache: PagedKVCache, watermark: Optional[int] = None):
        """``watermark``: blocks admission leaves free while others run (default 1% of the blocks, rounded down:
        none for a cache of a few long blocks, where a request's first blocks already hold all it will write)."""
        self.cache = cache
        self.allocator = cache.allocator
        self.block_size = cache.block_size
        self.watermark = int(WATERMARK_FRACTION * self.allocator.num_blocks) if watermark is None else watermark

    def num_free(self) -> int:
        return self.allocator.num_free

    def admission_cost(self, seq: Sequence) -> int:
        """Blocks admitting ``seq`` takes from ``num_free``: new ones, plus cached ones nobody holds now."""
        hits = self._cached_prefix(seq)
        unheld = sum(1 for b in hits if self.allocator.refs(b) == 0)
        return self.allocator.blocks_for(seq.num_tokens) - len(hits) + unheld

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of ``seq``'s tokens: the cached prefix shared, the rest new (its K/V computed this step)."""
        if seq.block_table:
            raise ValueError(f"request {seq.request.request_id} already holds KV blocks")
        table = []
        for digest in self._prefix_digests(seq):
            block = self.allocator.lookup(digest)
            if block is None:
                break
            table.append(block)
        seq.num_computed = len(table) * self.block_size
        for _ in range(self.allocator.blocks_for(seq.num_tokens) - len(table)):
            table.append(self.allocator.allocate())
        seq.block_table = table
        self.cache.note_usage()

    def growth_needed(self, seq: Sequence) -> int:
        """New blocks ``seq``'s next input needs (0 or 1 while decoding)."""
        return self.allocator.blocks_for(seq.num_tokens) - len(seq.block_table)

    def grow(self, seq: Sequence) -> None:
        for _ in range(self.growth_needed(seq)):
            seq.block_table.append(self.allocator.allocate())
        self.cache.note_usage()

    def release(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks (full ones stay cached for reuse); its K/V must be recomputed to run again."""
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def commit(self, seq: Sequence, computed: int) -> None:
        """The first ``computed`` tokens' K/V are now in ``seq``'s blocks: register the blocks that became full."""
        before = seq.num_computed // self.block_size
        seq.num_computed = computed
        full = computed // self.block_size
        if full > before and self.allocator.prefix_caching:
            digests = self._digests(seq, full)
            for i in range(before, full):
                self.allocator.register(seq.block_table[i], digests[i])

    def _digests(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        """Digests of ``seq``'s first ``n_blocks`` full blocks (kept on the sequence: its tokens never change)."""
        digests, bs = seq.block_digests, self.block_size
        while len(digests) < n_blocks:
            i = len(digests)
            digests.append(block_digest(digests[-1] if digests else None, seq.uid, seq.token_at(i * bs, (i + 1) * bs)))
        return digests

    def _prefix_digests(self, seq: Sequence) -> list[bytes]:
        """Digests of the full blocks a cached prefix may cover: never the last token, whose logits are needed."""
        if not self.allocator.prefix_caching or getattr(seq, "prompt_logprobs", None) is not None:  # echo scores every prompt token
            return []
        n = (seq.num_tokens - 1) // self.block_size
        return self._digests(seq, n)[:n]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        hits = []
        for digest in self._prefix_digests(seq):
            block = self.allocator.peek(digest)
            if block is None:
                break
            hits.append(block)
        return hits
