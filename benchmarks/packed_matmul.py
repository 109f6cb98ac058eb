"""The embedded model's GGUF matrices multiplied packed on CPU: the C kernel with fp32
activations (attention/csrc/packed_matmul.c), with int8 ones (csrc/packed_matmul_int8.c, where
this build has its vector path) and torch's int4 weight-only op, for decode-sized steps.

Every matrix of the 30 layers as the file holds them (q, k, v, o, gate, up, down: 210 of
Q4_1, 66 MB: more than the L3 caches of the machines here, so each pass streams from memory)
and the Q8_0 LM head, at 1-32 rows; best of a few passes, the kernels taking turns. Also
each kernel's largest error against the dequantized fp32 matrices (relative to the largest
output; int8 activations: their rounding).

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

ROWS = (1, 2, 4, 8, 16, 32)


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
    kernels = {"C kernel": (True, 0), "C kernel int8": (True, 1), "torch int4": (False, 0)}
    if not cpu_kernel.int8_matmul_vectorized():
        del kernels["C kernel int8"]
    sets = {
        (kernel, part): [
            PackedWeight.from_blocks(b, max(ROWS), use_kernel, int8_min_tokens=int8) for b in blocks
        ]
        for kernel, (use_kernel, int8) in kernels.items()
        for part, blocks in (("layers", layers), ("head", [matrices[head]]))
    }
    print(f"# {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{len(layers)} layer matrices + the LM head")  # fmt: skip
    columns = [(kernel, part) for part in ("layers", "head") for kernel in kernels]
    print("| rows | " + " | ".join(f"{part}, {kernel} ms" for kernel, part in columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for rows in ROWS:
        times = {key: float("inf") for key in sets}
        for _ in range(2):  # the kernels take turns
            for key, weights in sets.items():
                times[key] = min(times[key], best_ms(weights, rows, args.passes))
        print(f"| {rows} | " + " | ".join(f"{times[key]:.2f}" for key in columns) + " |")
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
