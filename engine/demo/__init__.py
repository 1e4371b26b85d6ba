"""Demo assets: the embedded default model (``base_model: demo``) and its LoRA adapters.

Everything is generated locally from fixed seeds, so a laptop with no network can serve
the whole stack: a tiny random ``transformers`` causal LM (Llama, Mistral or Qwen2
architecture), a byte-level tokenizer built with ``tokenizers``, and PEFT-format LoRA
adapters of mixed ranks and target modules. The weights are random, so the text is
gibberish, but it is deterministic, printable, and visibly different per adapter, which is
all serving, routing and batching tests need.

Split by what it writes: ``tokenizer``, ``model``, ``adapters``; ``publish`` puts folders
on disk atomically; ``python -m engine.demo`` is the CLI. Runtime code imports this
package only when it serves ``base_model: demo`` or a ``demo:`` adapter source.
"""

from .adapters import (
    ADAPTER_FILES,
    DEFAULT_ADAPTER_STRENGTH,
    DemoAdapterSpec,
    adapter_tensor_key,
    demo_adapter_spec,
    write_demo_adapter,
)
from .model import (
    ARCHITECTURES,
    DEFAULT_INIT_STD,
    MODEL_FILES,
    NON_PRINTABLE_LOGIT_SCALE,
    demo_config,
    write_tiny_model,
)
from .publish import ASSETS_VERSION, DemoAssets, default_demo_root, ensure_demo_assets, publish_folder
from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "ADAPTER_FILES", "ARCHITECTURES", "ASSETS_VERSION", "CHAT_TEMPLATE", "DEFAULT_ADAPTER_STRENGTH",
    "DEFAULT_INIT_STD", "MODEL_FILES", "NON_PRINTABLE_LOGIT_SCALE", "SPECIAL_TOKENS", "DemoAdapterSpec",
    "DemoAssets", "adapter_tensor_key", "build_tokenizer", "default_demo_root", "demo_adapter_spec", "demo_config",
    "ensure_demo_assets", "publish_folder", "write_demo_adapter", "write_tiny_model",
]
