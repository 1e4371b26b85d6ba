"""Decode-only steps replayed as CUDA graphs, one captured per bucketed batch size.

Why: on a GPU a decode step is ~1,800 small kernel launches (an 8B model, batch 64, 8 adapters), each ~5-10 µs of
host dispatch, so the host, not the card, sets the step's time. A graph replays the whole forward, the Triton LoRA
kernels and FlashInfer's attention included, in one launch.

How (vLLM's and SGLang's idea, on this engine's own pieces):

- A decode step of B requests runs as the smallest captured bucket of at least B rows: its B rows in slot order,
  then padding rows (token 0 at position 0, writing its K/V into one block the graphs keep for themselves, in no
  LoRA segment) that the caller never sees.
- Everything the captured kernels read lives at a fixed address, refilled before each replay: the token ids, the
  positions and the K/V write blocks and offsets (``StaticDecodeInputs``), the LoRA segments as a plan of fixed
  width (``SegmentPlan.fixed``: unused segments have length 0, so the kernels' grid never changes), and
  FlashInfer's index buffers (its wrapper in CUDA-graph mode, planned outside the graph each step,
  ``FlashInferPagedAttention.begin_step``).
- The graph ends at the logits: sampling, which reads them once per step, stays outside.
- FlashInfer's plan in CUDA-graph mode copies the page indices into its fixed buffer with a blocking copy (its
  ``prefill.py``, read at 0.6.18): one wait for the previous step per step and window, which also keeps its pinned
  plan buffer from being rewritten while a copy from it is pending. Its first plan fixes the rows a wrapper takes:
  the capture plans exactly the bucket's rows.

The engine's start-up check (``engine.check_graphs``) captures every bucket, then replays batches of other sizes
and context lengths against the eager step; any error or difference beyond the tolerance and the engine serves
eagerly (``EngineTuning.cuda_graphs``). Graphs need CUDA, FlashInfer serving attention (the torch path's decode
shapes follow the longest row) and, when the model has LoRA modules, the Triton kernels serving LoRA (the torch
loop's matmuls follow the segments).

Without ``capture`` (the tests, on the CPU) the same body runs eagerly on the same padded inputs: what the graph
would replay, checked against the unpadded step on machines without a GPU.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from .attention_layout import StepLayout
from .host_copy import to_device
from .lora_plan import SegmentPlan

if TYPE_CHECKING:
    from .model_runner import ModelRunner, SeqInput

log = logging.getLogger(__name__)

PADDING_TOKEN = 0  # what a padding row feeds: any valid id (its logits are dropped)


def graphs_unsupported(device: torch.device, attention: str, lora_kernels: bool,
                       has_lora_modules: bool) -> Optional[str]:
    """None where decode steps can be captured, else why not."""
    if device.type != "cuda":
        return "CUDA graphs need CUDA: this engine runs on the CPU"
    if attention != "flashinfer":
        return "CUDA graphs need FlashInfer serving attention (the torch path's decode shapes vary with the rows)"
    if has_lora_modules and not lora_kernels:
        return "CUDA graphs need the Triton LoRA kernels (the torch loop's matmuls follow the step's segments)"
    return None


def bucket_sizes(wanted: Sequence[int], max_batch_size: int) -> tuple[int, ...]:
    """The configured sizes up to ``max_batch_size``, plus ``max_batch_size`` itself where a configured size lies past
    it (so a full batch still fits a bucket), sorted. Batches above the largest run eagerly."""
    sizes = {b for b in wanted if 1 <= b <= max_batch_size}
    if any(b > max_batch_size for b in wanted):
        sizes.add(max_batch_size)
    return tuple(sorted(sizes))


@dataclass
class StaticDecodeInputs:
    """One bucket's fixed-address inputs: what its graph reads, refilled in place before each replay."""

    rows: int
    input_ids: torch.Tensor      # int64 [rows]
    positions: torch.Tensor      # int64 [rows]
    write_blocks: torch.Tensor   # int64 [rows]: each row's new K/V block
    write_offsets: torch.Tensor  # int64 [rows]: and its offset in that block
    plan: Optional[SegmentPlan]  # the LoRA segments, fixed width (None: the model has no LoRA modules)
    logits: Optional[torch.Tensor] = None       # [rows, vocab]: the graph's output (set at capture)
    graph: Optional[object] = None              # torch.cuda.CUDAGraph once captured
    packed: torch.Tensor = field(default=None)  # int64 [4, rows]: the four index fields, one copy per step

    @classmethod
    def allocate(cls, rows: int, device: torch.device, plan: Optional[SegmentPlan]) -> "StaticDecodeInputs":
        packed = torch.zeros(4, rows, dtype=torch.long, device=device)
        return cls(rows, packed[0], packed[1], packed[2], packed[3], plan, packed=packed)


