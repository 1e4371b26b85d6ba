"""Cost of the LoRA computation in one engine step, against the base model and PEFT.

Why: the engine's LoRA layers (``engine.lora_layers.LoRALinear``) add a segmented
``scale * (x @ A.T) @ B.T`` per pool slot to every target projection. This measures what
that costs in a whole step of ``engine.model_runner.ModelRunner`` and compares it with
PEFT's mixed-batch forward (``PeftModel(..., adapter_names=[...])``) on the same model.

Model: a random Llama (``LlamaConfig`` + ``LlamaForCausalLM``, seeded init), hidden 1024,
16 heads, 8 KV heads (head_dim 64), intermediate 2816, vocab 32000, 8 layers (4 with
``--quick``). Both sides compute lm_head for the last token of each request only (ours by
design, PEFT through ``logits_to_keep=1``), so the vocabulary does not swamp prefill.
Adapters: 8 random PEFT adapters (``engine.demo.write_demo_adapter``), rank 16 on
q/k/v/o/gate/up/down, read by ``pool.store.AdapterStore`` into a ``LoRAMemoryPool``
(9 slots: 8 adapters + the base) and by ``PeftModel.from_pretrained``/``load_adapter``.
Two copies of the model: ``attach_lora`` wraps ours in place, PEFT wraps its own (adapters
kept in the model dtype, ``autocast_adapter_dtype=False``, as ours are).

Steps timed (whole step, warm-up then median; the cases take turns each repeat):
  decode  - 32 requests x 1 new token with 64 tokens already cached: our
            ``ModelRunner.forward`` of 32 ``SeqInput(start_pos=64)``; PEFT: a ``[32, 1]``
            forward with a ``DynamicCache`` of length 64 (cropped back, untimed, after each).
  prefill - 8 requests x 128 tokens from an empty cache.
Cases: base (no adapters), one adapter for every request, 8 adapters (4 decode requests
each; 1 prefill request each), PEFT base (adapters disabled), PEFT one adapter, PEFT
mixed batch with the 8 adapters. Requests are interleaved (request i uses adapter i % 8),
so our runner's grouping by slot is part of the measured step.

Goals: our 8-adapter decode <= 1.3x our base decode; ours >= 1.5x faster than PEFT's
mixed batch, for decode and for prefill. Correctness is checked once: our 8-adapter
logits against PEFT's mixed-batch logits (prefill and decode).

Device: cuda when available (bf16, synchronised timing), else the CPU in fp32 with
torch threads = the cores this process may use.

    python -m benchmarks.lora_compute [--quick] [--json PATH] [--layers N] [--repeats N] [--dtype D]
"""

from __future__ import annotations

import copy
import inspect
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from engine.demo import write_demo_adapter
from engine.kv_cache import PagedKVCache
from engine.lora_layers import LoRABatchContext, attach_lora
from engine.model_runner import ModelRunner, SeqInput
from pool.device import default_device, parse_dtype
from pool.memory_pool import LoRAMemoryPool
from pool.shapes import ALL_TARGET_MODULES, LoRAModelShape
from pool.store import AdapterStore

from . import common

MODEL = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
             head_dim=64, vocab_size=32000)
RANK = 16
ADAPTER_STRENGTH = 0.01  # std of each entry of scaling * B @ A; base weights have std 0.02
NUM_ADAPTERS = 8
DECODE_BATCH, DECODE_CONTEXT = 32, 64
PREFILL_BATCH, PREFILL_LEN = 8, 128
DECODE_GOAL = 1.3     # our 8-adapter decode / our base decode must not exceed this
PEFT_GOAL = 1.5       # PEFT mixed / our 8-adapter must reach this

CASES = (
    ("ours", "base"), ("ours", "1 adapter"), ("ours", "8 adapters"),
    ("peft", "base"), ("peft", "1 adapter"), ("peft", "8 adapters mixed"),
)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def build_model(num_layers: int, seed: int, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=num_layers, max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, **MODEL)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    return model


def write_adapters(root: Path, shape: LoRAModelShape, seed: int) -> list[Path]:
    return [
        write_demo_adapter(root / f"a{i}", shape, rank=RANK, target_modules=ALL_TARGET_MODULES, alpha=2.0 * RANK,
                           seed=seed * 1000 + i, strength=ADAPTER_STRENGTH)
        for i in range(NUM_ADAPTERS)
    ]


