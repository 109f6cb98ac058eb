"""Sizing the KV cache on a GPU the way vLLM does: the instance may use
`gpu_memory_utilization` of the device's memory; what a profiling step at the largest step
the scheduler can plan needs (weights, activations, logits, memory outside torch's allocator)
is taken off, and the rest becomes KV blocks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)
GiB = 1 << 30


def kv_cache_budget(
    total_bytes: int,
    utilization: float,
    peak_allocated_bytes: int,
    profile_cache_bytes: int,
    non_torch_bytes: int,
) -> int:
    """Bytes left for the KV cache: the instance's share of the device, less the profiling
    step's peak (without the small cache it ran over) and what was used outside torch's
    allocator. ValueError when nothing is left."""
    needed = peak_allocated_bytes - profile_cache_bytes + max(0, non_torch_bytes)
    budget = int(total_bytes * utilization) - needed
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this instance "
            f"{total_bytes * utilization / GiB:.1f} GiB, and the model's weights and its "
            f"largest step need {needed / GiB:.1f} GiB: nothing is left for the KV cache. Raise "
            "gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or use a "
            "smaller model"
        )
    return budget


class MemoryProfile:
    """Device memory seen before anything of this instance loads, then after a profiling
    step."""

    def __init__(self, device: torch.device, utilization: float) -> None:
        self.device = device
        self.utilization = utilization
        torch.cuda.empty_cache()
        self.free_at_start, self.total = torch.cuda.mem_get_info(device)
        self.reserved_at_start = torch.cuda.memory_reserved(device)
        requested = self.total * utilization
        if self.free_at_start < requested:
            raise ValueError(
                f"gpu_memory_utilization={utilization} asks for {requested / GiB:.1f} GiB of "
                f"{self.total / GiB:.1f} GiB, and only {self.free_at_start / GiB:.1f} GiB are "
                "free (other processes hold the rest): lower gpu_memory_utilization"
            )

    def kv_cache_bytes(self, profile_step: Callable[[], None], profile_cache_bytes: int) -> int:
        """Run `profile_step` (the largest step, over a cache of `profile_cache_bytes`) and
        return the bytes the real cache may take."""
        torch.cuda.reset_peak_memory_stats(self.device)
        profile_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free_now, _ = torch.cuda.mem_get_info(self.device)
        reserved_since = torch.cuda.memory_reserved(self.device) - self.reserved_at_start
        non_torch = (self.free_at_start - free_now) - reserved_since
        budget = kv_cache_budget(self.total, self.utilization, peak, profile_cache_bytes,
                                 non_torch)  # fmt: skip
        logger.info(
            "memory profile: %.2f GiB peak in the largest step (weights included), %.2f GiB "
            "outside torch; KV cache gets %.2f GiB of %.2f GiB x %.2f",
            (peak - profile_cache_bytes) / GiB, max(0, non_torch) / GiB, budget / GiB,
            self.total / GiB, self.utilization,
        )  # fmt: skip
        return budget


@dataclass
class ProfileRequest:
    """One request of the profiling step (a RequestSlice): a fresh prompt of zeros."""

    token_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]


def profile_requests(
    num_tokens: int, num_seqs: int, max_model_len: int, block_size: int
) -> list[ProfileRequest]:
    """The largest step the scheduler can plan: `num_tokens` prompt tokens over as many of
    `num_seqs` requests as there are tokens (each at most max_model_len long), so the LM head
    and the sampler see as many rows as they ever will. Blocks numbered from 0, in order."""
    num_requests = max(min(num_seqs, num_tokens), -(-num_tokens // max_model_len), 1)
    lengths = [num_tokens // num_requests + (i < num_tokens % num_requests)
               for i in range(num_requests)]  # fmt: skip
    requests, next_block = [], 0
    for length in lengths:
        num_blocks = -(-length // block_size)
        blocks = list(range(next_block, next_block + num_blocks))
        requests.append(ProfileRequest([0] * length, 0, length, blocks))
        next_block += num_blocks
    return requests
