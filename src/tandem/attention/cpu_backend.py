"""Paged attention on the CPU: decode tokens through the in-place C kernel (cpu_kernel.py),
fp32 and bf16 prefill chunks through the C causal-attention kernel (other dtypes, and head
sizes that are not a multiple of 8, through the torch backend's SDPA), the cache store as in
the torch backend.

The torch backend copies every decode token's context out of the cache (a gather per layer)
and runs SDPA on the copy; at batch 32 that costs more than the attention itself. The kernel
reads each context through the block table where it lies and writes the output rows in place.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from tandem.attention import cpu_kernel
from tandem.attention.metadata import AttentionMetadata
from tandem.attention.torch_backend import (
    PrefillSlice,
    StorePlan,
    attend_prefills,
    chunk_keys_values,
    make_store_plan,
    prefill_slices,
    store_kv,
)


@dataclass
class _Plan:
    """What every layer of the step reuses: the store, the prefill chunks, and the decode
    tokens' arrays (int64, contiguous: the kernel reads them through their addresses)."""

    store: StorePlan
    prefills: list[PrefillSlice]
    decode_rows: np.ndarray  # [D] rows of the batch
    decode_requests: np.ndarray  # [D] each one's row of the block table
    decode_seq_lens: np.ndarray  # [D] each one's context length


def decode_token_arrays(md: AttentionMetadata) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decode tokens' rows, requests and context lengths as the C kernels read them
    (int64, contiguous)."""
    return tuple(
        np.ascontiguousarray(array, dtype=np.int64)
        for array in (md.decode_token_indices_cpu, md.decode_token_requests_cpu,
                      md.decode_token_seq_lens_cpu)
    )  # fmt: skip


def _make_plan(md: AttentionMetadata) -> _Plan:
    return _Plan(make_store_plan(md), prefill_slices(md), *decode_token_arrays(md))


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: _Plan,
    scale: float,
    output: torch.Tensor,
) -> None:
    """Attention of the plan's decode tokens over their contexts, into their rows of `output`
    (contiguous [T, H, D]); `query` [T, H, D] may be a strided view with unit last stride."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    kernel = cpu_kernel.kernel(query.dtype, head_dim)
    if query.stride(2) != 1:
        query = query.contiguous()
    if not (
        kv_cache.device.type == "cpu"
        and kv_cache.is_contiguous()
        and kv_cache.dtype == query.dtype == output.dtype
        and block_table.dtype == torch.int64
        and block_table.is_contiguous()
        and output.is_contiguous()
        and query.shape[1] % num_kv_heads == 0
    ):
        raise ValueError(
            "the CPU decode kernel takes CPU tensors: a contiguous cache of the query's dtype, "
            "a contiguous int64 block table and output, and whole GQA groups"
        )
    kernel(
        query.data_ptr(), query.stride(0), query.stride(1),
        kv_cache.data_ptr(), num_blocks, block_table.data_ptr(), block_table.stride(0),
        plan.decode_rows.ctypes.data, plan.decode_requests.ctypes.data,
        plan.decode_seq_lens.ctypes.data, len(plan.decode_rows), query.shape[1], num_kv_heads,
        head_dim, block_size, ctypes.c_float(scale), output.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The torch backend's interface and results (torch_backend.paged_attention)."""
    if metadata.backend_plan is None:
        metadata.backend_plan = _make_plan(metadata)
    plan = metadata.backend_plan
    store_kv(key, value, kv_cache, plan.store)
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if len(plan.decode_rows):
        if kv_cache.dtype == query.dtype:
            decode_attention(query, kv_cache, metadata.block_table, plan, scale, output)
        else:  # the kernel reads queries and writes rows in the cache's type, as the fused step
            rounded = torch.empty(query.shape, dtype=kv_cache.dtype, device=query.device)
            decode_attention(query.to(kv_cache.dtype), kv_cache, metadata.block_table, plan,
                             scale, rounded)  # fmt: skip
            output.copy_(rounded)
    if plan.prefills and not cpu_kernel.takes_prefill(query):  # decode steps: no check
        attend_prefills(query, key, value, kv_cache, plan.prefills, scale, output)
        return output
    for chunk in plan.prefills:
        rows = slice(chunk.query_start, chunk.query_end)
        keys, values = chunk_keys_values(key, value, kv_cache, chunk, query)
        cpu_kernel.prefill_attention(query[rows], keys, values, scale, output[rows])
    return output
