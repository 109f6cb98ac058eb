"""Which paged-attention implementation a model runs: one interface (q, k, v, kv_cache,
metadata, scale), one backend per device. `torch` is the reference and the CPU path; `triton`
the CUDA path (auto there when triton is installed). vLLM's names for the same two are taken
too."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton")
# vLLM's --attention-backend values that mean one of tandem's.
ALIASES = {"torch_sdpa": "torch", "cpu_attn": "torch", "triton_attn": "triton"}

AttentionFn = Callable[..., torch.Tensor]


def resolve_attention_backend(name: str | None, device: str) -> str:
    """The backend for `name` ("auto", None, or one of BACKENDS or ALIASES) on `device`;
    ValueError naming what to change."""
    requested = (name or "auto").lower()
    chosen = ALIASES.get(requested, requested)
    if chosen not in ("auto", *BACKENDS):
        raise ValueError(
            f"attention_backend={name!r} is not one of auto, {', '.join(BACKENDS)} "
            f"(or vLLM's {', '.join(sorted(ALIASES))})"
        )
    on_cuda = device.startswith("cuda")
    has_triton = importlib.util.find_spec("triton") is not None
    if chosen == "auto":
        if not on_cuda:
            return "torch"
        if not has_triton:
            logger.warning("triton is not installed: attention runs on the torch backend")
            return "torch"
        return "triton"
    if chosen == "triton":
        if not has_triton:
            raise ValueError("attention_backend='triton' needs triton: pip install triton")
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "the triton attention backend runs on CUDA devices (on CPU only under "
                "TRITON_INTERPRET=1, for testing): use attention_backend='torch' here"
            )
    return chosen


def attention_function(backend: str) -> AttentionFn:
    if backend == "triton":
        from tandem.attention.triton_backend import paged_attention

        return paged_attention
    from tandem.attention.torch_backend import paged_attention

    return paged_attention
