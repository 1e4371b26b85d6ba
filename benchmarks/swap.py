"""Time to bring one adapter into a pool slot, from the host tier and from disk.

Why: a miss costs a swap-in. From the host tier (``AdapterStore.fetch`` hitting
``HostAdapterCache``) it should be a plain memory copy, so its bandwidth is compared with
one contiguous ``dst.copy_(src)`` of the same number of bytes measured in the same run
(goal: at least 80% of it). From disk (a PEFT folder re-read through
``pool.adapter.load_adapter_folder``) it is a file read plus a parse.

Llama-3-8B shapes (32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128,
intermediate 14336; q/k/v/o/gate/up/down), random weights made on the fly, ranks 8, 16
and 64, on ``pool.device.default_device()`` through the real ``LoRAMemoryPool``
(max_lora_rank 64, 2 slots). Each timed load follows an untimed ``pool.remove(uid)`` so
it really copies.

    python -m benchmarks.swap [--quick] [--json PATH] [--dtype bf16|fp32] [--layers N]
"""

from __future__ import annotations

import cProfile
import gc
import io
import json
import pstats
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch

from pool.adapter import CONFIG_FILE, WEIGHTS_FILE
from pool.device import default_device, parse_dtype
from pool.memory_pool import LoRAMemoryPool
from pool.shapes import LoRAModelShape
from pool.store import AdapterStore

from . import common

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=14336, num_hidden_layers=32)
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MAX_RANK = 64
SLOTS = 2
HOST_GOAL = 0.8  # a host-tier swap-in reaches at least this share of a plain copy's bandwidth


def llama3_8b_shape(num_layers: int = 32) -> LoRAModelShape:
    """The pool shape of Llama-3-8B with all seven target modules (optionally fewer layers)."""
    return LoRAModelShape.from_hf_config(SimpleNamespace(**{**LLAMA3_8B, "num_hidden_layers": num_layers}))


def write_peft_adapter(folder: Path, shape: LoRAModelShape, rank: int, dtype: torch.dtype, seed: int) -> int:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) with random weights; returns file bytes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for m, ms in shape.modules.items():
            prefix = f"base_model.model.model.layers.{layer}.{'self_attn' if m in _ATTN else 'mlp'}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, ms.in_features, generator=gen) * 0.01).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(ms.out_features, rank, generator=gen) * 0.01).to(dtype)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shape.modules),
              "bias": "none", "base_model_name_or_path": "meta-llama/Meta-Llama-3-8B"}
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return (folder / WEIGHTS_FILE).stat().st_size


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits for queued work on ``device`` (nothing to wait for on cpu)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class CacheFlusher:
    """Writes over a buffer larger than the CPU's last-level cache (cpu only).

    A swap-in in service copies an adapter nobody touched for a while, so on cpu both the
    pool load and the plain copy start from cold caches; without this a small adapter
    would be timed at cache speed. On CUDA the copy crosses PCIe and caches do not matter.
    """

    def __init__(self, device: torch.device, nbytes: int = 128 << 20):
        self._buf = torch.empty(nbytes, dtype=torch.uint8) if device.type == "cpu" else None

    def __call__(self) -> None:
        if self._buf is not None:
            self._buf.add_(1)


def time_swap_and_copy(pool: LoRAMemoryPool, uid: str, nbytes: int, *, repeats: int, warmup: int,
                       flush: Callable[[], None]) -> tuple[float, float]:
    """Median seconds of a real pool load of ``uid`` and of a plain copy of ``nbytes``, taking turns.

    The pool load is ``prepare_lora_batch({uid})`` + ``release_batch()`` after an untimed
    ``pool.remove(uid)``, so it really copies. The plain copy is one contiguous
    ``dst.copy_(src)`` host -> pool device, the source pinned on CUDA as the host tier's is.
    """
    numel = nbytes // torch.empty((), dtype=pool.dtype).element_size()
    src = torch.empty(numel, dtype=pool.dtype, pin_memory=pool.device.type == "cuda")
    src.fill_(1)  # touch every page so first-touch faults are not timed
    dst = torch.empty(numel, dtype=pool.dtype, device=pool.device)
    dst.fill_(0)

    def load() -> None:
        pool.prepare_lora_batch({uid})
        pool.release_batch()

    def make_room() -> None:
        if pool.is_resident(uid):
            pool.remove(uid)
        flush()

    times = common.time_alternating(
        {"pool": load, "copy": lambda: dst.copy_(src)}, repeats=repeats, warmup=warmup,
        sync=device_sync(pool.device), before={"pool": make_room, "copy": flush},
    )
    del src, dst
    return common.median(times["pool"]), common.median(times["copy"])


