"""The GPU checks in one command, for a machine's own python3 (torch, triton, transformers, peft, safetensors; no Ray,
no network, pytest optional): what a developer with a lent GPU runs, in under 8 minutes on one H100/H200.

1. preflight: versions, and which module is missing (pydantic is the one the engine's config needs beyond the
   image: carry its wheels, ``pip download pydantic -d wheels`` here, about 2.5 MB, and pass ``--wheels wheels``);
2. the CUDA tests (pytest, when installed): attention (torch and FlashInfer), the engine in bf16, PEFT equality
   with the engine on the GPU (fp32), the Triton LoRA kernels compiled, chunked prefill;
3. PEFT equality in bf16: the demo model and adapters, ours against PEFT on the same GPU, every prompt's logits
   (tolerance ``BF16_LOGIT_TOL`` on the largest absolute difference) and greedy tokens;
4. Llama-3-8B's shapes (random bf16 weights, 8 adapters of rank 16): output tok/s for 64 mixed-adapter requests,
   and the decode step at batch 32 and 64 against its measured GEMM floor (``throughput.roofline``);
5. 32 prompts of 7.5k tokens at serve_config.gpu.yaml's settings (max_batch_size 32, max_model_len 8192): all
   finish, no out-of-memory (the token budget and chunked prefill bound every step).

Every figure is a ``gpu_*`` goal in the JSON. Without CUDA it says so and exits 0 with every goal unjudged.

    python3 -m benchmarks.gpu_check [--json PATH] [--wheels DIR] [--skip-tests]
"""

from __future__ import annotations

import importlib.util
import re
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
LONG_PROMPTS, LONG_PROMPT_TOKENS = 32, 7500
GOAL_NAMES = ("gpu_cuda_tests_failed", "gpu_peft_bf16_max_logit_diff", "gpu_peft_bf16_greedy_equal",
              "gpu_decode_vs_gemm_floor_b64", "gpu_no_oom_32x7500")


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
    """Ours vs PEFT in bf16 on the same GPU: largest logit difference over every prompt, and greedy tokens."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from deployments.config import AppArgs
    from engine.demo import ensure_demo_assets
    from engine.engine import LoRAEngine
    from engine.request import GenerateRequest

    assets = ensure_demo_assets(Path(tempfile.mkdtemp(prefix="gpu-check-demo-")), num_adapters=4)
    engine = LoRAEngine(AppArgs(base_model=str(assets.model_dir), dtype="bfloat16", max_loras_per_batch=5,
                                max_lora_rank=16).engine_config("gpu-check"))
    names = list(assets.adapters)
    ref = AutoModelForCausalLM.from_pretrained(assets.model_dir, torch_dtype=torch.bfloat16).to(device).eval()
    model = peft.PeftModel.from_pretrained(ref, assets.adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(assets.adapters[name], adapter_name=name)
    prompts = [[1, *range(40, 60)], [1, *range(70, 79)], [1, 100, 101, 102]]
    worst, equal, total = 0.0, 0, 0
    try:
        for name in [None, *names]:
            for ids in prompts:
                result = engine.generate_blocking(GenerateRequest(adapter=name, token_ids=ids, max_tokens=8))
                x = torch.tensor([ids + result.token_ids[:-1]], device=device)
                with torch.no_grad():
                    if name is None:
                        with model.disable_adapter():
                            logits = model(x).logits[0]
                    else:
                        model.set_adapter(name)
                        logits = model(x).logits[0]
                ref_tokens = logits[len(ids) - 1:].argmax(-1).tolist()  # PEFT's greedy pick after each of our tokens
                equal += ref_tokens == result.token_ids
                total += 1
                ours = engine_logits(engine, name, ids)
                worst = max(worst, (ours.float() - logits[: len(ids)].float()).abs().max().item())
    finally:
        engine.shutdown()
    return {"max_logit_diff": worst, "greedy_equal": equal, "requests": total}


def engine_logits(engine, adapter: Optional[str], ids: list[int]):
    """Every prompt token's logits from one engine forward (the engine idle, its step lock held)."""
    from engine.model_runner import SeqInput

    alloc = engine.cache.allocator
    with engine._step_lock:
        uid = engine.registry.resolve(adapter)
        slots = engine.pool.prepare_lora_batch({uid})
        table = [alloc.allocate() for _ in range(alloc.blocks_for(len(ids)))]
        try:
            return engine.runner.forward([SeqInput(table, ids, 0, slots[uid])], all_logits=True)
        finally:
            alloc.free(table)
            engine.pool.release_batch()


def llama3_8b_checks(device, quick: bool) -> dict[str, Any]:
    """tok/s for 64 mixed-adapter requests, the decode step at batch 32/64 against its GEMMs, 32 x 7.5k prompts."""
    import torch

    from engine.demo.tokenizer import build_tokenizer
    from pool.shapes import LoRAModelShape

    from .engine_throughput import LLAMA3_8B, build_model, make_engine
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
    out: dict[str, Any] = {"kv_blocks": engine.cache.num_blocks, "token_budget": engine.scheduler.max_num_batched_tokens}
    try:
        requests = make_workload(64, (16, 512), (16, 64), seed=0)
        run_engine(engine, requests[:4], names)  # warm-up (kernels compiled, slots loaded)
        served, started = run_engine(engine, requests, names)
        out["mixed_64"] = summarize(served, started)
        weights = base_weights(engine.model)
        for batch in (32, 64):
            out[f"decode_b{batch}"] = measure_decode(engine, weights, names, batch, 512, repeats=5 if quick else 10)
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
    verdicts = [(failed, "== 0", None if failed is None else failed == 0),
                (diff, f"<= {BF16_LOGIT_TOL}", None if diff is None else diff <= BF16_LOGIT_TOL),
                (greedy, "== 1.0", None if greedy is None else greedy == 1.0),
                (ratio, f"<= {DECODE_FLOOR_RATIO}", None if ratio is None else ratio <= DECODE_FLOOR_RATIO),
                (longs, f"== {LONG_PROMPTS}", None if longs is None else longs == LONG_PROMPTS)]
    return [common.goal(name, measured, target, passed)
            for name, (measured, target, passed) in zip(GOAL_NAMES, verdicts)]


def run(args) -> int:
    started = time.perf_counter()
    missing = missing_modules(REQUIRED)
    print(f"gpu_check: python {sys.version.split()[0]}; missing required: {missing or 'none'}; "
          f"missing optional: {missing_modules(OPTIONAL) or 'none'}")
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
        print(f"PEFT bf16: max |logit diff| {peft_eq['max_logit_diff']:.4g} (tolerance {BF16_LOGIT_TOL}), greedy "
              f"tokens equal {peft_eq['greedy_equal']}/{peft_eq['requests']}")
        big = llama3_8b_checks(device, args.quick)
        common.print_table([{"system": "ours, Llama-3-8B shapes, 64 mixed requests", **big["mixed_64"]}],
                           ["system", "tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"])
        common.print_table([big["decode_b32"], big["decode_b64"]],
                           ["batch", "context", "step_ms", "gemm_floor_ms", "step_over_gemms"])
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