class Ours:
    """Our engine pieces around one model copy: store, pool, LoRA layers, KV cache, runner."""

    def __init__(self, model, shape: LoRAModelShape, folders: Sequence[Path], device, dtype):
        self.store = AdapterStore(shape, RANK, dtype=dtype)
        self.uids = [f"a{i}" for i in range(len(folders))]
        for uid, folder in zip(self.uids, folders):
            self.store.register(uid, str(folder))
        self.pool = LoRAMemoryPool(shape, len(folders) + 1, RANK, self.store.fetch, device=device, dtype=dtype)
        self.slots = self.pool.prepare_lora_batch({None, *self.uids})
        self.context = LoRABatchContext()
        attach_lora(model, self.pool, self.context)
        attn = model.model.layers[0].self_attn
        kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
        self.cache = PagedKVCache(len(model.model.layers), DECODE_BATCH + PREFILL_BATCH,
                                  max(DECODE_CONTEXT + 1, PREFILL_LEN), kv_heads, attn.head_dim, device=device, dtype=dtype)
        self.runner = ModelRunner(model, self.pool, self.cache, self.context)

    def slot(self, adapter: Optional[int]) -> int:
        return self.slots[None if adapter is None else self.uids[adapter]]

    def context_fill(self, context_ids: torch.Tensor, adapters: Sequence[Optional[int]]) -> torch.Tensor:
        seqs = [SeqInput(block_table=[i], token_ids=context_ids[i].tolist(), start_pos=0, slot=self.slot(a))
                for i, a in enumerate(adapters)]
        return self.runner.forward(seqs)

    def decode_seqs(self, tokens: torch.Tensor, adapters: Sequence[Optional[int]]) -> list[SeqInput]:
        return [SeqInput(block_table=[i], token_ids=[int(tokens[i])], start_pos=DECODE_CONTEXT, slot=self.slot(a))
                for i, a in enumerate(adapters)]

    def prefill_seqs(self, prompt_ids: torch.Tensor, adapters: Sequence[Optional[int]]) -> list[SeqInput]:
        return [SeqInput(block_table=[DECODE_BATCH + i], token_ids=prompt_ids[i].tolist(), start_pos=0, slot=self.slot(a))
                for i, a in enumerate(adapters)]


