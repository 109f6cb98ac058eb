"""The embedded model's GGUF matrices multiplied packed on CPU: the C kernel
(attention/csrc/packed_matmul.c) against torch's int4 weight-only op, for decode-sized steps.

Every matrix of the 30 layers as the file holds them (q, k, v, o, gate, up, down: 210 of
Q4_1, 66 MB: more than the L3 caches of the machines here, so each pass streams from memory)
and the Q8_0 LM head, at 1-16 rows;
best of a few passes, the two kernels taking turns. Also each kernel's largest error against
the dequantized fp32 matrices (relative to the largest output).

    .venv/bin/python benchmarks/packed_matmul.py [--passes 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.attention import cpu_kernel
from tandem.models.gguf_loader import gguf_model_config, iter_gguf_packable
from tandem.models.loader import resolve_model_path
from tandem.models.packed import PackedWeight, QuantBlocks

ROWS = (1, 2, 4, 8, 16)


def best_ms(weights: list[PackedWeight], rows: int, passes: int) -> float:
    inputs = {w.in_features: torch.randn(rows, w.in_features) for w in weights}
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for weight in weights:
            weight.matmul(inputs[weight.in_features])
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def largest_error(blocks: QuantBlocks, packed: PackedWeight) -> float:
    dequantized = torch.from_numpy(blocks.int4_codes().dequantize()).double()
    x = torch.randn(4, blocks.in_features)
    expected = x.double() @ dequantized.t()
    return ((packed.matmul(x).double() - expected).abs().max() / expected.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    if cpu_kernel.load_library() is None:
        raise SystemExit("no C compiler: the C kernel cannot be built here")
    path = resolve_model_path("default")
    config = gguf_model_config(path)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    matrices = dict(iter_gguf_packable(path, config))
    layers = [blocks for name, blocks in matrices.items() if name.startswith("model.layers.")]
    kernels = {"C kernel": True, "torch int4": False}
    sets = {
        (kernel, part): [PackedWeight.from_blocks(b, 16, use_kernel) for b in blocks]
        for kernel, use_kernel in kernels.items()
        for part, blocks in (("layers", layers), ("head", [matrices[head]]))
    }
    print(f"# {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{len(layers)} layer matrices + the LM head")  # fmt: skip
    print("| rows | layers, C kernel ms | layers, torch int4 ms | head, C kernel ms | "
          "head, torch int4 ms |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    for rows in ROWS:
        times = {key: float("inf") for key in sets}
        for _ in range(2):  # the kernels take turns
            for key, weights in sets.items():
                times[key] = min(times[key], best_ms(weights, rows, args.passes))
        print(f"| {rows} | {times['C kernel', 'layers']:.2f} | "
              f"{times['torch int4', 'layers']:.2f} | {times['C kernel', 'head']:.2f} | "
              f"{times['torch int4', 'head']:.2f} |")  # fmt: skip
    for kernel in kernels:
        errors = [
            largest_error(blocks, packed)
            for blocks, packed in zip(
                [layers[0], matrices[head]],
                [sets[kernel, "layers"][0], sets[kernel, "head"][0]],
                strict=True,
            )
        ]
        print(f"{kernel}: largest error against the dequantized fp32 matrix "
              f"(a Q4_1 layer, the Q8_0 head): {errors[0]:.1e}, {errors[1]:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
