"""The cost of structured output: decode tok/s with every request constrained by a JSON schema,
against the same requests unconstrained, at batch 32 on one replica.

Why: ``response_format`` adds per step, per sequence, a grammar matcher filling its row of
a token bitmask (xgrammar), one masking call on the batched logits and one token accepted
per sequence; this measures what that costs a full batch.

Model: ``benchmarks.engine_throughput``'s random Llama (hidden 1024, 4 layers) with a
32,000-token byte-level BPE vocabulary trained at start on Python sources of the installed
packages (a real-sized vocabulary: the mask's cost grows with it; the demo tokenizer has
263 tokens), fp32 on the CPU (bf16 on CUDA); 4 random rank-16 adapters plus the base model.

Workload: 32 requests (``max_batch_size`` 32), 64-token prompts, temperature 1, seeded, each
generating exactly ``--tokens`` tokens (32 with ``--quick``, else 128): the schema (an array
of at least 1,000 objects with an integer, a boolean, a short string and an enum) cannot be
completed sooner, and the unconstrained run ignores EOS, so both runs do the same work.
Both alternate for ``--rounds`` rounds (1 with ``--quick``, else 3) and keep their best
round (other work on a shared machine slows a run, never speeds one up).

Goal: structured_output_tok_s_ratio = constrained tok/s / unconstrained tok/s >= 0.85.

    python -m benchmarks.structured_output [--quick] [--json PATH] [--tokens N] [--rounds N]
"""

from __future__ import annotations

import random
import site
import tempfile
import threading
import time
from pathlib import Path

import torch

from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.request import GenerateRequest, GenerateResult, TokenDelta
from pool.device import default_device
from pool.shapes import LoRAModelShape

from . import common
from .engine_throughput import MODEL, build_model
from .lora_compute import write_adapters

BATCH = 32
VOCAB = 32_000
PROMPT_TOKENS = 64
NUM_ADAPTERS_USED = 4
CORPUS_BYTES = 2 << 20
GOAL = 0.85
SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 12},
                   "kind": {"enum": ["alpha", "beta", "gamma"]}},
    "required": ["id", "ok", "name", "kind"]}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "rows", "schema": SCHEMA, "strict": True}}


def corpus_files(limit_bytes: int) -> list[str]:
    """Python sources of the installed packages, in a fixed order, up to ``limit_bytes``."""
    files, total = [], 0
    for root in sorted(site.getsitepackages()):
        for path in sorted(Path(root).glob("*/**/*.py")):
            size = path.stat().st_size
            if 2_000 < size < 200_000:
                files.append(str(path))
                total += size
                if total >= limit_bytes:
                    return files
    return files


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (``<s>`` 1, ``</s>`` 2), as transformers loads one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(corpus_files(CORPUS_BYTES), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def requests_for(tokens: int, seed: int, constrained: bool) -> list[GenerateRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(BATCH):
        adapter = None if i % (NUM_ADAPTERS_USED + 1) == 0 else f"a{i % (NUM_ADAPTERS_USED + 1) - 1}"
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS - 1)]
        out.append(GenerateRequest(adapter=adapter, token_ids=prompt, max_tokens=tokens, min_tokens=tokens,
                                   temperature=1.0, seed=seed + i, ignore_eos=True,
                                   response_format=RESPONSE_FORMAT if constrained else None))
    return out


def run_batch(engine: LoRAEngine, requests: list[GenerateRequest]) -> dict:
    """All requests at once: output tokens over the wall time from submission to the last result."""
    done = threading.Semaphore(0)
    results: list = []
    lock = threading.Lock()

    def sink(item) -> None:
        if isinstance(item, TokenDelta):
            return
        with lock:
            results.append(item)
        done.release()

    started = time.perf_counter()
    tokens_before = engine.tokens_generated
    for request in requests:
        engine.submit(request, sink)
    for _ in requests:
        if not done.acquire(timeout=900):
            raise TimeoutError("the benchmark batch did not finish in 900 s")
    seconds = time.perf_counter() - started
    failures = [r for r in results if not isinstance(r, GenerateResult)]
    if failures:
        raise failures[0]
    produced = engine.tokens_generated - tokens_before
    return {"tok_per_s": produced / seconds, "output_tokens": produced, "seconds": seconds,
            "texts": [r.text for r in results]}


def make_engine(model, tokenizer, folders: list[Path], tokens: int, dtype: str) -> LoRAEngine:
    config = AppArgs(dtype=dtype, max_loras_per_batch=NUM_ADAPTERS_USED + 1, max_lora_rank=16, max_batch_size=BATCH,
                     max_model_len=PROMPT_TOKENS + tokens + 16, max_tokens_limit=tokens,
                     enable_prefix_caching=False).engine_config("bench")
    engine = LoRAEngine(config, model=model, tokenizer=tokenizer)
    for i, folder in enumerate(folders[:NUM_ADAPTERS_USED]):
        engine.register_adapter(f"a{i}", str(folder))
    return engine


def run(args) -> int:
    started = time.perf_counter()
    device = default_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.tokens or (32 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 3)
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(VOCAB)
    tokenizer_s = time.perf_counter() - t0
    model = build_model(MODEL, args.seed, VOCAB, device, dtype)
    shape = LoRAModelShape.from_hf_config(model.config)
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_adapters(Path(tmp), shape, args.seed)
        engine = make_engine(model, tokenizer, folders, tokens, "bfloat16" if dtype == torch.bfloat16 else "float32")
        try:
            t0 = time.perf_counter()
            engine.grammar.compile(RESPONSE_FORMAT)
            compile_s = time.perf_counter() - t0
            run_batch(engine, requests_for(4, args.seed, True))  # warm-up: both paths, the grammar compiled
            run_batch(engine, requests_for(4, args.seed, False))
            best: dict[str, dict] = {}
            for r in range(rounds):
                for name, constrained in (("unconstrained", False), ("constrained", True)):
                    row = run_batch(engine, requests_for(tokens, args.seed + r, constrained))
                    if name not in best or row["tok_per_s"] > best[name]["tok_per_s"]:
                        best[name] = row
        finally:
            engine.shutdown()
    valid_prefixes = sum(t.startswith("[{") for t in best["constrained"]["texts"])
    rows = [{"system": f"batch {BATCH}, {name}", "tok_per_s": best[name]["tok_per_s"],
             "output_tokens": best[name]["output_tokens"], "seconds": best[name]["seconds"]}
            for name in ("unconstrained", "constrained")]
    common.print_table(rows, ["system", "tok_per_s", "output_tokens", "seconds"])
    print(f"tokenizer trained in {tokenizer_s:.1f} s; schema compiled in {compile_s * 1000:.1f} ms; "
          f"{valid_prefixes}/{BATCH} constrained outputs start as the schema says; took {common.elapsed_since(started)}")
    ratio = best["constrained"]["tok_per_s"] / best["unconstrained"]["tok_per_s"]
    goals = [common.goal("structured_output_tok_s_ratio", ratio, f">= {GOAL}", ratio >= GOAL)]
    common.print_goals(goals)
    if args.json:
        common.write_json(args.json, "structured_output", rows, settings=common.settings_of(args, tokens=tokens,
                          rounds=rounds, batch=BATCH, vocab=VOCAB), goals=goals)
    return 0


def main() -> int:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per request (default 128, --quick 32)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds, best kept (default 3, --quick 1)")
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
