"""A step's token layout over the paged KV cache, built once per step and shared by every layer.

Where each new token's K/V goes (block and offset), the positions the rotary embedding
needs, and for decode rows the padded block ids to gather and the additive masks per
sliding-window size (built on first use, then reused by the other layers).
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from .host_copy import to_device

# torch warns once per process that sparse CSR tensors are "in beta" when ``score_pattern`` builds its first one; the
# pattern is checked against the gathered path at start (``engine.check_attention``), so the notice says nothing to an
# operator (only this message is filtered)
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state", category=UserWarning)


class StepLayout:
    """Where a step's tokens go in the cache and which cached positions each one reads.

    ``tables[i]`` is sequence i's block table, ``starts[i]`` its first new position,
    ``counts[i]`` its number of new tokens; tokens are laid out sequence after sequence.
    """

    def __init__(self, tables: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int],
                 block_size: int, device: torch.device, decode_gathers: bool = True):
        """``decode_gathers`` False: no decode groups (``decode_groups`` empty), for a backend that reads the block
        tables itself (FlashInfer): their block ids are host work in proportion to the rows' context, every step."""
        self.block_size = block_size
        self.device = device
        self.tables = tables
        self.starts = list(starts)
        self.counts = list(counts)
        self.kv_lens = [s + n for s, n in zip(starts, counts)]
        blocks: list[int] = []
        offsets: list[int] = []
        positions: list[int] = []
        decode_seqs: list[int] = []
        self.prefill_seqs: list[int] = []
        self.token_offsets: list[int] = []
        offset = 0
        for i, (table, start, n) in enumerate(zip(tables, starts, counts)):
            if len(table) * block_size < start + n:
                raise ValueError(f"sequence {i}: {len(table)} blocks of {block_size} cannot hold {start + n} tokens")
            self.token_offsets.append(offset)
            for p in range(start, start + n):
                blocks.append(table[p // block_size])
                offsets.append(p % block_size)
            positions.extend(range(start, start + n))
            (decode_seqs if n == 1 else self.prefill_seqs).append(i)
            offset += n
        self.num_tokens = offset
        self.decode_seqs = decode_seqs
        groups = decode_groups([-(-self.kv_lens[i] // block_size) for i in decode_seqs]) if decode_gathers else []
        group_seqs = [[decode_seqs[j] for j in g] for g in groups]
        decode_rows = [_DecodeGather.host_rows(self, seqs) for seqs in group_seqs]
        # one host buffer, one host-to-device copy for every index the step needs (not one per tensor)
        pieces = [blocks, offsets, positions, *[piece for rows in decode_rows for piece in rows]]
        staged = _stage([v for piece in pieces for v in piece], device)
        views, at = [], 0
        for piece in pieces:
            views.append(staged[at:at + len(piece)])
            at += len(piece)
        self.write_blocks, self.write_offsets, self.positions = views[:3]
        self.decode_groups = [_DecodeGather(self, seqs, views[3 + 3 * g:6 + 3 * g]) for g, seqs in enumerate(group_seqs)]
        if len(group_seqs) == 1 and group_seqs[0] == list(range(len(counts))) and not self.prefill_seqs:
            self.decode_groups[0].all_rows = True
        self._prefill_rows: dict[tuple[int, int], torch.Tensor] = {}  # (sequence, id of the cache) -> row ids

    @property
    def slots(self) -> torch.Tensor:
        """Flat cache slot of each new token: ``block * block_size + offset``."""
        return self.write_blocks * self.block_size + self.write_offsets

    @property
    def decode(self) -> Optional["_DecodeGather"]:
        """The first group of decode rows (None: no decode row this step)."""
        return self.decode_groups[0] if self.decode_groups else None

    def prefill_rows(self, i: int, cache) -> torch.Tensor:
        """``cache.block_rows`` of the blocks covering sequence i's whole context (a prefill that continues a
        cached prefix), computed once per step for every layer."""
        key = (i, id(cache))
        if key not in self._prefill_rows:
            nb = -(-self.kv_lens[i] // self.block_size)
            blocks = torch.tensor(list(self.tables[i][:nb]), dtype=torch.long, device=self.device)
            self._prefill_rows[key] = cache.block_rows(blocks)
        return self._prefill_rows[key]


PADDING_FACTOR = 2  # a group of decode rows gathers at most this many times the blocks its rows hold


def decode_groups(num_blocks: Sequence[int]) -> list[list[int]]:
    """Decode rows (their block counts) grouped so that padding every row of a group to its longest costs at most
    ``PADDING_FACTOR`` times the blocks they hold. Why: one 4k-token row among 100-token ones made every row gather
    4k positions (a decode step of 10 rows read 40x the K/V it needed, measured ~0.9 s instead of ~0.1 s)."""
    order = sorted(range(len(num_blocks)), key=lambda i: num_blocks[i])
    groups: list[list[int]] = []
    held = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * num_blocks[i] <= PADDING_FACTOR * (held + num_blocks[i]):
            groups[-1].append(i)
            held += num_blocks[i]
        else:
            groups.append([i])
            held = num_blocks[i]
    return groups


def _stage(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as int64 on ``device`` in one copy (from pinned memory on CUDA, so it does not stall the host)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


class _DecodeGather:
    """Decode rows (one new token each): the cache rows of their positions up to the longest row (``span``), and an
    additive key mask per window size.

    Row-major (row, KV head, ...) throughout, so a row's queries ``[heads, head_dim]`` already are its KV heads'
    groups (``[kv_heads, group, head_dim]``: query head i reads KV head i // group) and the output is its heads in
    order: no transpose of the queries or the output (two copies per layer when this was KV-head-major)."""

    @staticmethod
    def host_rows(layout: StepLayout, seqs: list[int]) -> list[list[int]]:
        """The padded block ids (flattened), token rows and lengths, as host lists for the step's one copy."""
        bs = layout.block_size
        lens = [layout.kv_lens[i] for i in seqs]
        nb = -(-max(lens) // bs)
        padded = [list(layout.tables[i][: -(-n // bs)]) for i, n in zip(seqs, lens)]
        blocks = [b for t in padded for b in t + [t[0]] * (nb - len(t))]
        return [blocks, [layout.token_offsets[i] for i in seqs], lens]

    def __init__(self, layout: StepLayout, seqs: list[int], staged: list[torch.Tensor]):
        """``staged``: ``host_rows``' lists on the device."""
        blocks, self.tokens, self.lengths = staged
        self.all_rows = False  # the rows are the step's every token, in order (``StepLayout`` sets it)
        self.blocks = blocks.view(len(seqs), -1)
        self.host_lengths = [layout.kv_lens[i] for i in seqs]
        # the longest row: positions past a row's length (its last block's rest, its padding blocks: the row's own
        # blocks, so finite) are masked
        self.span = max(self.host_lengths)
        self._masks: dict[Optional[int], torch.Tensor] = {}
        self._biases: dict[tuple, torch.Tensor] = {}
        self._keys: Optional[tuple] = None  # (the cache, the key row ids, the gather's buffer or None)
        self._bags: Optional[tuple] = None  # (the cache, group, (ids, offsets, weights' rows)) for ``value_bags``
        self._patterns: dict[tuple, torch.Tensor] = {}  # (window, group, dtype) -> ``score_pattern``

    def rows(self, cache) -> torch.Tensor:
        """``cache.position_rows`` of every row's positions up to ``span``, flat ``[B * kv_heads * span]``; computed on
        first use and shared by the step's layers."""
        if self._keys is None or self._keys[0] is not cache:
            rows = cache.position_rows(self.blocks)[:, :, :self.span].reshape(-1)   # [B * kv_heads * span]
            self._keys = (cache, rows, None)
        return self._keys[1]

    def gather(self, positions: torch.Tensor, cache) -> torch.Tensor:
        """``positions``' rows (``cache.key_positions``/``value_positions`` of a layer) of every row, KV head and
        position up to ``span``: ``[B * kv_heads, span, head_dim]``. The layers of a step reuse one buffer: a fresh
        one per layer was a new allocation (page faults once it passes malloc's mmap threshold, at long contexts)."""
        rows = self.rows(cache)
        buffer = self._keys[2]
        if buffer is None or buffer.dtype != positions.dtype:
            buffer = positions.new_empty(rows.numel(), positions.shape[1])
            self._keys = (cache, rows, buffer)
        torch.index_select(positions, 0, rows, out=buffer)
        return buffer.view(-1, self.span, positions.shape[1])

    def value_bags(self, cache, group: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """For ``F.embedding_bag`` over ``cache.value_positions``: every (row, KV head, query of the head's group) is
        one bag of the row's positions up to its length, none of the padding (ids, bag offsets, and where the rows'
        lengths differ the flat index of each id's probability in the ``[B * kv_heads, group, span]`` scores: None
        where they are all ``span`` long). Computed on first use and shared by the step's layers."""
        if self._bags is None or self._bags[0] is not cache or self._bags[1] != group:
            B = self.blocks.shape[0]
            rows = self.rows(cache).view(B, -1, 1, self.span)               # [B, kv_heads, 1, span]
            ids = rows.expand(B, rows.shape[1], group, self.span)
            bags = B * rows.shape[1] * group
            if min(self.host_lengths) == self.span:
                select = None
                ids = ids.reshape(-1)
                offsets = torch.arange(0, ids.numel(), self.span, device=rows.device)
            else:
                valid = self.mask(None)[:, None, None, :].expand_as(ids)
                select = valid.reshape(-1).nonzero().view(-1)
                ids = ids.reshape(-1).index_select(0, select)
                counts = self.lengths.repeat_interleave(bags // B)
                offsets = torch.cumsum(counts, 0) - counts
            self._bags = (cache, group, (ids, offsets, select))
        return self._bags[2]

    def score_pattern(self, cache, window: Optional[int], group: int, dtype: torch.dtype) -> torch.Tensor:
        """For ``torch.sparse.sampled_addmm`` against ``cache.key_positions(layer).t()``: a CSR matrix with a row per
        (row, KV head, query of the head's group) holding its ``span`` key positions (``rows``) and the mask's bias
        as values, so ``sampled_addmm(pattern, queries, keys.t(), alpha=scale)`` is the masked scores with no copy of K.
        Computed on first use and shared by the step's layers (one cache: the layers' K have the same shape).

        Why: the gather wrote every key once more and the batched matmul read it back (at batch 32 over 65 cached
        tokens, 4.3 MB per layer each way); ``sampled_addmm`` takes each dot product from the cache in place."""
        key = (window, group, dtype)
        if key not in self._patterns:
            B = self.blocks.shape[0]
            kv_heads = self.rows(cache).numel() // (B * self.span)
            n = B * kv_heads * group
            columns = self.rows(cache).view(B * kv_heads, 1, self.span).expand(-1, group, -1).reshape(-1)
            values = self.bias(window, kv_heads, dtype).expand(-1, group, -1).reshape(-1)
            crow = torch.arange(0, n * self.span + 1, self.span, device=columns.device)
            positions = cache.k.shape[1:-1].numel()
            self._patterns[key] = torch.sparse_csr_tensor(crow, columns, values, size=(n, positions),
                                                          check_invariants=False)
        return self._patterns[key]

    def mask(self, window: Optional[int]) -> torch.Tensor:
        """[B, span] booleans: key position < length (and within the window)."""
        if window not in self._masks:
            key_pos = torch.arange(self.span, device=self.lengths.device)
            qpos = (self.lengths - 1)[:, None]
            m = key_pos[None, :] <= qpos
            if window:
                m &= key_pos[None, :] > qpos - window
            self._masks[window] = m
        return self._masks[window]

    def bias(self, window: Optional[int], kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """[B * kv_heads, 1, span]: 0 where a key is visible, -inf where not (row-major, as the scores)."""
        key = (window, kv_heads, dtype)
        if key not in self._biases:
            zero = torch.zeros((), dtype=dtype, device=self.lengths.device)
            bias = torch.where(self.mask(window), zero, float("-inf"))
            B = bias.shape[0]
            self._biases[key] = bias[:, None, None, :].expand(B, kv_heads, 1, self.span).reshape(B * kv_heads, 1,
                                                                                                  self.span)
        return self._biases[key]
