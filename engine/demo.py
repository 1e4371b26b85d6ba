"""Demo assets: the embedded default model (``base_model: demo``) and its LoRA adapters.

Everything is generated locally from fixed seeds, so a laptop with no network can serve
the whole stack: a tiny random ``transformers`` causal LM (Llama, Mistral or Qwen2
architecture), a byte-level tokenizer built with ``tokenizers``, and PEFT-format LoRA
adapters of mixed ranks and target modules. The weights are random, so the text is
gibberish, but it is deterministic, printable, and visibly different per adapter, which is
all serving, routing and batching tests need.

``ensure_demo_assets`` is called by every replica on start; it publishes each folder with
an atomic ``os.rename``, so concurrent callers never see a half-written folder.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from pool.shapes import ALL_TARGET_MODULES, LoRAModelShape

ARCHITECTURES = ("llama", "mistral", "qwen2")

# Bump when the generated content changes, so stale caches are not reused.
ASSETS_VERSION = 1

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Reserved, never emitted by the template. transformers 5 loads every qwen2 folder with
# Qwen2Tokenizer, whose unk token this is; were it missing, the tokenizer would append it
# with an id past the model's vocabulary.
ENDOFTEXT_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS.values(), ENDOFTEXT_TOKEN)

# Turns are "<|role|>\n{content}</s>\n"; the generation prompt opens an assistant turn, so
# a model that emits </s> ends its own turn. Unknown roles are refused, not guessed.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('demo chat template: unsupported role ' ~ message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Std of the random base weights: large enough that logits are peaked (greedy text does not
# collapse into one repeated token), small enough that two layers stay numerically tame.
DEFAULT_INIT_STD = 0.3
# Output rows of tokens other than printable ASCII are scaled down by this factor, so greedy
# text is readable gibberish rather than invalid UTF-8 and special tokens.
NON_PRINTABLE_LOGIT_SCALE = 0.25
# Std of the entries of an adapter's effective update ``scaling * B @ A``: half the base
# weights' std, so adapters change greedy text for most prompts without blowing it up.
DEFAULT_ADAPTER_STRENGTH = 0.15

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


# --------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _printable_token_ids() -> list[int]:
    """Ids of the byte tokens for printable ASCII and newline (see ``build_tokenizer``)."""
    return [len(SPECIAL_TOKENS) + b for b in [ord("\n"), *range(0x20, 0x7F)]]


def build_tokenizer(model_max_length: int = 512):
    """A byte-level tokenizer: special tokens, then one token per byte, no merges.

    Ids: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, role markers 3-5, ``<|endoftext|>`` 6, then
    byte ``b`` is ``7 + b`` (vocabulary 263). Nothing is downloaded or trained, every
    string round-trips (Unicode up to NFC where transformers swaps in Qwen2Tokenizer), and
    encoding prepends ``<s>`` the way Llama tokenizers do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for byte, char in sorted(_bytes_to_unicode().items()):
        vocab[char] = len(SPECIAL_TOKENS) + byte
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = vocab[BOS_TOKEN]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------- model


def demo_config(
    arch: str = "llama",
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    init_std: float = DEFAULT_INIT_STD,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
):
    """The ``transformers`` config of a tiny GQA decoder of family ``arch``."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown demo architecture {arch!r}; choose one of {ARCHITECTURES}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "mistral":
        config = MistralConfig(sliding_window=None, **common)
    else:
        config = Qwen2Config(use_sliding_window=False, **common)
    config.dtype = torch.float32  # written to config.json as "float32"
    return config


def _randomize(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Overwrite every parameter from one seeded generator, in sorted-name order.

    Done here rather than by ``transformers``' own init so the bytes depend only on the seed
    and the parameter names, not on the library version's init order.
    """
    generator = torch.Generator().manual_seed(seed)
    printable = torch.tensor(_printable_token_ids())
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = init_std / 3 if name.endswith(".bias") else init_std
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            if name == "lm_head.weight":
                scale = torch.full((param.shape[0], 1), NON_PRINTABLE_LOGIT_SCALE)
                scale[printable[printable < param.shape[0]]] = 1.0
                values = values * scale
            param.copy_(values)