class Peft:
    """PEFT's ``PeftModel`` with the same 8 adapters on the other model copy."""

    def __init__(self, model, folders: Sequence[Path]):
        from peft import PeftModel

        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        self.names = [f"a{i}" for i in range(len(folders))]
        # autocast off: PEFT would otherwise keep bf16 models' adapters in fp32; ours are in the model dtype
        self.model = PeftModel.from_pretrained(model, str(folders[0]), adapter_name=self.names[0],
                                               autocast_adapter_dtype=False)
        for name, folder in zip(self.names[1:], folders[1:]):
            self.model.load_adapter(str(folder), adapter_name=name, autocast_adapter_dtype=False)
        self.model.eval()
        # transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns)
        params = inspect.signature(type(model).forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def forward(self, input_ids: torch.Tensor, mode: str, adapters: Sequence[Optional[int]], past=None):
        """``mode``: "base" (adapters disabled), "single" (adapter ``adapters[0]`` active), "mixed"."""
        kwargs = {"input_ids": input_ids, self.cache_kwarg: past, "use_cache": True, "logits_to_keep": 1}
        with torch.inference_mode():
            if mode == "base":
                with self.model.disable_adapter():
                    return self.model(**kwargs)
            if mode == "single":
                self.model.set_adapter(self.names[adapters[0]])
                return self.model(**kwargs)
            names = ["__base__" if a is None else self.names[a] for a in adapters]
            return self.model(**kwargs, adapter_names=names)


def cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def crop_cache(cache, length: int) -> None:
    """Drop what a decode step appended, so every repeat decodes against ``length`` cached tokens."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # negative: "remove this many" (accepted by old and new transformers)


def run(args) -> int:
    started = time.perf_counter()
    device = default_device()
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = parse_dtype(args.dtype)
    threads = usable_cores()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    layers = args.layers or (4 if args.quick else 8)
    repeats = args.repeats or (3 if args.quick else 7)
    warmup = 1 if args.quick else 2
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    print(f"lora_compute: random Llama, {layers} layers{' (--quick)' if args.quick else ''}, hidden "
          f"{MODEL['hidden_size']}, {MODEL['num_attention_heads']} heads / {MODEL['num_key_value_heads']} KV heads, "
          f"intermediate {MODEL['intermediate_size']}, vocab {MODEL['vocab_size']} (lm_head on last tokens only); "
          f"{NUM_ADAPTERS} adapters rank {RANK} on {'/'.join(m.split('_')[0] for m in ALL_TARGET_MODULES)}")
    print(f"device {device} {str(dtype).replace('torch.', '')}"
          + (f", {torch.get_num_threads()} torch threads" if device.type == "cpu" else f" ({torch.cuda.get_device_name()})")
          + f"; decode {DECODE_BATCH} x 1 token after {DECODE_CONTEXT} cached, prefill {PREFILL_BATCH} x {PREFILL_LEN}; "
          f"median of {repeats} after {warmup} warm-up")

    ours_model = build_model(layers, args.seed, device, dtype)
    peft_model = copy.deepcopy(ours_model)
    shape = LoRAModelShape.from_hf_config(ours_model.config)
    tmp = tempfile.TemporaryDirectory(prefix="lorafleet-lora-compute-")
    folders = write_adapters(Path(tmp.name), shape, args.seed)
    ours = Ours(ours_model, shape, folders, device, dtype)
    peft = Peft(peft_model, folders)

    gen = torch.Generator().manual_seed(args.seed)
    vocab = MODEL["vocab_size"]
    context_ids = torch.randint(3, vocab, (DECODE_BATCH, DECODE_CONTEXT), generator=gen)
    decode_ids = torch.randint(3, vocab, (DECODE_BATCH, 1), generator=gen)
    prompt_ids = torch.randint(3, vocab, (PREFILL_BATCH, PREFILL_LEN), generator=gen)
    mixed_decode = [i % NUM_ADAPTERS for i in range(DECODE_BATCH)]
    mixed_prefill = [i % NUM_ADAPTERS for i in range(PREFILL_BATCH)]
    adapter_sets = {
        "base": ([None] * DECODE_BATCH, [None] * PREFILL_BATCH),
        "1 adapter": ([0] * DECODE_BATCH, [0] * PREFILL_BATCH),
        "8 adapters": (mixed_decode, mixed_prefill),
    }

    # ---------------------------------------------------------------- correctness, once
    ours.context_fill(context_ids.to(device), mixed_decode)
    ours_decode = ours.runner.forward(ours.decode_seqs(decode_ids[:, 0], mixed_decode)).float()
    ours_prefill = ours.runner.forward(ours.prefill_seqs(prompt_ids, mixed_prefill)).float()
    peft_caches = {}
    for mode, adapters in (("base", [None] * DECODE_BATCH), ("single", [0] * DECODE_BATCH), ("mixed", mixed_decode)):
        peft_caches[mode] = cache_of(peft.forward(context_ids.to(device), mode, adapters))
    peft_decode = peft.forward(decode_ids.to(device), "mixed", mixed_decode, peft_caches["mixed"]).logits[:, -1].float()
    crop_cache(peft_caches["mixed"], DECODE_CONTEXT)
    if peft_caches["mixed"].get_seq_length() != DECODE_CONTEXT:
        raise RuntimeError(f"PEFT cache is {peft_caches['mixed'].get_seq_length()} tokens after cropping, "
                           f"expected {DECODE_CONTEXT}")
    peft_prefill = peft.forward(prompt_ids.to(device), "mixed", mixed_prefill).logits[:, -1].float()
    peft_prefill_base = peft.forward(prompt_ids.to(device), "base", mixed_prefill).logits[:, -1].float()
    decode_diff = (ours_decode - peft_decode).abs().max().item()
    prefill_diff = (ours_prefill - peft_prefill).abs().max().item()
    adapter_effect = (peft_prefill - peft_prefill_base).abs().max().item()
    logit_scale = peft_prefill.abs().max().item()
    # fp32: summation order only; bf16: 8 bits of mantissa through every layer, so relative to the logits
    tolerance = 1e-3 if dtype == torch.float32 else 0.05 * max(logit_scale, 1.0)
    correct = max(decode_diff, prefill_diff) <= tolerance
    print(f"correctness (ours 8 adapters vs PEFT mixed batch): max |logit diff| decode {decode_diff:.2e}, "
          f"prefill {prefill_diff:.2e} (max |logit| {logit_scale:.2g}; adapters move logits by up to "
          f"{adapter_effect:.2g}; "
          f"tolerance {tolerance:g}) -> {'OK' if correct else 'MISMATCH'}")

    # ---------------------------------------------------------------- timing
    decode_fns, prefill_fns, decode_before = {}, {}, {}
    for impl, case in CASES:
        key = f"{impl}: {case}"
        if impl == "ours":
            dec_adapters, pre_adapters = adapter_sets[case]
            dec_seqs = ours.decode_seqs(decode_ids[:, 0], dec_adapters)
            pre_seqs = ours.prefill_seqs(prompt_ids, pre_adapters)
            decode_fns[key] = lambda s=dec_seqs: ours.runner.forward(s)
            prefill_fns[key] = lambda s=pre_seqs: ours.runner.forward(s)
        else:
            mode = {"base": "base", "1 adapter": "single", "8 adapters mixed": "mixed"}[case]
            dec_adapters, pre_adapters = adapter_sets["8 adapters" if mode == "mixed" else case]
            cache = peft_caches[mode]
            d_ids, p_ids = decode_ids.to(device), prompt_ids.to(device)
            decode_fns[key] = lambda m=mode, a=dec_adapters, c=cache: peft.forward(d_ids, m, a, c)
            decode_before[key] = lambda c=cache: crop_cache(c, DECODE_CONTEXT)
            prefill_fns[key] = lambda m=mode, a=pre_adapters: peft.forward(p_ids, m, a)
    decode_t = common.time_alternating(decode_fns, repeats=repeats, warmup=warmup, sync=sync, before=decode_before)
    prefill_t = common.time_alternating(prefill_fns, repeats=repeats, warmup=warmup, sync=sync)

    decode_ms = {k: 1e3 * common.median(v) for k, v in decode_t.items()}
    prefill_ms = {k: 1e3 * common.median(v) for k, v in prefill_t.items()}
    base_d, base_p = decode_ms["ours: base"], prefill_ms["ours: base"]
    rows = []
    for impl, case in CASES:
        key = f"{impl}: {case}"
        rows.append({
            "case": key,
            "decode_ms": decode_ms[key],
            "prefill_ms": prefill_ms[key],
            "decode_vs_our_base": decode_ms[key] / base_d,
            "prefill_vs_our_base": prefill_ms[key] / base_p,
            "decode_ms_min": 1e3 * min(decode_t[key]),
            "prefill_ms_min": 1e3 * min(prefill_t[key]),
        })
    print()
    common.print_table(rows, ["case", "decode_ms", "prefill_ms", "decode_vs_our_base", "prefill_vs_our_base"],
                       floatfmt=".4g")

    ours8_d, ours8_p = decode_ms["ours: 8 adapters"], prefill_ms["ours: 8 adapters"]
    peft8_d, peft8_p = decode_ms["peft: 8 adapters mixed"], prefill_ms["peft: 8 adapters mixed"]
    goals = compute_goals(base_d, ours8_d, ours8_p, peft8_d, peft8_p, max(decode_diff, prefill_diff), tolerance)
    print()
    common.print_goals(goals)
    print(f"ceiling: PEFT mixed is {peft8_d / base_d:.2f}x (decode) and {peft8_p / base_p:.2f}x (prefill) our "
          f"base step, so no LoRA implementation here can beat it by more than that")
    if device.type == "cpu" and load_before > 0.5 * threads:
        print(f"note: load average was {load_before:.1f} on {threads} cores when the run started; "
              f"other work on this machine makes the timings noisy")
    print(f"total {common.elapsed_since(started)}")

    if args.json:
        settings = common.settings_of(
            args, layers=layers, repeats=repeats, warmup=warmup, device=str(device), dtype=str(dtype),
            threads=torch.get_num_threads(), load_average_at_start=load_before, model=MODEL, rank=RANK, adapters=NUM_ADAPTERS,
            decode=dict(batch=DECODE_BATCH, context=DECODE_CONTEXT), prefill=dict(batch=PREFILL_BATCH, len=PREFILL_LEN))
        extra = {"correctness": dict(decode_max_abs_diff=decode_diff, prefill_max_abs_diff=prefill_diff,
                                     adapter_effect=adapter_effect, max_abs_logit=logit_scale, tolerance=tolerance,
                                     ok=correct)}
        path = common.write_json(args.json, "lora_compute", rows, settings, extra, goals=goals)
        print(f"wrote {path}")
    tmp.cleanup()
    return 0 if correct else 1


def compute_goals(base_d: float, ours8_d: float, ours8_p: float, peft8_d: float, peft8_p: float,
                  max_diff: float, tolerance: float) -> list[common.Goal]:
    """The step-time goals (milliseconds in, ratios out) and the correctness check against PEFT."""
    overhead, vs_peft_d, vs_peft_p = ours8_d / base_d, peft8_d / ours8_d, peft8_p / ours8_p
    return [
        common.goal("decode: 8 adapters / base step", overhead, f"<= {DECODE_GOAL}", overhead <= DECODE_GOAL),
        common.goal("decode: PEFT mixed / ours 8 adapters", vs_peft_d, f">= {PEFT_GOAL}", vs_peft_d >= PEFT_GOAL),
        common.goal("prefill: PEFT mixed / ours 8 adapters", vs_peft_p, f">= {PEFT_GOAL}", vs_peft_p >= PEFT_GOAL),
        common.goal("max |logit diff| vs PEFT mixed", max_diff, f"<= {tolerance:g}", max_diff <= tolerance),
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="decoder layers (default 8; 4 with --quick)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                        help="model dtype (default: bf16 on cuda, fp32 on the CPU)")
    parser.add_argument("--repeats", type=int, help="timed repeats per case (default 7; 3 with --quick)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
