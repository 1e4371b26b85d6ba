"""The base model's LoRA-relevant shapes, so the pool needs no model object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

ALL_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModuleShape:
    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoRAModelShape:
    """Target module name -> (in, out) features, identical in each of ``num_layers`` layers."""

    num_layers: int
    modules: dict[str, ModuleShape]

    @classmethod
    def from_hf_config(cls, config: Any, target_modules: Iterable[str] = ALL_TARGET_MODULES) -> "LoRAModelShape":
        """Shapes of a Llama / Mistral / Qwen2-style decoder from its HF config (duck-typed)."""
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        inter = config.intermediate_size
        known = {
            "q_proj": ModuleShape(hidden, heads * head_dim),
            "k_proj": ModuleShape(hidden, kv_heads * head_dim),
            "v_proj": ModuleShape(hidden, kv_heads * head_dim),
            "o_proj": ModuleShape(heads * head_dim, hidden),
            "gate_proj": ModuleShape(hidden, inter),
            "up_proj": ModuleShape(hidden, inter),
            "down_proj": ModuleShape(inter, hidden),
        }
        targets = list(target_modules)
        unknown = [m for m in targets if m not in known]
        if unknown:
            raise ValueError(f"unsupported target modules {unknown}; supported: {list(known)}")
        return cls(num_layers=config.num_hidden_layers, modules={m: known[m] for m in targets})

    def adapter_bytes(self, rank: int, element_size: int) -> int:
        """Bytes one adapter of ``rank`` occupies on all modules and layers."""
        per_layer = sum(rank * (s.in_features + s.out_features) for s in self.modules.values())
        return per_layer * self.num_layers * element_size
