"""Loading and validating PEFT-format LoRA adapters (safetensors only) from a local folder.

An adapter is read completely and checked against the pool's shapes before anything is
returned, so a refused adapter leaves nothing half-loaded anywhere.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    CorruptWeightsError,
    PickleWeightsRefusedError,
    RankTooLargeError,
    ShapeMismatchError,
    UnsupportedAdapterFeatureError,
    UnsupportedTargetModulesError,
)
from .shapes import LoRAModelShape

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (optionally .default.)
_KEY_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[\w.]+\.)?(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of ``adapter_config.json`` that change the math."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


@dataclass
class LoRAAdapterWeights:
    """One adapter, stacked per module over layers, ready for a slot copy.

    ``a[m]`` is ``[layers, r, in]`` and ``bt[m]`` is B transposed, ``[layers, r, out]``, so
    a rank-r load into a pool slot is one contiguous copy per module. Layers the adapter
    does not adapt are zero.
    """

    name: str
    config: AdapterConfig
    a: dict[str, torch.Tensor]
    bt: dict[str, torch.Tensor]
    source: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def scaling(self) -> float:
        return self.config.scaling

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.bt.values()))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           pin_memory: bool = False) -> "LoRAAdapterWeights":
        def move(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device=device, dtype=dtype)
            return t.pin_memory() if pin_memory else t.contiguous()

        return LoRAAdapterWeights(
            self.name, self.config,
            {m: move(t) for m, t in self.a.items()},
            {m: move(t) for m, t in self.bt.items()},
            self.source, dict(self.meta),
        )


def parse_adapter_config(raw: dict, name: str) -> AdapterConfig:
    """Validate a PEFT LoRA config; unsupported features are refused by name."""
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise UnsupportedAdapterFeatureError(f"adapter {name!r}: peft_type {peft_type} is not LoRA")
    refusals = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "trainable_token_indices": "trainable tokens",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) layers",
    }
    for key, what in refusals.items():
        if raw.get(key):
            raise UnsupportedAdapterFeatureError(f"adapter {name!r} uses {what}, which lorafleet does not serve")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise UnsupportedAdapterFeatureError(f"adapter {name!r} has bias={bias!r}; only 'none' is served")
    try:
        rank = int(raw["r"])
        alpha = float(raw.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterFormatError(f"adapter {name!r}: adapter_config.json lacks a valid 'r'/'lora_alpha'") from exc
    if rank <= 0:
        raise AdapterFormatError(f"adapter {name!r}: rank r={rank} must be positive")
    targets = raw.get("target_modules") or ()
    targets = targets if isinstance(targets, str) else tuple(targets)
    return AdapterConfig(rank=rank, alpha=alpha, use_rslora=bool(raw.get("use_rslora", False)), target_modules=targets)


def _read_config(folder: Path, name: str) -> AdapterConfig:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterFormatError(f"adapter {name!r}: {CONFIG_FILE} missing in {folder}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterFormatError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    return parse_adapter_config(raw, name)


def _read_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        pickled = [p for p in PICKLE_FILES if (folder / p).exists()]
        if pickled:
            raise PickleWeightsRefusedError(
                f"adapter {name!r} ships pickle-format weights ({pickled[0]}); only {WEIGHTS_FILE} is accepted"
            )
        raise AdapterFormatError(f"adapter {name!r}: {WEIGHTS_FILE} missing in {folder}")
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    try:
        return st_load(path.read_bytes())
    except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
        raise CorruptWeightsError(f"adapter {name!r}: {WEIGHTS_FILE} is corrupt or truncated ({exc})") from exc


def _check_key_features(key: str, name: str) -> None:
    if "lora_magnitude_vector" in key:
        raise UnsupportedAdapterFeatureError(f"adapter {name!r} is a DoRA adapter ({key})")
    if "lora_embedding_" in key or "embed_tokens" in key:
        raise UnsupportedAdapterFeatureError(f"adapter {name!r} adapts the embedding ({key})")
    if "lm_head" in key:
        raise UnsupportedAdapterFeatureError(f"adapter {name!r} adapts lm_head ({key})")
    if "modules_to_save" in key:
        raise UnsupportedAdapterFeatureError(f"adapter {name!r} has modules_to_save ({key})")
    if key.endswith(".bias"):
        raise UnsupportedAdapterFeatureError(f"adapter {name!r} trains biases ({key})")


HEADER_SLACK_BYTES = 1 << 20  # a safetensors header: names, dtypes, shapes


def max_adapter_file_bytes(shape: LoRAModelShape, max_rank: int) -> int:
    """The largest weights file a valid adapter could be: every module adapted at ``max_rank`` in fp64."""
    elements = sum((m.in_features + m.out_features) * max_rank for m in shape.modules.values()) * shape.num_layers
    return elements * 8 + HEADER_SLACK_BYTES


def load_adapter_folder(
    folder: str | os.PathLike,
    shape: LoRAModelShape,
    max_rank: int,
    *,
    name: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
    max_bytes: Optional[int] = None,
) -> LoRAAdapterWeights:
    """Read and validate a PEFT adapter folder; the result matches ``shape`` exactly.

    The weights file's size is checked before it is read: above ``max_bytes`` (default: the
    largest file a valid adapter for ``shape`` and ``max_rank`` could be) it is refused.
    """
    folder = Path(folder)
    name = name or folder.name
    if not folder.is_dir():
        raise AdapterNotFoundError(f"adapter {name!r}: folder {folder} does not exist")
    if (folder / "added_tokens.json").exists():
        raise UnsupportedAdapterFeatureError(f"adapter {name!r} adds tokens to the vocabulary (added_tokens.json)")
    config = _read_config(folder, name)
    if config.rank > max_rank:
        raise RankTooLargeError(name, config.rank, max_rank)
    limit = max_bytes if max_bytes is not None else max_adapter_file_bytes(shape, max_rank)
    weights_file = folder / WEIGHTS_FILE
    if weights_file.is_file() and weights_file.stat().st_size > limit:
        raise AdapterTooLargeError(f"adapter {name!r}: {WEIGHTS_FILE} is {weights_file.stat().st_size} bytes, "
                                   f"above the limit of {limit} bytes for this pool")
    tensors = _read_tensors(folder, name)

    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        _check_key_features(key, name)
        match = _KEY_RE.search(key)
        if not match:
            raise AdapterFormatError(f"adapter {name!r}: unrecognised tensor {key!r}")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((module, layer), {})[which] = tensor

    unknown = sorted({m for m, _ in pairs if m not in shape.modules})
    if unknown:
        raise UnsupportedTargetModulesError(
            f"adapter {name!r} targets {unknown}, which this pool does not serve (it serves {sorted(shape.modules)})"
        )
    r = config.rank
    a: dict[str, torch.Tensor] = {}
    bt: dict[str, torch.Tensor] = {}
    for (module, layer), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterFormatError(f"adapter {name!r}: {module} layer {layer} lacks lora_{'B' if 'A' in ab else 'A'}")
        if layer >= shape.num_layers:
            raise ShapeMismatchError(f"adapter {name!r}: layer {layer} beyond the base model's {shape.num_layers} layers")
        ms = shape.modules[module]
        A, B = ab["A"], ab["B"]
        if tuple(A.shape) != (r, ms.in_features) or tuple(B.shape) != (ms.out_features, r):
            raise ShapeMismatchError(
                f"adapter {name!r}: {module} layer {layer} has A{tuple(A.shape)} B{tuple(B.shape)}, "
                f"expected A{(r, ms.in_features)} B{(ms.out_features, r)}"
            )
        if module not in a:
            a[module] = torch.zeros(shape.num_layers, r, ms.in_features, dtype=dtype)
            bt[module] = torch.zeros(shape.num_layers, r, ms.out_features, dtype=dtype)
        a[module][layer].copy_(A)
        bt[module][layer].copy_(B.t())
    if not a:
        raise AdapterFormatError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    return LoRAAdapterWeights(name=name, config=config, a=a, bt=bt, source=str(folder))
