"""Fixed-size KV blocks: a free list, reference counts, and a prefix cache keyed by content.

A block is ``block_size`` token positions of every layer's K and V. Sequences hold blocks
through their block tables; a block shared by several sequences (a common prompt prefix)
is freed when its last holder lets go. A full block whose tokens are known is registered
under a chained digest of (adapter uid, every token up to its end): a later request with
the same adapter uid and prefix takes it instead of recomputing. Keyed by uid, never by
name, so a re-registered adapter can never reuse stale KV. Registered blocks nobody holds
stay cached until the free list runs dry, then go least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Optional


class KVCacheFullError(RuntimeError):
    """No free block left (the scheduler checks ``num_free`` first, so this means a bookkeeping bug)."""


class KVBlockRefError(RuntimeError):
    """A block freed more often than it was taken, or shared while nobody holds it: a reference-count bug,
    not a full cache, so it must not be mistaken for (or handled as) ``KVCacheFullError``."""


def block_digest(parent: Optional[bytes], uid: Optional[str], tokens: Iterable[int]) -> bytes:
    """Digest of a full block: its adapter uid, its tokens, and the digest of the blocks before it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(b"\x00" if uid is None else b"\x01" + uid.encode() + b"\x00")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._digest_of: dict[int, bytes] = {}              # block -> digest (registered blocks)
        self._block_of: dict[bytes, int] = {}               # digest -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unheld; oldest first
        self.prefix_hits = 0      # blocks taken from the cache instead of recomputed
        self.evictions = 0        # cached blocks dropped to make room

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now: never used, plus cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._digest_of.pop(block)]
            self.evictions += 1
        else:
            raise KVCacheFullError(f"all {self.num_blocks} KV blocks are in use")
        self._refs[block] = 1
        return block

    def free(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            refs = self._refs[block]
            if refs <= 0:
                raise KVBlockRefError(f"block {block} freed more often than it was taken")
            self._refs[block] = refs - 1
            if refs == 1:
                if block in self._digest_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def share(self, block: int) -> None:
        """One more holder of a held ``block`` (a forked sample reading its parent's prompt)."""
        if self._refs[block] <= 0:
            raise KVBlockRefError(f"block {block} is shared but nobody holds it")
        self._refs[block] += 1

    def peek(self, digest: bytes) -> Optional[int]:
        """The cached block with this digest, taking nothing."""
        return self._block_of.get(digest) if self.prefix_caching else None

    def lookup(self, digest: bytes) -> Optional[int]:
        """Take a reference to the cached block with this digest, if there is one."""
        if not self.prefix_caching:
            return None
        block = self._block_of.get(digest)
        if block is None:
            return None
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1
        self.prefix_hits += 1
        return block

    def register(self, block: int, digest: bytes) -> None:
        """Record that ``block`` now holds the full block with this digest (first writer wins)."""
        if not self.prefix_caching or block in self._digest_of or digest in self._block_of:
            return
        self._digest_of[block] = digest
        self._block_of[digest] = block

    def refs(self, block: int) -> int:
        return self._refs[block]

    def cached_blocks(self) -> int:
        return len(self._digest_of)
