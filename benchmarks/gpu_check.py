"""The GPU checks in one command, for a machine's own python3 (torch, triton, transformers, peft, safetensors; no Ray,
no network, pytest optional): what a developer with a lent GPU runs, in under 8 minutes on one H100/H200.

1. preflight: versions, and which module is missing (pydantic is the one the engine's config needs beyond the
   image: carry its wheels, ``pip download pydantic -d wheels`` here, about 2.5 MB, and pass ``--wheels wheels``);
2. the CUDA tests (pytest, when installed): attention (torch and FlashInfer), the engine in bf16, PEFT equality
   with the engine on the GPU (fp32), the Triton LoRA kernels compiled, chunked prefill;
3. PEFT equality in bf16: the demo model and adapters, ours against PEFT on the same GPU: every prompt's logits
   from one forward that mixes all adapters (so the Triton kernels run; tolerance ``BF16_LOGIT_TOL`` on the
   largest absolute difference) and greedy tokens of requests served concurrently; the engine's fast paths;
4. Llama-3-8B's shapes (random bf16 weights, 8 adapters of rank 16): output tok/s for 64 mixed-adapter requests,
   the decode step at batch 32 and 64 against its measured GEMM floor (``throughput.roofline``; replayed from its
   captured CUDA graph where the engine's start-up check passed them, and at 64 eagerly beside it), the LoRA
   kernels alone against the torch loop, and one profiled batch-64 decode step (launches, host µs, GPU µs;
   ``benchmarks.gpu_profile``);
5. 32 prompts of 7.5k tokens at serve_config.gpu.yaml's settings (max_batch_size 32, max_model_len 8192): all
   finish, no out-of-memory (the token budget and chunked prefill bound every step); and how many LoRA kernel
   variants Triton compiled after the 8B engine was ready (its start-up check should have compiled them all), and
   how many fast paths the 8B engine tried at start fell back to torch (each with its reason).

Each engine is shut down and its memory handed back before the next starts. Every figure is a ``gpu_*`` goal in
the JSON. Without CUDA it says so and exits 0 with every goal unjudged.

    python3 -m benchmarks.gpu_check [--json PATH] [--wheels DIR] [--skip-tests]
"""

from __future__ import annotations

import gc
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from . import common

REQUIRED = ("torch", "numpy", "transformers", "tokenizers", "safetensors", "peft", "pydantic")
OPTIONAL = ("triton", "flashinfer", "pytest", "hypothesis", "matplotlib")
CUDA_TESTS = ("tests/test_kv_cache_cuda.py", "tests/test_kv_cache.py", "tests/test_kv_cache_peft.py",
              "tests/test_engine_peft.py", "tests/test_lora_triton.py", "tests/test_chunked_prefill.py")
BF16_LOGIT_TOL = 0.1        # bf16 keeps 8 mantissa bits: the demo's logits (|x| < 10) differ by a few 1e-2
DECODE_FLOOR_RATIO = 1.5    # decode step over its GEMMs at batch 64
DEMO_KV_BYTES = 64 << 20    # the demo engine's KV cache: small, so the 8B engine after it sizes from a free card
LONG_PROMPTS, LONG_PROMPT_TOKENS = 32, 7500
GOAL_NAMES = ("gpu_cuda_tests_failed", "gpu_peft_bf16_max_logit_diff", "gpu_peft_bf16_greedy_equal",
              "gpu_decode_vs_gemm_floor_b64", "gpu_no_oom_32x7500", "gpu_lora_compiles_after_ready",
              "gpu_fast_paths_fallen_back")


def missing_modules(names: Sequence[str]) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def install_wheels(folder: Path, modules: Sequence[str]) -> Path:
    """Install carried wheels offline into a folder put first on ``sys.path`` (and on the tests' PYTHONPATH)."""
    target = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(folder), "--target",
                    str(target), *modules], check=True)
    sys.path.insert(0, str(target))
    return target


def run_cuda_tests(extra_path: Optional[Path]) -> dict[str, Any]:
    """The CUDA-relevant test files under pytest; the summary line and the failure count."""
    if importlib.util.find_spec("pytest") is None:
        return {"summary": "pytest not installed: tests skipped", "failed": None}
    env = None
    if extra_path is not None:
        import os

        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(extra_path), os.environ.get("PYTHONPATH", ""), "."])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS],
                          capture_output=True, text=True, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else done.stderr.strip()[-300:]
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", summary))
    return {"summary": summary, "failed": failed if lines else None}


