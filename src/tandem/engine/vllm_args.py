"""vLLM constructor arguments that tandem has no machinery for. A vLLM user passing them gets
one of two answers, never silence:

- NOOP_VALUES: accepted at the value that asks for nothing tandem lacks (the vLLM default, as a
  rule); any other value is a ValueError that says why.
- NO_EFFECT: accepted with any value, logged once: on one device, eagerly, they change nothing.

Any other unknown argument is a TypeError pointing at docs/coming-from-vllm.md, which lists
every vLLM argument and what tandem does with it.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_TEXT_ONLY = "tandem runs text-only decoder models"
_LOCAL_ONLY = "tandem reads local folders and GGUF files, never the Hugging Face Hub"
_ONE_DEVICE = "tandem runs a model on one device"

NOOP_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "runner": (("auto", "generate"), "tandem runs generative models only"),
    "convert": (("auto", "none"), "tandem does not turn models into pooling models"),
    "task": (("auto", "generate"), "tandem runs generative models only"),
    "tokenizer_mode": (("auto", "hf"), "tandem loads tokenizers with transformers' AutoTokenizer"),
    "allowed_local_media_path": (("",), _TEXT_ONLY),
    "allowed_media_domains": ((None,), _TEXT_ONLY),
    "mm_processor_kwargs": ((None,), _TEXT_ONLY),
    "limit_mm_per_prompt": ((None,), _TEXT_ONLY),
    "quantization": (
        (None,),
        "GGUF files are read as they are (dense, and Q4 matrices packed for small steps under "
        "dtype='auto' on CPU); other quantized checkpoints are not read yet",
    ),
    "revision": ((None,), _LOCAL_ONLY),
    "tokenizer_revision": ((None,), _LOCAL_ONLY),
    "code_revision": ((None,), _LOCAL_ONLY),
    "download_dir": ((None,), _LOCAL_ONLY),
    "hf_token": ((None,), _LOCAL_ONLY),
    "hf_overrides": ((None, {}), "the checkpoint's config.json is read as it is"),
    "cpu_offload_gb": ((0,), "the weights stay on the device"),
    "enable_return_routed_experts": ((False,), "tandem runs no mixture-of-experts models yet"),
    "pooler_config": ((None,), "tandem has no pooling models"),
    "structured_outputs_config": ((None,), "the one backend is xgrammar: nothing to configure"),
    "profiler_config": ((None,), "use torch.profiler around generate()"),
    "attention_config": ((None,), "tandem picks its attention backend per device"),
    "logits_processors": ((None, []), "like vLLM v1, no per-request Python logits processors"),
    "pipeline_parallel_size": ((1,), _ONE_DEVICE),
    "data_parallel_size": ((1,), _ONE_DEVICE),
    "enable_lora": ((False,), "LoRA adapters are not built yet"),
}

NO_EFFECT: dict[str, str] = {
    "disable_custom_all_reduce": "one device has no all-reduce",
    "max_seq_len_to_capture": "there are no CUDA graphs yet",
    "disable_async_output_proc": "the offline engine processes outputs synchronously",
}


def check_vllm_only_args(kwargs: dict[str, Any]) -> None:
    """Accept or refuse the vLLM arguments tandem has no parameter for (see module doc)."""
    unknown = sorted(k for k in kwargs if k not in NOOP_VALUES and k not in NO_EFFECT)
    if unknown:
        raise TypeError(
            f"LLM() got arguments tandem does not have: {', '.join(unknown)}; "
            "docs/coming-from-vllm.md lists every vLLM argument and what tandem does with it"
        )
    for name, value in kwargs.items():
        if name in NO_EFFECT:
            logger.warning("%s=%r has no effect: %s", name, value, NO_EFFECT[name])
            continue
        allowed, reason = NOOP_VALUES[name]
        if not any(value == a and (value is None) == (a is None) for a in allowed):
            raise ValueError(
                f"{name}={value!r} is not supported: {reason} (leave it at {allowed[0]!r})"
            )
