"""The engine's performance settings: which fast paths it may use and how it checks them.

Kept apart from ``EngineConfig`` (whose values all come from the application args) because
none of these changes what a request gets back, only how fast it comes: each fast path is
checked against the plain torch path at start (``engine.fast_paths``) and dropped if it
disagrees, so a wrong setting here costs speed, never correctness. Every field has its
default here and its unit in its comment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAST_PATH_CHOICES = ("auto", "torch", "fast")


def _default_tolerances() -> dict[str, float]:
    # fp32: the paths sum in different orders; bf16/fp16: a few roundings at 8 / 11 significant bits
    # (engine.lora_triton's tests state and measure the bf16 figure)
    return {"float32": 1e-4, "bfloat16": 2 ** -5, "float16": 2 ** -8}


@dataclass(frozen=True)
class EngineTuning:
    # "auto": the fast path where the device supports it (CUDA), if its start-up check passes; "torch": never;
    # "fast": try it on any device (the tests use it on the CPU under Triton's interpreter), still checked
    attention: str = "auto"             # FlashInfer paged attention (CUDA, fp16/bf16) vs torch
    lora_kernels: str = "auto"          # the segmented Triton LoRA kernels vs the torch segment loop
    cpu_gemm: str = "auto"              # the base projections through oneDNN's linear vs F.linear (CPU, float32)
    # decode attention's scores as one sampled_addmm that reads K where it lies in the cache vs gathered K and a
    # batched matmul (CPU, float32; ``engine.attention``)
    sparse_scores: str = "auto"
    # RMSNorm, the residual add and RoPE on FlashInfer's fused kernels vs torch's ops (CUDA, fp16/bf16;
    # ``engine.decoder_ops``)
    fused_ops: str = "auto"
    # decode-only steps replayed as CUDA graphs (``engine.decode_graphs``: CUDA with FlashInfer and, for LoRA models,
    # the Triton kernels), captured and checked against the eager step at start
    cuda_graphs: str = "auto"
    # rows of the captured decode batches (a step runs as the smallest that holds it, padded; above the largest it
    # runs eagerly); sizes above the engine's max_batch_size are dropped for max_batch_size itself
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    lora_target_programs: int = 264     # programs (CTAs) split-K shrink aims for per launch: ~2 per SM of an H100/H200
    # largest |fast - torch| allowed in the start-up check, as a fraction of the largest |torch| output, per dtype
    check_tolerance: dict[str, float] = field(default_factory=_default_tolerances)
    check_seed: int = 0                 # the random inputs of the start-up check (reproducible reports)
    # free the OpenMP team of a thread that built the engine or registered an adapter once it is done, so the engine
    # thread's team is the process's only one (``engine.openmp_team``: two teams on 2 cores slowed a step 20%)
    free_caller_openmp_teams: bool = True

    def __post_init__(self) -> None:
        for name in ("attention", "lora_kernels", "cpu_gemm", "sparse_scores", "fused_ops", "cuda_graphs"):
            if getattr(self, name) not in FAST_PATH_CHOICES:
                raise ValueError(f"{name} must be one of {FAST_PATH_CHOICES} (got {getattr(self, name)!r})")
        if self.lora_target_programs < 1:
            raise ValueError(f"lora_target_programs must be at least 1 (got {self.lora_target_programs})")
        if not self.cuda_graph_batch_sizes or any(b < 1 for b in self.cuda_graph_batch_sizes):
            raise ValueError(f"cuda_graph_batch_sizes must be positive row counts (got {self.cuda_graph_batch_sizes})")
