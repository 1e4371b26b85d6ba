#!/usr/bin/env bash
# The GPU checks in one go, with the machine's own python3 (no venv, no Ray, no network needed):
# see benchmarks/gpu_check.py for what runs and the gpu_* goals it writes.
#   benchmarks/gpu_check.sh [--json PATH] [--wheels DIR] [--skip-tests]     # PYTHON=... to pick the interpreter
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-bench_out/gpu_check}"
mkdir -p "$OUT"
"${PYTHON:-python3}" -m benchmarks.gpu_check --json "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
