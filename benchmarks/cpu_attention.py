"""Decode attention per layer on CPU: the `cpu` backend (C kernel, cache read in place) against
the `torch` backend (each context gathered out of the cache, then SDPA), the embedded model's
head layout (9 query / 3 kv heads of 64), blocks of 16 over a shuffled block table; then one
batch-1 call of RMSNorm and of RoPE, the C kernel's against the torch ops'.

    .venv/bin/python benchmarks/cpu_attention.py [--calls 200]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

import torch

from tandem.attention import cpu_backend, cpu_kernel, torch_backend
from tandem.attention.metadata import build_batch
from tandem.models.layers import RMSNorm, apply_rotary

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CASES = [(1, 160), (32, 160), (64, 400), (1, 2000)]  # (decoding requests, context each)


@dataclass
class Decode:
    token_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int] = field(default_factory=list)


def microseconds_per_call(backend, batch: int, context: int, dtype, calls: int) -> float:
    blocks_each = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = batch * blocks_each
    pool = list(range(num_blocks))
    random.Random(0).shuffle(pool)
    requests = [
        Decode(list(range(context + 1)), context, 1, pool[i * blocks_each : (i + 1) * blocks_each])
        for i in range(batch)
    ]
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype)
    key = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    value = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    metadata = build_batch(requests, BLOCK_SIZE, torch.device("cpu")).attn_metadata
    for _ in range(20):
        backend.paged_attention(query, key, value, cache, metadata, HEAD_DIM**-0.5)
    start = time.perf_counter()
    for _ in range(calls):
        backend.paged_attention(query, key, value, cache, metadata, HEAD_DIM**-0.5)
    return (time.perf_counter() - start) / calls * 1e6


def layer_op_microseconds(dtype, fused: bool, calls: int) -> dict[str, float]:
    """One batch-1 call of RMSNorm (hidden 576) and RoPE (12 heads of 64), with the C kernels
    or (fused=False) with the torch ops they replace."""
    norm = RMSNorm(576, 1e-5).to(dtype)
    hidden = torch.randn(1, 576, dtype=dtype)
    heads = torch.randn(1, 12, HEAD_DIM, dtype=dtype)
    cos, sin = torch.randn(1, 1, HEAD_DIM).chunk(2, dim=-1)
    kernels = cpu_kernel.rms_norm, cpu_kernel.rotary_
    if not fused:
        cpu_kernel.rms_norm, cpu_kernel.rotary_ = (lambda *_: None), (lambda *_: False)
    try:
        times = {}
        for name, call in (("RMSNorm", lambda: norm(hidden)),
                           ("RoPE", lambda: apply_rotary(heads, cos, sin))):  # fmt: skip
            for _ in range(100):
                call()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            times[name] = (time.perf_counter() - start) / calls * 1e6
        return times
    finally:
        cpu_kernel.rms_norm, cpu_kernel.rotary_ = kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(f"# {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| dtype | requests × context | torch backend µs | cpu backend µs | speed-up |")
    print("|---|---|---:|---:|---:|")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for batch, context in CASES:
                reference = microseconds_per_call(torch_backend, batch, context, dtype, args.calls)
                kernel = microseconds_per_call(cpu_backend, batch, context, dtype, args.calls)
                print(f"| {str(dtype).removeprefix('torch.')} | {batch} × {context} | "
                      f"{reference:.0f} | {kernel:.0f} | {reference / kernel:.2f}× |")  # fmt: skip
        print("\n| dtype | op (batch 1) | torch ops µs | C kernel µs |")
        print("|---|---|---:|---:|")
        for dtype in (torch.float32, torch.bfloat16):
            reference = layer_op_microseconds(dtype, False, 20 * args.calls)
            fused = layer_op_microseconds(dtype, True, 20 * args.calls)
            for op in reference:
                print(f"| {str(dtype).removeprefix('torch.')} | {op} | {reference[op]:.1f} | "
                      f"{fused[op]:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
