"""The demo assets load in transformers and peft unchanged, and are published safely."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import demo
from engine.demo import (
    ARCHITECTURES,
    DemoAssets,
    default_demo_root,
    demo_adapter_spec,
    ensure_demo_assets,
    write_tiny_model,
)
from pool.shapes import LoRAModelShape

import transformers  # noqa: F401  (the test extra installs it; missing is a failure)
import peft  # noqa: F401  (the test extra installs it; missing is a failure)

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
PROMPTS = ["Hello", "The quick brown fox", "def main():", "Ray Serve", "1 2 3 4", "Why?"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    return ensure_demo_assets(tmp_path_factory.mktemp("demo"), num_adapters=6)


def _load(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def _snapshot(root: Path) -> dict[str, int]:
    """Every file under ``root`` -> mtime, to prove nothing was rewritten."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- model and tokenizer


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_model_and_tokenizer_load(tmp_path: Path, arch: str) -> None:
    from transformers import AutoTokenizer

    folder = write_tiny_model(tmp_path / arch, arch)
    model = _load(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    config = model.config
    assert type(model).__name__ == MODEL_CLASSES[arch]
    assert config.vocab_size == len(tokenizer)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.tie_word_embeddings is False
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(f.stat().st_size for f in folder.iterdir()) < 5_000_000
    if arch == "qwen2":
        bias = model.model.layers[0].self_attn.q_proj.bias
        assert bias is not None and bias.abs().min() > 0

    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    text = "Hello, world!\n\tlorafleet serves LoRA adapters {\"r\": 16}."
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text

    # greedy text from the random weights is neither flat nor one repeated token
    inputs = tokenizer("The quick brown fox", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(set(new_tokens)) >= 6
    assert tokenizer.decode(new_tokens).replace("\n", "").isprintable()

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<s><|user|>\nHi</s>\n<|assistant|>\n"


def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    first = write_tiny_model(tmp_path / "a", "qwen2", seed=3)
    second = write_tiny_model(tmp_path / "b", "qwen2", seed=3)
    other = write_tiny_model(tmp_path / "c", "qwen2", seed=4)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_chat_template_renders(assets: DemoAssets) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n"
        "<|assistant|>\nHello.</s>\n<|user|>\nBye</s>\n<|assistant|>\n"
    )
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert closed.endswith("Bye</s>\n")

    encoding = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = encoding["input_ids"] if hasattr(encoding, "keys") else encoding
    assert ids.count(tokenizer.bos_token_id) == 1
    assert ids[-2] == tokenizer.convert_tokens_to_ids("<|assistant|>")


# --------------------------------------------------------------------------- adapters


def test_adapter_specs_are_mixed(assets: DemoAssets) -> None:
    specs = [demo_adapter_spec(i) for i in range(len(assets.adapters))]
    assert list(assets.adapters) == [f"demo-{i}" for i in range(6)]
    assert {s.rank for s in specs} == {4, 8, 16}
    assert len({s.target_modules for s in specs}) >= 4
    configs = {name: json.loads((d / "adapter_config.json").read_text()) for name, d in assets.adapters.items()}
    assert [name for name, c in configs.items() if c["use_rslora"]] == ["demo-1"]
    for spec in specs:
        config = configs[spec.name]
        assert (config["r"], config["target_modules"]) == (spec.rank, list(spec.target_modules))
        assert config["base_model_name_or_path"] == str(assets.model_dir)


@pytest.mark.parametrize("index", range(6))
def test_adapter_loads_unchanged_in_peft(assets: DemoAssets, index: int) -> None:
    from peft import PeftModel

    spec = demo_adapter_spec(index)
    folder = assets.adapters[spec.name]
    file_tensors = load_file(folder / "adapter_model.safetensors")
    base = _load(assets.model_dir)
    inputs = torch.tensor([[1, *range(40, 60)]])
    with torch.no_grad():
        base_logits = base(inputs).logits

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, folder).eval()
    key_warnings = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert key_warnings == []

    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.use_rslora) == (spec.rank, spec.alpha, spec.use_rslora)
    assert set(config.target_modules) == set(spec.target_modules)

    # peft holds exactly the file's tensors: no missing, no unexpected, values equal
    held = {k.replace(".default.", "."): v for k, v in model.state_dict().items() if ".lora_" in k}
    assert set(held) == set(file_tensors)
    for key, tensor in file_tensors.items():
        assert torch.equal(held[key], tensor), key
        if ".lora_B." in key:
            assert tensor.abs().sum() > 0  # unlike peft's own init, B is not zero

    expected_scaling = spec.alpha / (spec.rank ** 0.5 if spec.use_rslora else spec.rank)
    q_or_gate = "q_proj" if "q_proj" in spec.target_modules else "gate_proj"
    layer = model.base_model.model.model.layers[0]
    module = getattr(layer.self_attn if q_or_gate == "q_proj" else layer.mlp, q_or_gate)
    assert module.scaling["default"] == pytest.approx(expected_scaling)

    with torch.no_grad():
        lora_logits = model(inputs).logits
        with model.disable_adapter():
            plain_logits = model(inputs).logits
    assert torch.isfinite(lora_logits).all()
    assert (lora_logits - base_logits).abs().max() > 0.5
    assert lora_logits.abs().max() < 50
    torch.testing.assert_close(plain_logits, base_logits)