def peft_bf16_equality(device) -> dict[str, Any]:
    """Ours vs PEFT in bf16 on the same GPU: the largest logit difference over every prompt of a forward mixing
    every adapter (the Triton kernels' case), and greedy tokens of requests served concurrently."""
    import asyncio

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from deployments.config import AppArgs
    from engine.demo import ensure_demo_assets
    from engine.engine import LoRAEngine
    from engine.request import GenerateRequest

    assets = ensure_demo_assets(Path(tempfile.mkdtemp(prefix="gpu-check-demo-")), num_adapters=4)
    engine = LoRAEngine(AppArgs(base_model=str(assets.model_dir), dtype="bfloat16", max_loras_per_batch=5,
                                max_lora_rank=16, kv_cache_bytes=DEMO_KV_BYTES).engine_config("gpu-check"))
    names = list(assets.adapters)
    for name in names:
        engine.register_adapter(name, str(assets.adapters[name]))
    ref = AutoModelForCausalLM.from_pretrained(assets.model_dir, torch_dtype=torch.bfloat16).to(device).eval()
    model = peft.PeftModel.from_pretrained(ref, assets.adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(assets.adapters[name], adapter_name=name)
    prompts = [[1, *range(40, 60)], [1, *range(70, 79)], [1, 100, 101, 102]]
    batch = [(name, ids) for name in [None, *names] for ids in prompts]

    def peft_logits(name, ids):
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            if name is None:
                with model.disable_adapter():
                    return model(x).logits[0]
            model.set_adapter(name)
            return model(x).logits[0]

    async def served():
        return await asyncio.gather(*(engine.generate(GenerateRequest(adapter=n, token_ids=ids, max_tokens=8))
                                      for n, ids in batch))

    worst, equal = 0.0, 0
    try:
        ours = engine_batch_logits(engine, batch)  # one forward, every adapter: segments > 1, the kernels run
        for (name, ids), logits in zip(batch, ours):
            worst = max(worst, (logits.float() - peft_logits(name, ids).float()).abs().max().item())
        for (name, ids), result in zip(batch, asyncio.run(served())):
            ref_tokens = peft_logits(name, ids + result.token_ids[:-1])[len(ids) - 1:].argmax(-1).tolist()
            equal += ref_tokens == result.token_ids  # PEFT's greedy pick after each of our tokens
        paths = engine.stats()["fast_paths"]
    finally:
        engine.shutdown()  # frees its KV cache; run() frees the rest once this frame is gone
    return {"max_logit_diff": worst, "greedy_equal": equal, "requests": len(batch), "fast_paths": paths}


def free_device_memory() -> None:
    """Hand every freed block back to the device, so the next engine sizes its KV cache from a free card."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def engine_batch_logits(engine, batch: list[tuple[Optional[str], list[int]]]) -> list:
    """Every prompt token's logits for each (adapter, prompt) of ``batch``, from one engine forward (the engine
    idle, its step lock held)."""
    from engine.model_runner import SeqInput

    alloc = engine.cache.allocator
    with engine._step_lock:
        uids = [engine.adapters.resolve(name) for name, _ in batch]
        slots = engine.pool.prepare_lora_batch(set(uids))
        tables = [[alloc.allocate() for _ in range(alloc.blocks_for(len(ids)))] for _, ids in batch]
        try:
            flat = engine.runner.forward([SeqInput(t, ids, 0, slots[u]) for t, (_, ids), u in zip(tables, batch, uids)],
                                         all_logits=True)
        finally:
            for t in tables:
                alloc.free(t)
            engine.pool.release_batch()
    out, at = [], 0
    for _, ids in batch:
        out.append(flat[at:at + len(ids)])
        at += len(ids)
    return out


def llama3_8b_checks(device, quick: bool) -> dict[str, Any]:
    """tok/s for 64 mixed-adapter requests, the decode step at batch 32/64 against its GEMMs, 32 x 7.5k prompts."""
    import torch

    from engine.demo.tokenizer import build_tokenizer
    from pool.shapes import LoRAModelShape

    from .engine_throughput import LLAMA3_8B, build_model, make_engine
    from .gpu_profile import compiled_lora_variants, profile_decode_step, time_lora_kernels
    from .lora_compute import write_adapters
    from .throughput.roofline import base_weights, measure_decode
    from .throughput.systems import run_engine
    from .throughput.workload import WorkRequest, make_workload, summarize

    tokenizer = build_tokenizer(model_max_length=LLAMA3_8B["max_position_embeddings"])
    model = build_model(LLAMA3_8B, 0, len(tokenizer), device, torch.bfloat16)
    folders = write_adapters(Path(tempfile.mkdtemp(prefix="gpu-check-adapters-")),
                             LoRAModelShape.from_hf_config(model.config), 0)
    # serve_config.gpu.yaml's window and batch; the KV cache sized by the engine from the free memory
    engine, names = make_engine(model, tokenizer, folders, dtype="bfloat16", kv_bytes=None, block_size=16,
                                max_tokens=64, max_model_len=8192, max_batch_size=64)
    out: dict[str, Any] = {"kv_blocks": engine.cache.num_blocks, "token_budget": engine.scheduler.max_num_batched_tokens,
                           "fast_paths": engine.stats()["fast_paths"]}
    ready = compiled_lora_variants()  # the engine is ready: its start-up check compiled what serving needs
    try:
        requests = make_workload(64, (16, 512), (16, 64), seed=0)
        run_engine(engine, requests[:4], names)  # warm-up (slots loaded)
        served, started = run_engine(engine, requests, names)
        out["mixed_64"] = summarize(served, started)
        weights = base_weights(engine.model)
        for batch in (32, 64):
            out[f"decode_b{batch}"] = measure_decode(engine, weights, names, batch, 512, repeats=5 if quick else 10)
        graphs = engine.runner.graphs  # decode steps replay captured graphs when their start-up check passed
        if graphs is not None:  # the same step eagerly, beside it
            engine.at_step_boundary(lambda: setattr(engine.runner, "graphs", None))
            try:
                out["decode_b64_eager"] = measure_decode(engine, weights, names, 64, 512, repeats=5 if quick else 10)
            finally:
                engine.at_step_boundary(lambda: setattr(engine.runner, "graphs", graphs))
        served_variants = compiled_lora_variants()  # (before the kernels are timed alone, at shapes of their own)
        out["lora_compiles_after_ready"] = None if None in (ready, served_variants) else served_variants - ready
        out["lora_kernels"] = time_lora_kernels(engine, batch=64, adapters=len(names))
        out["profile_b64"] = profile_decode_step(engine, names, batch=64, context=512)
        engine.scheduler.max_batch_size = 32
        rng = torch.Generator().manual_seed(1)
        longs = [WorkRequest(i, [1] + torch.randint(3, len(tokenizer), (LONG_PROMPT_TOKENS - 1,),
                                                    generator=rng).tolist(), 4, i % len(names))
                 for i in range(LONG_PROMPTS)]
        try:
            served, started = run_engine(engine, longs, names, timeout_s=300)
            out["long_prompts"] = {"finished": len(served), "seconds": time.perf_counter() - started,
                                   "error": None, "preemptions": engine.scheduler.preemptions}
        except (RuntimeError, TimeoutError) as exc:  # an out-of-memory fails the batch: the run says so
            out["long_prompts"] = {"finished": 0, "error": repr(exc)[:300]}
    finally:
        engine.shutdown()
    return out


def judge(tests: Optional[dict], peft_eq: Optional[dict], big: Optional[dict]) -> list[dict]:
    """The ``gpu_*`` goals; a part that did not run is unjudged (``pass`` None), never passed."""
    failed = None if tests is None else tests["failed"]
    diff = None if peft_eq is None else peft_eq["max_logit_diff"]
    greedy = None if peft_eq is None else peft_eq["greedy_equal"] / peft_eq["requests"]
    ratio = None if big is None else big["decode_b64"]["step_over_gemms"]
    longs = None if big is None else big["long_prompts"]["finished"]
    compiles = None if big is None else big.get("lora_compiles_after_ready")
    fallen = None if big is None else fallen_back(big["fast_paths"])
    verdicts = [(failed, "== 0", None if failed is None else failed == 0),
                (diff, f"<= {BF16_LOGIT_TOL}", None if diff is None else diff <= BF16_LOGIT_TOL),
                (greedy, "== 1.0", None if greedy is None else greedy == 1.0),
                (ratio, f"<= {DECODE_FLOOR_RATIO}", None if ratio is None else ratio <= DECODE_FLOOR_RATIO),
                (longs, f"== {LONG_PROMPTS}", None if longs is None else longs == LONG_PROMPTS),
                (compiles, "== 0", None if compiles is None else compiles == 0),
                (fallen, "== 0", None if fallen is None else fallen == 0)]
    return [common.goal(name, measured, target, passed)
            for name, (measured, target, passed) in zip(GOAL_NAMES, verdicts)]


def fallen_back(paths: dict[str, dict]) -> int:
    """Fast paths the 8B engine tried at start that failed their check (FlashInfer, the Triton kernels, the fused
    norms and RoPE, the CUDA graphs): each is named with its reason in the printed fast paths."""
    return sum(1 for p in paths.values() if p["intended"] != "torch" and p["used"] == "torch")


def run(args) -> int:
    started = time.perf_counter()
    missing = missing_modules(REQUIRED)
    print(f"gpu_check: python {sys.version.split()[0]}; missing required: {missing or 'none'}; "
          f"missing optional: {missing_modules(OPTIONAL) or 'none'}; which gcc: {shutil.which('gcc')}; "
          f"which nvcc: {shutil.which('nvcc')} (Triton needs a host compiler; FlashInfer compiles with nvcc unless "
          f"its precompiled kernels are installed)")
    extra = install_wheels(Path(args.wheels), missing) if missing and args.wheels else None
    if missing and extra is None:
        print(f"gpu_check: carry wheels for {missing} (pip download {' '.join(missing)} -d wheels) and pass "
              f"--wheels wheels")
    import torch

    tests = peft_eq = big = None
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch: every GPU goal is left unjudged")
    elif missing and extra is None:
        print("gpu_check: required modules missing: every GPU goal is left unjudged")
    else:
        device = torch.device("cuda")
        free, total = torch.cuda.mem_get_info()
        print(f"gpu_check: {torch.cuda.get_device_name()}, {free / 2**30:.0f} of {total / 2**30:.0f} GiB free, "
              f"torch {torch.__version__}, CUDA {torch.version.cuda}")
        if not args.skip_tests:
            tests = run_cuda_tests(extra)
            print(f"CUDA tests: {tests['summary']}")
        peft_eq = peft_bf16_equality(device)
        free_device_memory()  # the demo engine and PEFT model, before the 8B engine sizes its cache
        print(f"PEFT bf16, mixed adapters: max |logit diff| {peft_eq['max_logit_diff']:.4g} (tolerance "
              f"{BF16_LOGIT_TOL}), greedy tokens equal {peft_eq['greedy_equal']}/{peft_eq['requests']}; fast paths "
              f"{ {k: v['used'] for k, v in peft_eq['fast_paths'].items()} }")
        big = llama3_8b_checks(device, args.quick)
        free_device_memory()
        common.print_table([{"system": "ours, Llama-3-8B shapes, 64 mixed requests", **big["mixed_64"]}],
                           ["system", "tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"])
        decode_rows = [big["decode_b32"], big["decode_b64"]]
        if "decode_b64_eager" in big:
            decode_rows.append({**big["decode_b64_eager"], "batch": "64, eager (no graph)"})
        common.print_table(decode_rows, ["batch", "context", "step_ms", "gemm_floor_ms", "step_over_gemms"])
        common.print_table(big["lora_kernels"], ["group", "batch", "adapters", "splits", "shrink_us", "expand_us",
                                                 "torch_loop_us"])
        profiled = big["profile_b64"]
        print(f"profiled decode step, batch 64: {profiled['launches']} kernel launches, host "
              f"{profiled['host_us']:.0f} µs, GPU {profiled['gpu_us']:.0f} µs; top kernels {profiled['top_kernels_us']}")
        print(f"8B engine fast paths: {big['fast_paths']}; LoRA kernel variants compiled after ready: "
              f"{big['lora_compiles_after_ready']} (serving 64 mixed requests and the decode steps)")
        print(f"{LONG_PROMPTS} prompts of {LONG_PROMPT_TOKENS} tokens: {big['long_prompts']}")
    goals = judge(tests, peft_eq, big)
    common.print_goals(goals)
    print(f"done in {common.elapsed_since(started)}")
    if args.json:
        path = common.write_json(args.json, "gpu_check", [], common.settings_of(args),
                                 {"tests": tests, "peft_bf16": peft_eq, "llama3_8b": big}, goals=goals)
        print(f"wrote {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--wheels", help="a folder of carried wheels for missing required modules (pip, offline)")
    parser.add_argument("--skip-tests", action="store_true", help="skip the CUDA test files")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