class DecodeRows:
    """A padded decode batch as FlashInfer's plan reads it (``tables``, ``counts``, ``kv_lens``, ``block_size``): host
    lists only. A ``StepLayout`` would also stage every row's gather indices for the torch attention, host work in
    proportion to the context that a replay never reads."""

    def __init__(self, tables: Sequence[Sequence[int]], starts: Sequence[int], block_size: int):
        for i, (table, start) in enumerate(zip(tables, starts)):
            if len(table) * block_size <= start:
                raise ValueError(f"row {i}: {len(table)} blocks of {block_size} cannot hold position {start}")
        self.tables = tables
        self.starts = list(starts)
        self.counts = [1] * len(self.starts)
        self.kv_lens = [s + 1 for s in self.starts]
        self.block_size = block_size


class DecodeLayout:
    """What the model runner's decoder reads from a step's layout, as the bucket's fixed buffers (FlashInfer reads
    its own planned buffers, not the layout)."""

    def __init__(self, static: StaticDecodeInputs, block_size: int):
        self.positions = static.positions
        self.write_blocks = static.write_blocks
        self.write_offsets = static.write_offsets
        self.block_size = block_size
        self.num_tokens = static.rows


class DecodeGraphs:
    """Captured decode steps at ``sizes`` rows; ``forward`` serves a decode batch through the smallest that fits."""

    def __init__(self, runner: "ModelRunner", sizes: Sequence[int], max_model_len: int, capture: bool = True):
        """``sizes``: the buckets' rows; ``max_model_len``: the longest row's tokens (FlashInfer's page buffers);
        ``capture`` False: no graphs, ``forward`` runs the padded body eagerly (the tests, on the CPU)."""
        if not sizes:
            raise ValueError("no batch size to capture")
        if runner.pool.shape.modules and runner.kernel_device is None:
            raise ValueError("decode graphs run LoRA on the Triton kernels: this runner uses the torch loop")
        self.runner = runner
        self.sizes = tuple(sorted(set(sizes)))
        self.capture = capture
        self.device = runner.device
        cache = runner.cache
        self._scratch_block = cache.allocator.allocate()  # the padding rows' K/V go here, never a sequence's
        self.padding_table = [self._scratch_block]
        self._has_lora = bool(runner.pool.shape.modules)
        self.statics: dict[int, StaticDecodeInputs] = {}
        self.replays = 0  # steps served by a replay (or, without ``capture``, by the padded body)
        self._pool = None
        pages_per_row = -(-max_model_len // cache.block_size)
        try:
            if capture:
                self._pool = torch.cuda.graph_pool_handle()  # every bucket's graph allocates from one pool
            for rows in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory pool
                plan = self._fixed_plan(rows) if self._has_lora else None
                self.statics[rows] = StaticDecodeInputs.allocate(rows, self.device, plan)
                if capture:
                    runner.attention.prepare_graph(rows, rows * pages_per_row, runner.windows)
                    self._capture(self.statics[rows])
        except BaseException:
            self.release()
            raise

    def _fixed_plan(self, rows: int) -> SegmentPlan:
        pool = self.runner.pool
        return SegmentPlan.fixed(min(rows, pool.slots), rows, pool.max_lora_rank, self.device)

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def bucket(self, rows: int) -> Optional[int]:
        """The smallest size holding ``rows`` (None: more rows than the largest)."""
        i = bisect.bisect_left(self.sizes, rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def release(self) -> None:
        """Drop the graphs and give the scratch block back."""
        self.statics.clear()
        if self._scratch_block is not None:
            self.runner.cache.allocator.free([self._scratch_block])
            self._scratch_block = None

    # ------------------------------------------------------------------ one step

    def forward(self, seqs: Sequence["SeqInput"]) -> torch.Tensor:
        """Logits of each decode row (one token each), in input order."""
        rows = self.bucket(len(seqs))
        if rows is None:
            raise ValueError(f"{len(seqs)} rows: the largest captured bucket is {self.max_rows}")
        runner = self.runner
        static = self.statics[rows]
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        ordered = [seqs[i] for i in order]
        padding = rows - len(ordered)
        tables = [s.block_table for s in ordered] + [self.padding_table] * padding
        starts = [s.start_pos for s in ordered] + [0] * padding
        token_ids = [s.token_ids[0] for s in ordered] + [PADDING_TOKEN] * padding
        if static.plan is not None:
            static.plan.refill([s for s in runner._segments(ordered, list(range(len(ordered)))) if s.rank > 0])
        if self.capture:
            rows_view = DecodeRows(tables, starts, runner.cache.block_size)
            runner.attention.begin_step(rows_view, runner.windows, runner.scaling, graph_rows=rows)
            static.packed.copy_(_host_indices(token_ids, rows_view), non_blocking=True)
            static.graph.replay()
            logits = static.logits
        else:
            layout = StepLayout(tables, starts, [1] * rows, runner.cache.block_size, self.device)
            runner.attention.begin_step(layout, runner.windows, runner.scaling)
            logits = self._body(static, torch.tensor(token_ids, dtype=torch.long, device=self.device), layout)
        self.replays += 1
        if order == list(range(len(order))):  # already in slot order: the real rows, copied out of the graph's buffer
            return logits[:len(order)].clone()
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return logits.index_select(0, to_device(inverse, self.device))

    def _body(self, static: StaticDecodeInputs, input_ids: torch.Tensor, layout) -> torch.Tensor:
        """What a graph records: the decoder over ``static.rows`` rows with its fixed LoRA plan, then the logits."""
        runner = self.runner
        context = runner.context
        context.segments, context.padded, context.plan = [], None, static.plan
        try:
            hidden = runner._decoder_forward(input_ids, layout)
            return runner._project(runner.model.lm_head, hidden)
        finally:
            context.plan = None

    # ------------------------------------------------------------------ capture (CUDA)

    def _capture(self, static: StaticDecodeInputs) -> None:
        """Warm the bucket up eagerly on a side stream (every kernel loaded, FlashInfer planned), then record it."""
        runner = self.runner
        rows = static.rows
        layout = DecodeRows([self.padding_table] * rows, [0] * rows, runner.cache.block_size)
        if static.plan is not None:
            static.plan.refill([])
        static.packed.copy_(_host_indices([PADDING_TOKEN] * rows, layout).to(self.device))
        runner.attention.begin_step(layout, runner.windows, runner.scaling, graph_rows=rows)
        fixed = DecodeLayout(static, runner.cache.block_size)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                self._body(static, static.input_ids, fixed)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call another thread of the process makes meanwhile (a metrics exporter's) is not an
        # error of this capture
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            static.logits = self._body(static, static.input_ids, fixed)
        static.graph = graph
        log.info("captured a decode graph of %d rows", rows)


def _host_indices(token_ids: list[int], layout: DecodeRows) -> torch.Tensor:
    """The four index rows a bucket's ``packed`` buffer holds, on the host (pinned on CUDA): token ids, positions,
    K/V write blocks, offsets."""
    bs = layout.block_size
    blocks = [table[p // bs] for table, p in zip(layout.tables, layout.starts)]
    offsets = [p % bs for p in layout.starts]
    host = torch.tensor([token_ids, list(layout.starts), blocks, offsets], dtype=torch.long)
    return host.pin_memory() if torch.cuda.is_available() else host