def profile_pool_load(pool: LoRAMemoryPool, uid: str, top: int = 12) -> str:
    """cProfile of a few host-tier loads, sorted by total time, for finding where time goes."""
    sync = device_sync(pool.device)
    prof = cProfile.Profile()
    for _ in range(3):
        if pool.is_resident(uid):
            pool.remove(uid)
        sync()
        prof.enable()
        pool.prepare_lora_batch({uid})
        pool.release_batch()
        sync()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def bench_rank(rank: int, shape: LoRAModelShape, dtype: torch.dtype, device: torch.device, root: Path,
               *, repeats: int, disk_repeats: int, seed: int, profile: bool) -> list[common.Row]:
    """Host-tier and disk swap-in of one rank, each beside a plain copy of the same bytes."""
    folder = root / f"rank{rank}"
    file_bytes = write_peft_adapter(folder, shape, rank, dtype, seed + rank)

    host = AdapterStore(shape, MAX_RANK, dtype=dtype, host_cache_bytes=1 << 40)
    host.register("host", str(folder))
    disk = AdapterStore(shape, MAX_RANK, dtype=dtype, host_cache_bytes=0)  # every fetch re-reads the folder
    disk.register("disk", str(folder))
    nbytes = host.record("host").nbytes

    def fetch(uid: str):
        return (host if uid == "host" else disk).fetch(uid)

    pool = LoRAMemoryPool(shape, SLOTS, MAX_RANK, fetch, device=device, dtype=dtype)
    flush = CacheFlusher(device)
    rows = []
    for source, reps, warm in (("host", repeats, 2), ("disk", disk_repeats, 1)):
        seconds, copy_s = time_swap_and_copy(pool, source, nbytes, repeats=reps, warmup=warm, flush=flush)
        rows.append({
            "rank": rank, "source": source, "layers": shape.num_layers, "MB": nbytes / 1e6,
            "seconds": seconds, "GB/s": nbytes / seconds / 1e9,
            "copy_s": copy_s, "copy_GB/s": nbytes / copy_s / 1e9,
            "ratio": copy_s / seconds,
            "goal_met": (copy_s / seconds >= HOST_GOAL) if source == "host" else None,
            "file_MB": file_bytes / 1e6,
        })
    if profile:
        print(f"\n--- profile: host-tier load, rank {rank} ---")
        print(profile_pool_load(pool, "host"))
    del pool, host, disk
    gc.collect()
    return rows


def swap_goals(rows: Sequence[common.Row]) -> list[common.Goal]:
    """One goal per rank: the host-tier load's bandwidth over the plain copy's (the table's goal_met)."""
    return [common.goal(f"host swap-in / plain copy bandwidth, rank {r['rank']}", r["ratio"], f">= {HOST_GOAL}",
                        r["goal_met"])
            for r in rows if r["source"] == "host"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = common.base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bf16",
                        help="pool and adapter dtype: bf16 (default, what GPUs serve) or fp32")
    parser.add_argument("--layers", type=int, help="decoder layers (default 32, as Llama-3-8B)")
    parser.add_argument("--ranks", default="8,16,64", help="comma-separated ranks (default 8,16,64)")
    parser.add_argument("--tmpdir", help="where to write the PEFT folders (default: the system temp dir)")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of the host-tier load")
    parser.add_argument(
        "--threads", type=int,
        help="torch CPU threads (default: 1 on cpu, torch's choice on cuda). One thread already nears memory "
             "bandwidth for a copy, and with more, every copy_ call waits for all threads, so another "
             "process on a core stalls each of the pool's 14 copies by a scheduler slice",
    )
    args = parser.parse_args(argv)
    device = default_device()
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)

    dtype = parse_dtype(args.dtype)
    layers = args.layers or 32
    ranks = [int(r) for r in args.ranks.split(",")]
    if max(ranks) > MAX_RANK:
        parser.error(f"ranks must be <= {MAX_RANK}")
    repeats, disk_repeats = (11, 3) if args.quick else (41, 7)
    shape = llama3_8b_shape(layers)
    started = time.perf_counter()

    rows: list[common.Row] = []
    with tempfile.TemporaryDirectory(prefix="lorafleet-swap-", dir=args.tmpdir) as tmp:
        for rank in ranks:
            rows += bench_rank(rank, shape, dtype, device, Path(tmp), repeats=repeats,
                               disk_repeats=disk_repeats, seed=args.seed, profile=args.profile)

    note = "" if layers == 32 else f" (only {layers} of Llama-3-8B's 32 layers)"
    common.print_table(
        rows, ["rank", "source", "layers", "MB", "seconds", "GB/s", "copy_s", "copy_GB/s", "ratio", "goal_met"],
        title=(f"swap-in of one Llama-3-8B-shaped adapter{note}, {args.dtype}, device {device} "
               f"(torch CPU threads: {torch.get_num_threads()}), "
               f"pool max_rank {MAX_RANK} x {SLOTS} slots; median of {repeats} (disk: {disk_repeats}); "
               f"copy = one contiguous dst.copy_(src) of the same bytes, timed in turns with the load"
               f"{', pinned host memory' if device.type == 'cuda' else ', CPU caches flushed before each'}; "
               f"ratio = copy_s / seconds "
               f"(goal >= {HOST_GOAL} for host); disk = PEFT folder just written (page cache warm)"),
    )
    goals = swap_goals(rows)
    print()
    common.print_goals(goals)
    print(f"({common.elapsed_since(started)})")
    if args.json:
        settings = common.settings_of(
            args, layers=layers, ranks=ranks, repeats=repeats, disk_repeats=disk_repeats, device=str(device),
            torch_threads=torch.get_num_threads(), slots=SLOTS, max_lora_rank=MAX_RANK,
            layout="slot: [layers, slots, max_rank, features], B transposed",
            shape={m: [s.in_features, s.out_features] for m, s in shape.modules.items()},
        )
        common.write_json(args.json, "swap", rows, settings, goals=goals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
