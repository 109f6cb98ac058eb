"""The model's own sampling defaults, from its generation_config.json (vLLM's
generation_config="auto"): what a request gets for the fields its sender did not set."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field; the keys vLLM reads, and no others.
SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def generation_config_defaults(
    model_path: str | Path, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams defaults from `model_path`'s generation_config.json: the keys of
    SAMPLING_KEYS it gives a value (not null), renamed to SamplingParams fields
    (max_new_tokens -> max_tokens). `overrides` (generation_config.json keys, like vLLM's
    override_generation_config) win over the file. A GGUF file, or a folder without the file,
    has none. Apply them with `SamplingParams.with_defaults`, or `from_optional(**defaults)`
    when the caller gave no SamplingParams."""
    path = Path(model_path)
    config: dict[str, Any] = {}
    file = path / "generation_config.json" if path.is_dir() else None
    if file is not None and file.is_file():
        try:
            loaded = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read {file}: {error}") from error
        if not isinstance(loaded, dict):
            raise ValueError(f"{file} must hold a JSON object, got {type(loaded).__name__}")
        config.update(loaded)
    config.update(overrides or {})
    defaults = {
        field: config[key] for key, field in SAMPLING_KEYS.items() if config.get(key) is not None
    }
    if defaults:
        logger.info(
            "sampling defaults from the model's generation config (used where a request does "
            "not set them): %s",
            defaults,
        )
    return defaults