def _portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class every ``transformers`` release knows (v5 writes its new
    ``TokenizersBackend``, which v4 cannot load); both load ``tokenizer.json`` the same way."""
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_tiny_model(
    path: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    init_std: float = DEFAULT_INIT_STD,
) -> Path:
    """Write a tiny random fp32 causal LM plus its tokenizer into ``path``; returns ``path``.

    The folder loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` offline. Same arguments give byte-identical files.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(model_max_length=max_position_embeddings)
    config = demo_config(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        init_std=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    _randomize(model, seed, init_std)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one tiny shard; a bar per replica start is noise
    try:
        model.save_pretrained(path)
    finally:
        if progress_bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(path)
    _portable_tokenizer_class(path)
    missing = [f for f in MODEL_FILES if not (path / f).is_file()]
    if missing:
        raise RuntimeError(f"demo model in {path} lacks {missing} after saving; transformers layout changed?")
    return path


# --------------------------------------------------------------------------- adapters


def _module_prefix(module: str) -> str:
    return "self_attn" if module in _ATTENTION else "mlp"


def adapter_tensor_key(layer: int, module: str, which: str) -> str:
    """The key PEFT writes for a Llama-family LoRA weight (``which`` is "A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{_module_prefix(module)}.{module}.lora_{which}.weight"


def write_demo_adapter(
    path: str | os.PathLike,
    model_shape: LoRAModelShape,
    *,
    rank: int,
    target_modules: Sequence[str],
    alpha: float,
    use_rslora: bool = False,
    seed: int,
    base_model_path: Optional[str | os.PathLike] = None,
    strength: float = DEFAULT_ADAPTER_STRENGTH,
) -> Path:
    """Write a PEFT-format LoRA adapter with random, nonzero A and B; returns ``path``.

    PEFT initialises B to zero (a no-op adapter); here B is random and sized so that the
    entries of the effective update ``scaling * B @ A`` have std ``strength`` whatever the
    rank, alpha or rsLoRA choice, so every demo adapter changes the output about equally.
    peft itself is not imported: it is a test dependency only.
    """
    from safetensors.torch import save_file

    if rank <= 0:
        raise ValueError(f"rank must be positive, got {rank}")
    targets = list(target_modules)
    unknown = [m for m in targets if m not in model_shape.modules]
    if unknown:
        raise ValueError(f"target modules {unknown} are not in the model shape {list(model_shape.modules)}")
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(model_shape.num_layers):
        for module in targets:
            shape = model_shape.modules[module]
            a_std = 1.0 / math.sqrt(shape.in_features)
            # entry std of scaling * B @ A is scaling * sqrt(rank) * b_std * a_std
            b_std = strength / (scaling * math.sqrt(rank) * a_std)
            a = torch.randn((rank, shape.in_features), generator=generator) * a_std
            b = torch.randn((shape.out_features, rank), generator=generator) * b_std
            tensors[adapter_tensor_key(layer, module, "A")] = a.contiguous()
            tensors[adapter_tensor_key(layer, module, "B")] = b.contiguous()

    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_path) if base_model_path is not None else None,
        "revision": None,
        "inference_mode": True,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "fan_in_fan_out": False,
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


@dataclass(frozen=True)
class DemoAdapterSpec:
    """How demo adapter ``demo-{index}`` is made; a function of the index alone, so callers
    asking for different adapter counts agree on every adapter they share."""

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool
    seed: int


_RANKS = (4, 8, 16)
_TARGET_SETS: tuple[tuple[str, ...], ...] = (
    ALL_TARGET_MODULES,
    ("q_proj", "v_proj"),
    ("gate_proj", "up_proj", "down_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj"),
)
_RSLORA_INDEX = 1


def demo_adapter_spec(index: int) -> DemoAdapterSpec:
    """Ranks cycle 4/8/16, target sets cycle all/qv/mlp/qkvo, only ``demo-1`` uses rsLoRA."""
    rank = _RANKS[index % len(_RANKS)]
    return DemoAdapterSpec(
        name=f"demo-{index}",
        rank=rank,
        alpha=float(2 * rank),
        target_modules=_TARGET_SETS[index % len(_TARGET_SETS)],
        use_rslora=index == _RSLORA_INDEX,
        seed=1000 + index,
    )


# --------------------------------------------------------------------------- assets on disk


@dataclass(frozen=True)
class DemoAssets:
    """Where the demo model and its adapters (name -> folder) live."""

    model_dir: Path
    adapters: dict[str, Path]


def default_demo_root() -> Path:
    """``$LORAFLEET_DEMO_DIR``, else ``~/.cache/lorafleet/demo``."""
    env = os.environ.get("LORAFLEET_DEMO_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lorafleet" / "demo"


def _is_complete(folder: Path, files: Iterable[str]) -> bool:
    return all((folder / f).is_file() for f in files)


def _publish(target: Path, files: Sequence[str], build: Callable[[Path], object]) -> Path:
    """Make ``target`` exist, complete, built by ``build`` unless it already is.

    ``build`` writes into a private temp folder beside ``target`` that is then renamed into
    place. The rename is atomic, so readers see a whole folder or none, and when several
    processes race, the first rename wins and the others discard their copies.
    """
    if target.exists():
        if _is_complete(target, files):
            return target
        raise RuntimeError(f"{target} exists but lacks some of {list(files)}; delete it to rebuild the demo assets")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        build(tmp)
        # mkdtemp (and some writers) make things private; a shared cache should be readable
        os.chmod(tmp, 0o755)
        for file in tmp.rglob("*"):
            os.chmod(file, 0o755 if file.is_dir() else 0o644)
        try:
            os.rename(tmp, target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not _is_complete(target, files):
        raise RuntimeError(f"{target} is incomplete after publishing; delete it to rebuild the demo assets")
    return target


def ensure_demo_assets(
    root: Optional[str | os.PathLike] = None,
    *,
    num_adapters: int = 6,
    arch: str = "llama",
) -> DemoAssets:
    """Create the demo model and adapters ``demo-0`` .. ``demo-{N-1}`` under ``root`` if missing.

    Idempotent and safe to call from many processes at once (each Serve replica does).
    Layout: ``root/{arch}-v{ASSETS_VERSION}/model`` and ``.../adapters/demo-{i}``.
    """
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown demo architecture {arch!r}; choose one of {ARCHITECTURES}")
    if num_adapters < 0:
        raise ValueError(f"num_adapters must be >= 0, got {num_adapters}")
    base = (Path(root).expanduser() if root is not None else default_demo_root()).absolute()
    base = base / f"{arch}-v{ASSETS_VERSION}"

    model_dir = _publish(base / "model", MODEL_FILES, lambda tmp: write_tiny_model(tmp, arch))
    config = AutoConfig.from_pretrained(model_dir)

    adapters: dict[str, Path] = {}
    for index in range(num_adapters):
        spec = demo_adapter_spec(index)
        shape = LoRAModelShape.from_hf_config(config, spec.target_modules)

        def build(tmp: Path, spec: DemoAdapterSpec = spec, shape: LoRAModelShape = shape) -> Path:
            return write_demo_adapter(
                tmp,
                shape,
                rank=spec.rank,
                target_modules=spec.target_modules,
                alpha=spec.alpha,
                use_rslora=spec.use_rslora,
                seed=spec.seed,
                base_model_path=model_dir,
            )

        adapters[spec.name] = _publish(base / "adapters" / spec.name, ADAPTER_FILES, build)
    return DemoAssets(model_dir=model_dir, adapters=adapters)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m engine.demo PATH [--adapters N] [--arch ARCH]``."""
    parser = argparse.ArgumentParser(prog="python -m engine.demo", description="Write lorafleet's demo model and adapters.")
    parser.add_argument("path", type=Path, help="root folder of the demo assets")
    parser.add_argument("--adapters", type=int, default=6, help="number of demo adapters (default 6)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama", help="model architecture (default llama)")
    args = parser.parse_args(argv)

    assets = ensure_demo_assets(args.path, num_adapters=args.adapters, arch=args.arch)
    size = sum(f.stat().st_size for f in assets.model_dir.iterdir() if f.is_file())
    print(f"model ({args.arch}, {size / 1e6:.2f} MB): {assets.model_dir}")
    for index, (name, folder) in enumerate(assets.adapters.items()):
        spec = demo_adapter_spec(index)
        flags = " rslora" if spec.use_rslora else ""
        print(f"adapter {name}: r={spec.rank} alpha={spec.alpha:g}{flags} targets={','.join(spec.target_modules)} {folder}")


if __name__ == "__main__":
    main()
