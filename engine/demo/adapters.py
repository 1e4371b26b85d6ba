"""Demo LoRA adapters: PEFT-format folders with random, nonzero A and B, and the spec of ``demo-{i}``."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from pool.shapes import ALL_TARGET_MODULES, LoRAModelShape

# Std of the entries of an adapter's effective update ``scaling * B @ A``: half the base
# weights' std, so adapters change greedy text for most prompts without blowing it up.
DEFAULT_ADAPTER_STRENGTH = 0.15

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


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
