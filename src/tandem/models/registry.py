"""Architecture name -> model class. Every supported family shares the Llama-style decoder."""

from __future__ import annotations

from torch import nn

from tandem.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from tandem.models.llama import CausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = dict.fromkeys(SUPPORTED_ARCHITECTURES, CausalLM)


def model_class_for(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported; supported: "
            + ", ".join(MODEL_CLASSES)
        ) from None
