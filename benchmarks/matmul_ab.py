"""Matmul kernel A/B: the working tree's C matmuls against the same sources at a git revision,
both built with the library's flags and called directly, alternated in one process (this
machine's speed moves by a third between minutes; within one process and a few seconds it
moves far less). The embedded model's 30 layers, their 210 matrices as the file holds them (q,
k, v, o, gate, up, down; the engine fuses q/k/v and gate/up): the GGUF's Q4_1 codes in the
packed kernels' layout (66 MB, so each pass streams them from memory where the last-level
cache is smaller, as on the 2-core EPYCs) with int8 activations (csrc/packed_matmul_int8.c)
and with fp32 ones (csrc/packed_matmul.c), and the same matrices dequantized to fp32 through
the dense kernel (csrc/dense_matmul.c, a float32 model's decode path; 405 MB). 2 threads.
Prints ms per pass over the layers (best of 5 passes per round) and base / new per round;
the two builds' outputs must be equal bit for bit.

    .venv/bin/python benchmarks/matmul_ab.py --base REV [--kernels int8 packed dense]
        [--tokens 1 2 4 8 16 32] [--rounds 3] [--march x86-64-v3]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from tandem.attention import cpu_kernel
from tandem.models.gguf_loader import gguf_model_config, iter_gguf_packable
from tandem.models.loader import resolve_model_path
from tandem.models.packed import QuantBlocks

CSRC = Path("src/tandem/attention/csrc")
THREADS = 2
P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "dense_matmul_f32": [P, P, I64, I64, P, I64, I64, P, INT],
    "packed_matmul_int8_into": [P, P, I64, I64, I64, P, I64, P, P, INT],
    "packed_matmul": [P, P, I64, I64, I64, P, I64, P, INT],
    "packed_matmul_int8_scratch": [I64, I64],
}


def build(sources: Path, target: Path, march: str | None) -> ctypes.CDLL:
    """Every C file of the library at `sources`, as cpu_kernel builds them (`march` instead of
    the native instruction set: e.g. x86-64-v3 for the AVX2 paths)."""
    compiler = cpu_kernel._compiler()
    assert compiler is not None, "no C compiler"
    flags = [f"-march={march}" if f == "-march=native" and march else f for f in cpu_kernel.FLAGS]
    subprocess.run(
        [compiler, *flags, *map(str, sorted(sources.glob("*.c"))), "-o", str(target), "-lm"],
        check=True,
    )
    library = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = I64 if name.endswith("_scratch") else None
    return library


def base_sources(revision: str, folder: Path) -> Path:
    """The library's C sources and headers at `revision`, written into `folder`."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", revision, f"{CSRC}/"],
        capture_output=True, check=True, text=True,
    ).stdout.split()  # fmt: skip
    for name in names:
        text = subprocess.run(["git", "show", f"{revision}:{name}"], capture_output=True,
                              check=True).stdout  # fmt: skip
        (folder / Path(name).name).write_bytes(text)
    return folder


class Matrix:
    """One layer matrix: its packed codes and scales, and its dequantized fp32 rows."""

    def __init__(self, blocks: QuantBlocks) -> None:
        if blocks.quant_type == "Q4_0":
            blocks = blocks.as_q4_1()
        codes, scales = blocks.kernel_layout()
        self.codes, self.scales = np.ascontiguousarray(codes), np.ascontiguousarray(scales)
        self.quant_type = cpu_kernel.QUANT_TYPE_IDS[blocks.quant_type]
        self.dense = blocks.dequantize().contiguous().numpy()
        self.n_out, self.k = self.dense.shape


