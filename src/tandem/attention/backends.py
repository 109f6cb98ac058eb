"""Which paged-attention implementation a model runs: one interface (q, k, v, kv_cache,
metadata, scale), one backend per device. `torch` is the reference (and the oracle in tests);
`cpu` the CPU path (its decode tokens through a C kernel built for the machine; auto there
when it builds); `triton` the CUDA path (auto there when triton is installed). vLLM's names
for the same are taken too."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "cpu", "triton")
# vLLM's --attention-backend values that mean one of tandem's.
ALIASES = {"torch_sdpa": "torch", "cpu_attn": "cpu", "triton_attn": "triton"}

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
    on_cpu = device == "cpu"
    has_triton = importlib.util.find_spec("triton") is not None
    if chosen == "auto":
        if on_cpu:
            from tandem.attention import cpu_kernel

            return "cpu" if cpu_kernel.load_library() is not None else "torch"
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
    if chosen == "cpu":
        from tandem.attention import cpu_kernel

        if not on_cpu:
            raise ValueError(
                f"the cpu attention backend runs on the CPU, not {device}: use "
                "attention_backend='auto' (triton on CUDA, torch elsewhere)"
            )
        if cpu_kernel.load_library() is None:
            raise ValueError(
                "attention_backend='cpu' needs a C compiler (cc, or $CC) to build its kernel "
                "(the log says why it failed): install one or use attention_backend='torch'"
            )
    return chosen


def attention_function(
    backend: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionFn:
    """The backend's paged_attention for a model of this shape; the cpu backend's kernel takes
    fp32 and bf16 caches of bounded shapes, the torch backend the rest (with a warning)."""
    if backend == "triton":
        from tandem.attention.triton_backend import paged_attention

        return paged_attention
    if backend == "cpu":
        from tandem.attention import cpu_backend, cpu_kernel

        if cpu_kernel.supports(dtype, num_heads, num_kv_heads, head_dim):
            return cpu_backend.paged_attention
        logger.warning(
            "the cpu attention kernel takes float32 and bfloat16 caches, query groups of at "
            "most %d heads and heads of at most %d: %s, %d/%d heads of %d run on the torch "
            "backend",
            cpu_kernel.MAX_GROUP, cpu_kernel.MAX_HEAD_DIM, dtype, num_heads, num_kv_heads,
            head_dim,
        )  # fmt: skip
    from tandem.attention.torch_backend import paged_attention

    return paged_attention
