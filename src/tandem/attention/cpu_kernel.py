"""The CPU decode-attention kernel (csrc/paged_decode_attention.c): compiled for this machine
on first use, cached, loaded with ctypes.

A plain C file (no torch headers) builds in well under a second with the C compiler torch's
own CPU compilation already needs, so there is nothing to install and nothing to ship
prebuilt. `-march=native` code only runs where it was built: the cached library's name hashes
the source, the compiler and the CPU's model and flags, so a cache shared across machines
never loads a library built for another CPU. Without a compiler the torch backend runs instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tandem.cache import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.c"
# -ffast-math's parts that vectorize reductions and the exp polynomial; -ffast-math itself
# would link crtfastmath (flush-to-zero for the whole process) and assume no infinities.
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-freciprocal-math",
]
# The kernel's stack buffers (csrc: MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK).
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 32, 256, 256
DTYPE_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
SPECIALIZED_HEAD_DIMS = (64, 128)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64,
             _i64, _i64, ctypes.c_float, _ptr, ctypes.c_int]  # fmt: skip


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted)))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file, then rename it into place: processes building at once
    each leave a whole library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as staging:
        staging_path = Path(staging.name)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(staging_path), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        staging_path.replace(target)
    finally:
        staging_path.unlink(missing_ok=True)


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The kernel library, built once per (source, compiler, CPU) into the cache; None (and
    one warning) where it cannot be built or loaded."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler (cc): CPU decode attention runs on the torch backend")
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
        digest = hashlib.sha256(
            "\0".join([SOURCE.read_text(), version, " ".join(FLAGS), _cpu_identity()]).encode()
        ).hexdigest()[:16]
        target = cache_root() / "kernels" / f"paged_decode_attention-{digest}.so"
        if target.exists():
            try:
                library = ctypes.CDLL(str(target))
            except OSError:  # a damaged file: build it again
                target.unlink(missing_ok=True)
        if not target.exists():
            _build(compiler, target)
            logger.info("built the CPU decode-attention kernel: %s", target)
            library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        logger.warning("cannot build the CPU decode-attention kernel (%s): the torch backend "
                       "runs instead", detail)  # fmt: skip
        return None
    for suffix in DTYPE_SUFFIXES.values():
        for head_dim in ("", *(f"_{d}" for d in SPECIALIZED_HEAD_DIMS)):
            function = getattr(library, f"paged_decode_attention_{suffix}{head_dim}")
            function.argtypes = _ARGTYPES
            function.restype = None
    return library


def kernel(dtype: torch.dtype, head_dim: int) -> ctypes._CFuncPtr:
    """The kernel for a cache of `dtype` (supports() true) and heads of `head_dim`."""
    library = load_library()
    if library is None:
        raise RuntimeError("the CPU decode-attention kernel could not be built")
    specialized = f"_{head_dim}" if head_dim in SPECIALIZED_HEAD_DIMS else ""
    return getattr(library, f"paged_decode_attention_{DTYPE_SUFFIXES[dtype]}{specialized}")


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
             block_size: int) -> bool:  # fmt: skip
    """Whether the kernel takes this shape and dtype (its buffers are fixed-size)."""
    return (
        dtype in DTYPE_SUFFIXES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and block_size <= MAX_BLOCK
    )