def calls(library: ctypes.CDLL, kernel: str, matrices: list[Matrix], x: dict[int, np.ndarray],
          outs: list[np.ndarray], scratch: np.ndarray) -> list:  # fmt: skip
    """One pass over the layers: a call per matrix."""
    tokens = next(iter(x.values())).shape[0]
    passes = []
    for m, out in zip(matrices, outs, strict=True):
        xk = x[m.k].ctypes.data
        if kernel == "dense":
            args = (m.dense.ctypes.data, None, m.n_out, m.k, xk, m.k, tokens, out.ctypes.data,
                    THREADS)  # fmt: skip
            passes.append((library.dense_matmul_f32, args))
        elif kernel == "int8":
            args = (m.codes.ctypes.data, m.scales.ctypes.data, m.quant_type, m.n_out, m.k, xk,
                    tokens, out.ctypes.data, scratch.ctypes.data, THREADS)  # fmt: skip
            passes.append((library.packed_matmul_int8_into, args))
        else:
            args = (m.codes.ctypes.data, m.scales.ctypes.data, m.quant_type, m.n_out, m.k, xk,
                    tokens, out.ctypes.data, THREADS)  # fmt: skip
            passes.append((library.packed_matmul, args))
    return passes


def aligned_rows(values: np.ndarray) -> np.ndarray:
    """A copy of `values` at a 64-byte boundary, as torch's CPU allocator places the engine's
    activations (numpy aligns to 16 bytes only; at an address off a cache line, the dense
    kernel's 64-byte loads of x split across two lines and a pass takes up to 1.5x as long)."""
    buffer = np.empty(values.size + 16, values.dtype)
    start = (-buffer.ctypes.data % 64) // values.itemsize
    copy = buffer[start : start + values.size].reshape(values.shape)
    copy[:] = values
    return copy


def best_ms(passes: list, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for function, args in passes:
            function(*args)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision of the kernels to compare")
    parser.add_argument("--kernels", nargs="+", choices=("int8", "packed", "dense"),
                        default=["int8", "packed", "dense"])  # fmt: skip
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 6, 8, 12, 16, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--march", help="instead of -march=native, e.g. x86-64-v3 (AVX2)")
    args = parser.parse_args()
    path = resolve_model_path("default")
    config = gguf_model_config(path)
    matrices = [Matrix(blocks) for name, blocks in iter_gguf_packable(path, config)
                if name.startswith("model.layers.")]  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        base_dir = base_sources(args.base, Path(folder))
        libraries = {
            "base": build(base_dir, Path(folder) / "base.so", args.march),
            "new": build(CSRC, Path(folder) / "new.so", args.march),
        }
        widest = max(m.k for m in matrices)
        scratch = np.empty(max(lib.packed_matmul_int8_scratch(max(args.tokens), widest)
                               for lib in libraries.values()), np.uint8)  # fmt: skip
        print(f"# matmul_ab  base {args.base} / working tree  -march={args.march or 'native'}  "
              f"{len(matrices)} matrices, {THREADS} threads")  # fmt: skip
        for kernel in args.kernels:
            print(f"\n{kernel}: ms per pass over the layers (best of 5 per round)")
            print("| token rows | base | new | base / new, per round |")
            print("|---:|---:|---:|---|")
            for tokens in args.tokens:
                rng = np.random.default_rng(tokens)
                x = {k: aligned_rows(rng.standard_normal((tokens, k), dtype=np.float32))
                     for k in {m.k for m in matrices}}  # fmt: skip
                outs = {name: [aligned_rows(np.empty((tokens, m.n_out), np.float32))
                               for m in matrices]
                        for name in libraries}  # fmt: skip
                passes = {name: calls(lib, kernel, matrices, x, outs[name], scratch)
                          for name, lib in libraries.items()}  # fmt: skip
                times: dict[str, list[float]] = {name: [] for name in libraries}
                for _ in range(args.rounds):
                    for name in libraries:
                        times[name].append(best_ms(passes[name]))
                same = all(np.array_equal(a, b) for a, b in zip(*outs.values(), strict=True))
                assert same, f"{kernel} at {tokens} rows: the builds' outputs differ"
                ratios = " ".join(f"{b / n:.2f}" for b, n in zip(times["base"], times["new"],
                                                                 strict=True))  # fmt: skip
                print(f"| {tokens} | {min(times['base']):.2f} | {min(times['new']):.2f} | "
                      f"{ratios} |")  # fmt: skip


if __name__ == "__main__":
    main()