def test_adapters_change_greedy_text(assets: DemoAssets) -> None:
    from peft import PeftModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)

    def first_tokens(model) -> list[int]:
        batch = [tokenizer(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
        with torch.no_grad():
            return [int(model(ids).logits[0, -1].argmax()) for ids in batch]

    base_tokens = first_tokens(_load(assets.model_dir))
    for name, folder in assets.adapters.items():
        tokens = first_tokens(PeftModel.from_pretrained(_load(assets.model_dir), folder).eval())
        changed = sum(a != b for a, b in zip(tokens, base_tokens))
        assert changed >= len(PROMPTS) // 2, name


def test_pool_loader_accepts_demo_adapters(assets: DemoAssets) -> None:
    from transformers import AutoConfig

    from pool.adapter import load_adapter_folder

    shape = LoRAModelShape.from_hf_config(AutoConfig.from_pretrained(assets.model_dir))
    for name, folder in assets.adapters.items():
        weights = load_adapter_folder(folder, shape, max_rank=16, name=name)
        spec = demo_adapter_spec(int(name.split("-")[1]))
        assert weights.rank == spec.rank
        assert weights.config.use_rslora == spec.use_rslora


def test_write_demo_adapter_refuses_unknown_modules(assets: DemoAssets, tmp_path: Path) -> None:
    from transformers import AutoConfig

    shape = LoRAModelShape.from_hf_config(AutoConfig.from_pretrained(assets.model_dir), ["q_proj"])
    with pytest.raises(ValueError, match="v_proj"):
        demo.write_demo_adapter(tmp_path / "x", shape, rank=4, target_modules=["q_proj", "v_proj"], alpha=8, seed=0)


# --------------------------------------------------------------------------- publishing


def test_ensure_is_idempotent(tmp_path: Path) -> None:
    first = ensure_demo_assets(tmp_path, num_adapters=2)
    before = _snapshot(tmp_path)
    second = ensure_demo_assets(tmp_path, num_adapters=2)
    assert second == first
    assert _snapshot(tmp_path) == before

    # asking for more adds only the missing adapters
    more = ensure_demo_assets(tmp_path, num_adapters=3)
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert list(more.adapters) == ["demo-0", "demo-1", "demo-2"]


def test_concurrent_processes_both_succeed(tmp_path: Path) -> None:
    code = (
        "import json, sys; from engine.demo import ensure_demo_assets; "
        "a = ensure_demo_assets(sys.argv[1], num_adapters=3); "
        "print(json.dumps({'model': str(a.model_dir), 'adapters': {k: str(v) for k, v in a.adapters.items()}}))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert reports[0] == reports[1]
    assets = ensure_demo_assets(tmp_path, num_adapters=3)
    assert reports[0]["model"] == str(assets.model_dir)
    assert not [p for p in tmp_path.rglob("*.tmp")], "temp folders left behind"
    _load(assets.model_dir)


def test_publish_loser_of_a_race_keeps_the_winner(tmp_path: Path) -> None:
    target = tmp_path / "unit"

    def build_while_a_rival_wins(tmp: Path) -> None:
        target.mkdir()
        (target / "f").write_text("winner")
        (tmp / "f").write_text("loser")

    assert demo.publish_folder(target, ["f"], build_while_a_rival_wins) == target
    assert (target / "f").read_text() == "winner"
    assert list(tmp_path.iterdir()) == [target]


def test_publish_refuses_an_incomplete_folder(tmp_path: Path) -> None:
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "other").write_text("")
    with pytest.raises(RuntimeError, match="delete it"):
        demo.publish_folder(tmp_path / "unit", ["f"], lambda tmp: None)


def test_default_root_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAFLEET_DEMO_DIR", str(tmp_path / "assets"))
    assert default_demo_root() == tmp_path / "assets"
    monkeypatch.delenv("LORAFLEET_DEMO_DIR")
    assert default_demo_root() == Path.home() / ".cache" / "lorafleet" / "demo"


def test_cli_writes_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.demo.__main__ import main

    main([str(tmp_path), "--adapters", "2", "--arch", "mistral"])
    out = capsys.readouterr().out
    assert "model (mistral" in out and "adapter demo-1: r=8 alpha=16 rslora" in out
    assert (tmp_path / f"mistral-v{demo.ASSETS_VERSION}" / "adapters" / "demo-1" / "adapter_config.json").is_file()
