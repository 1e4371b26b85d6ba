"""Which fast paths this engine uses, decided once at start by running each against the plain torch path.

A fast path (FlashInfer attention, the Triton LoRA kernels, oneDNN's linear on the CPU) can fail on a machine the
project never ran on: a missing compiler, a kernel the card's driver refuses, wrong
numbers from a version mismatch. Each one the engine intends to use runs one tiny step at
start (``engine.check_attention``, ``engine.check_lora``, ``engine.cpu_gemm``), which also compiles every
variant serving will need, so nothing compiles after the replica is ready. Any error, or a
result further from the torch path than ``EngineTuning.check_tolerance`` allows, is logged
once and the engine uses the torch path instead. The decisions are reported in
``LoRAEngine.stats()["fast_paths"]`` (and from there in the replica's metadata).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Callable, Optional

log = logging.getLogger(__name__)
_logged: set[str] = set()


@dataclass
class FastPath:
    """One decision: the path ``name`` runs on ``used`` (``intended`` is what the settings and device asked for)."""

    # "attention" | "lora_kernels" | "cpu_gemm" | "sparse_scores" | "fused_ops" | "cuda_graphs"
    name: str
    intended: str                   # the fast path's name, or "torch" when none was wanted
    used: str                       # what serves: the fast path's name or "torch"
    reason: str = ""                # why the torch path serves ("" when the fast path does)
    check_error: Optional[float] = None  # the check's largest |fast - torch| over the largest |torch|

    @property
    def fast(self) -> bool:
        return self.used != "torch"

    def as_dict(self) -> dict:
        return asdict(self)


def log_once(message: str) -> None:
    """A fallback is logged once per process, not once per engine (tests and benchmarks build many)."""
    if message not in _logged:
        _logged.add(message)
        log.warning(message)


def decide(name: str, fast_name: str, setting: str, supported: Optional[str], check: Callable[[], float],
           tolerance: float) -> FastPath:
    """Run ``check`` (it returns the relative error of the fast path) unless the setting or device rules the fast
    path out. ``supported``: None when the device can take the fast path, else why it cannot (``auto`` then uses
    torch quietly; ``fast`` tries anyway: the check decides)."""
    if setting == "torch":
        return FastPath(name, "torch", "torch", "set to torch")
    if setting == "auto" and supported is not None:
        return FastPath(name, "torch", "torch", supported)
    try:
        error = float(check())
    except Exception as exc:  # an import, compile or launch failure: any of them means "not on this machine"
        reason = f"{fast_name} failed its start-up check ({type(exc).__name__}: {str(exc)[:300]})"
        log_once(f"{name}: {reason}; using torch")
        return FastPath(name, fast_name, "torch", reason)
    if not (math.isfinite(error) and error <= tolerance):
        reason = f"{fast_name} differs from torch by {error:.3g} of the output's scale (tolerance {tolerance:.3g})"
        log_once(f"{name}: {reason}; using torch")
        return FastPath(name, fast_name, "torch", reason, error)
    return FastPath(name, fast_name, fast_name, "", error)


def relative_error(got, expected) -> float:
    """Largest |got - expected| over the largest |expected| (1 when that is below 1: absolute for tiny outputs)."""
    diff = (got.float() - expected.float()).abs().max().item()
    return diff / max(1.0, expected.float().abs().max().item())


def choose_fast_paths(model, pool, device, dtype, tuning) -> dict[str, FastPath]:
    """The checked decision for each fast path (``attention``: flashinfer or torch; ``lora_kernels``: triton or
    torch; ``cpu_gemm``: onednn or torch; ``sparse_scores``: sampled_addmm or torch; ``fused_ops``: flashinfer or
    torch), in the order the engine needs them (attention decides the KV cache's layout)."""
    from . import cpu_gemm
    from .attention import FLASHINFER_DTYPES, FLASHINFER_HEAD_DIMS, sparse_scores_unsupported
    from .check_attention import flashinfer_error, sparse_scores_error
    from .check_lora import lora_kernel_error
    from .decoder_ops import fused_ops_error, fused_ops_unsupported
    from .model_runner import window_of

    tolerance = tuning.check_tolerance[str(dtype).removeprefix("torch.")]
    attn = model.model.layers[0].self_attn
    head_dim = attn.head_dim
    heads, kv_heads = attn.q_proj.weight.shape[0] // head_dim, attn.k_proj.weight.shape[0] // head_dim
    windows = [window_of(layer.self_attn, model.config) for layer in model.model.layers]
    on_cuda = device.type == "cuda"
    attention_unsupported = None
    if not (on_cuda and dtype in FLASHINFER_DTYPES and head_dim in FLASHINFER_HEAD_DIMS):
        attention_unsupported = (f"FlashInfer takes CUDA, {[str(d) for d in FLASHINFER_DTYPES]} and head sizes "
                                 f"{FLASHINFER_HEAD_DIMS}: this engine is {device.type}, {dtype}, head size {head_dim}")
    attention = decide("attention", "flashinfer", tuning.attention, attention_unsupported,
                       lambda: flashinfer_error(device, dtype, heads, kv_heads, head_dim, windows, attn.scaling,
                                                tuning.check_seed), tolerance)
    lora = decide("lora_kernels", "triton", tuning.lora_kernels,
                  None if on_cuda else "the Triton kernels compile for GPUs: the CPU runs the torch segment loop",
                  lambda: lora_kernel_error(pool, tuning.lora_target_programs, tuning.check_seed), tolerance)
    # never on another device, even when set to "fast": its GEMMs are the device's own
    gemm = decide("cpu_gemm", "onednn", tuning.cpu_gemm if device.type == "cpu" else "auto",
                  cpu_gemm.unsupported(device, dtype),
                  lambda: cpu_gemm.gemm_error(dtype, tuning.check_seed), tolerance)
    if attention.fast:  # FlashInfer reads the cache itself
        scores = FastPath("sparse_scores", "torch", "torch", "FlashInfer serves attention")
    else:
        scores = decide("sparse_scores", "sampled_addmm", tuning.sparse_scores, sparse_scores_unsupported(device, dtype),
                        lambda: sparse_scores_error(device, dtype, heads, kv_heads, head_dim, windows, attn.scaling,
                                                    tuning.check_seed), tolerance)
    max_positions = getattr(model.config, "max_position_embeddings", 2048)
    fused = decide("fused_ops", "flashinfer", tuning.fused_ops, fused_ops_unsupported(device, dtype),
                   lambda: fused_ops_error(model, device, dtype, max_positions, tuning.check_seed), tolerance)
    return {"attention": attention, "lora_kernels": lora, "cpu_gemm": gemm, "sparse_scores": scores,
            "fused_ops": fused}


def capture_decode_graphs(runner, tuning, paths: dict[str, FastPath], max_batch_size: int,
                          max_model_len: int) -> FastPath:
    """Capture the decode graphs (``engine.decode_graphs``) and check them against the eager step
    (``engine.check_graphs``); where they pass, ``runner.graphs`` serves decode steps from then on. Decided after the
    others: graphs need FlashInfer and the Triton kernels to have passed theirs."""
    from .check_graphs import graph_error
    from .decode_graphs import DecodeGraphs, bucket_sizes, graphs_unsupported

    built: list[DecodeGraphs] = []

    def check() -> float:
        sizes = bucket_sizes(tuning.cuda_graph_batch_sizes, max_batch_size)
        if not sizes:
            raise ValueError(f"no cuda_graph_batch_sizes up to max_batch_size {max_batch_size}")
        built.append(DecodeGraphs(runner, sizes, max_model_len))
        return graph_error(built[0], tuning.check_seed, max_model_len - 1)

    unsupported = graphs_unsupported(runner.device, paths["attention"].used, paths["lora_kernels"].fast,
                                     bool(runner.pool.shape.modules))
    tolerance = tuning.check_tolerance[str(runner.pool.dtype).removeprefix("torch.")]
    decision = decide("cuda_graphs", "cuda_graphs", tuning.cuda_graphs, unsupported, check, tolerance)
    if decision.fast:
        runner.graphs = built[0]
    elif built:
        built[0].release()
    return decision
