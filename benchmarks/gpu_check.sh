#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA GPU (about 80 GB free for the benchmark):
#   1. the CUDA tests: paged attention (torch and FlashInfer when installed), the engine in bf16,
#      and PEFT equivalence with the engine on the GPU (fp32), preemption included;
#   2. benchmarks.engine_throughput on Llama-3-8B's shapes (random bf16 weights).
# Results land in $OUT (default: bench_out/gpu_check/): test log, JSON, PNG, benchmark log.
#
#   benchmarks/gpu_check.sh            # PYTHON=... to pick the interpreter, QUICK=1 for --quick
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-bench_out/gpu_check}"
mkdir -p "$OUT"

"$PYTHON" - <<'PY'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device visible to torch")
free, total = torch.cuda.mem_get_info()
print(f"gpu_check: {torch.cuda.get_device_name()}, {free / 2**30:.0f} of {total / 2**30:.0f} GiB free, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
try:
    import flashinfer
    print(f"gpu_check: flashinfer {flashinfer.__version__}")
except ImportError:
    print("gpu_check: flashinfer not installed (pip install -e '.[gpu]'): attention runs on torch")
PY

"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_kv_cache_cuda.py tests/test_kv_cache.py \
    tests/test_kv_cache_peft.py tests/test_engine_peft.py 2>&1 | tee "$OUT/tests.log"

QUICK_FLAG=()
if [[ "${QUICK:-0}" == "1" ]]; then QUICK_FLAG=(--quick); fi
"$PYTHON" -m benchmarks.engine_throughput --model llama3-8b "${QUICK_FLAG[@]}" \
    --json "$OUT/engine_throughput_llama3_8b.json" 2>&1 | tee "$OUT/engine_throughput.log"
