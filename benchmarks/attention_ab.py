"""Decode attention kernel A/B: the working tree's `csrc/paged_decode_attention.c` against the
same file at a git revision, both built with the library's flags and called directly, alternated
in one process (this machine's speed moves by a third between minutes; within one process
and a few seconds it moves far less). The embedded model's head layout (9 query / 3 kv heads of
64), blocks of 16 over a shuffled block table, enough copies of the cache that it is read from
memory as in the model (its 30 layers do not fit the L3), 2 threads (torch's count). Layouts:
uniform batches of decodes, requests verifying drafts (k tokens each), and mixed steps (single
decodes beside a request with a short prompt chunk or drafts). Prints µs per call, best of
the rounds.

    .venv/bin/python benchmarks/attention_ab.py --base REV [--dtypes bf16 f32] [--rounds 6]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tandem.attention import cpu_kernel

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CACHE_BYTES = 48 << 20  # copies of a layout's cache up to this much: more than this L3
SOURCE = "src/tandem/attention/csrc/paged_decode_attention.c"
HEADERS = ("element_types.h", "kernels.h", "vector_math.h")
# name -> [(context before the step, new tokens)] per request
LAYOUTS = {
    "32 decodes over 100": [(100, 1)] * 32,
    "32 decodes over 160": [(160, 1)] * 32,
    "64 decodes over 400": [(400, 1)] * 64,
    "1 decode over 300": [(300, 1)],
    "1 decode over 1,000": [(1000, 1)],
    "1 request, 4 tokens over 300": [(300, 4)],
    "1 request, 8 tokens over 300": [(300, 8)],
    "1 request, 8 tokens over 1,000": [(1000, 8)],
    "8 requests, 4 tokens each over 300": [(300, 4)] * 8,
    "4 decodes + 6 tokens, over 300": [(300, 1)] * 4 + [(300, 6)],
    "8 decodes + a 16-token chunk over 500": [(200 + 10 * i, 1) for i in range(8)] + [(500, 16)],
    "8 decodes + a 16-token chunk over 1,000": [(200 + 10 * i, 1) for i in range(8)] + [(1000, 16)],
}


def build(source_dir: Path, target: Path) -> ctypes.CDLL:
    compiler = cpu_kernel._compiler()
    assert compiler is not None, "no C compiler"
    subprocess.run(
        [compiler, *cpu_kernel.FLAGS, str(source_dir / "paged_decode_attention.c"), "-o",
         str(target), "-lm"],
        check=True,
    )  # fmt: skip
    return ctypes.CDLL(str(target))


def base_sources(revision: str, folder: Path) -> Path:
    """The kernel's source and headers at `revision`, written into `folder`."""
    csrc = Path(SOURCE).parent
    for name in ("paged_decode_attention.c", *HEADERS):
        text = subprocess.run(
            ["git", "show", f"{revision}:{csrc / name}"], capture_output=True, check=True
        ).stdout
        (folder / name).write_bytes(text)
    return folder


class Layout:
    """One step's decode tokens, its cache (copies, each with its own block tables) and
    buffers, as the kernel takes them."""

    def __init__(self, requests: list[tuple[int, int]], dtype: torch.dtype) -> None:
        blocks = [-(-(context + new) // BLOCK_SIZE) for context, new in requests]
        row_bytes = NUM_KV_HEADS * HEAD_DIM * dtype.itemsize * 2 * BLOCK_SIZE
        self.copies = max(1, min(16, CACHE_BYTES // (sum(blocks) * row_bytes)))
        self.num_blocks = sum(blocks) * self.copies
        self.cache = torch.randn(2, self.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        self.width = max(blocks)
        pool = torch.randperm(self.num_blocks).tolist()
        self.tables = torch.zeros(self.copies, len(requests), self.width, dtype=torch.int64)
        for copy in range(self.copies):
            for index, count in enumerate(blocks):
                self.tables[copy, index, :count] = torch.tensor([pool.pop() for _ in range(count)])
        requests_of = [index for index, (_, new) in enumerate(requests) for _ in range(new)]
        lens = [context + j + 1 for context, new in requests for j in range(new)]
        self.num_tokens = len(lens)
        self.rows = np.arange(self.num_tokens, dtype=np.int64)
        self.requests = np.array(requests_of, dtype=np.int64)
        self.lens = np.array(lens, dtype=np.int64)
        self.query = torch.randn(self.num_tokens, NUM_HEADS, HEAD_DIM).to(dtype)
        self.out = torch.empty(self.num_tokens, NUM_HEADS, HEAD_DIM, dtype=dtype)

    def seconds_per_call(self, function: ctypes._CFuncPtr, calls: int) -> float:
        threads = torch.get_num_threads()
        start = time.perf_counter()
        for call in range(calls):
            table = self.tables[call % self.copies]
            function(
                self.query.data_ptr(), self.query.stride(0), self.query.stride(1),
                self.cache.data_ptr(), self.num_blocks, table.data_ptr(), self.width,
                self.rows.ctypes.data, self.requests.ctypes.data, self.lens.ctypes.data,
                self.num_tokens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                ctypes.c_float(HEAD_DIM**-0.5), self.out.data_ptr(), threads,
            )  # fmt: skip
        return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "f32"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=24)
    args = parser.parse_args()
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        (folder / "base").mkdir()
        libraries = {
            args.base: build(base_sources(args.base, folder / "base"), folder / "base.so"),
            "working tree": build(Path(SOURCE).parent, folder / "new.so"),
        }
        torch.manual_seed(0)
        print(f"µs per call (best of {args.rounds} rounds of {args.calls} calls, "
              f"{torch.get_num_threads()} threads): {args.base} / working tree")  # fmt: skip
        for dtype_name in args.dtypes:
            functions = {}
            for name, library in libraries.items():
                function = getattr(library, f"paged_decode_attention_{dtype_name}_64")
                function.argtypes = cpu_kernel._ARGTYPES
                functions[name] = function
            for label, requests in LAYOUTS.items():
                layout = Layout(requests, dtypes[dtype_name])
                best = dict.fromkeys(functions, float("inf"))
                for round_index in range(args.rounds):
                    order = list(functions) if round_index % 2 == 0 else list(reversed(functions))
                    for name in order:
                        layout.seconds_per_call(functions[name], 2)  # warm-up
                        best[name] = min(
                            best[name], layout.seconds_per_call(functions[name], args.calls)
                        )
                base, new = best[args.base], best["working tree"]
                print(f"{dtype_name:4s} {label:40s} {base * 1e6:8.1f} / {new * 1e6:8.1f}"
                      f"  ({base / new:.2f}x)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
