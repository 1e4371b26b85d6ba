"""Base model and tokenizer from ``demo``, a local folder, or a hub id (offline cache honoured)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from pool.device import default_device, parse_dtype
from pool.sources.hub import is_hub_repo_id

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


class BaseModelError(ValueError):
    pass


def resolve_model_path(base_model: str, revision: Optional[str] = None) -> Path:
    """``demo`` -> generated demo assets; an existing folder; else a hub repo id via the HF cache."""
    if base_model == "demo":
        from .demo import ensure_demo_assets

        return ensure_demo_assets().model_dir
    local = Path(base_model).expanduser()
    if local.is_dir():
        return local.resolve()
    if not is_hub_repo_id(base_model):
        raise BaseModelError(f"base_model {base_model!r} is not 'demo', an existing folder, or a hub repo id")
    from huggingface_hub import snapshot_download

    # safetensors only: pickle checkpoints are never fetched, so never loaded
    return Path(snapshot_download(repo_id=base_model, revision=revision, allow_patterns=HUB_PATTERNS))


AUTO_DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}  # ``dtype: auto``: tensor cores on CUDA, exact on the CPU


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA (half the weight bytes, tensor-core GEMMs, FlashInfer), fp32 on the CPU (its bf16
    GEMMs are slower than fp32 on most CPUs); any other name as ``pool.device.parse_dtype`` reads it."""
    if dtype == "auto":
        return AUTO_DTYPE["cuda" if device.type == "cuda" else "cpu"]
    return parse_dtype(dtype)


def load_base_model(base_model: str, *, dtype: str | torch.dtype = "auto", device: Optional[str] = None,
                    revision: Optional[str] = None):
    """(model, tokenizer, path), the model in eval mode on ``device`` (cuda when available)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(base_model, revision)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise BaseModelError(
            f"base model type {config.model_type!r} is not served; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    target = default_device(device)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype, target), trust_remote_code=False, use_safetensors=True
    )
    model.to(target).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return model, tokenizer, path
