"""The demo base model: a tiny random causal LM (Llama, Mistral or Qwen2 family) written with its tokenizer.

Weights come from one seeded generator in sorted-name order, so the same arguments give
byte-identical files whatever the ``transformers`` version's own init order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .tokenizer import build_tokenizer, printable_token_ids

ARCHITECTURES = ("llama", "mistral", "qwen2")

# Std of the random base weights: large enough that logits are peaked (greedy text does not
# collapse into one repeated token), small enough that two layers stay numerically tame.
DEFAULT_INIT_STD = 0.3
# Output rows of tokens other than printable ASCII are scaled down by this factor, so greedy
# text is readable gibberish rather than invalid UTF-8 and special tokens.
NON_PRINTABLE_LOGIT_SCALE = 0.25

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


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
    printable = torch.tensor(printable_token_ids())
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
