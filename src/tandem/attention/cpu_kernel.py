"""The CPU kernels (csrc/): decode attention over the paged cache, prompt chunks' causal
attention, a layer's RMSNorm and RoPE in one call each, GGUF-quantized matmuls for decode steps
(with fp32 or int8 activations), dense fp32 matmuls for decode steps, and a decode step's whole
layer stack in one call (worker/cpu_decode.py); compiled for this machine on first use, cached,
loaded with ctypes.

Plain C files (no torch headers) build in a few seconds, one compiler process each, with the
C compiler torch's own CPU compilation already needs, so there is nothing to install and
nothing to ship prebuilt. `-march=native` code only runs where it was built: the cached
library's name hashes the source, the compiler and the CPU's model and flags, so a cache
shared across machines never loads a library built for another CPU. Without a compiler the
torch backend runs instead.
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

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_decode_attention.c", "prefill_attention.c",
                                     "layer_ops.c", "packed_matmul.c", "packed_matmul_int8.c",
                                     "decode_forward.c", "sample_rows.c",
                                     "dense_matmul.c")]  # fmt: skip
# Hashed with the sources: a change rebuilds.
HEADERS = [CSRC / name for name in ("element_types.h", "kernels.h", "vector_math.h")]
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
    "-ffp-contract=off",  # no fused multiply-adds: RoPE stays bit-identical to torch's
]
# The attention kernel's stack buffers: query heads per work item (csrc: MAX_QUERIES, at
# least one token's GQA group) and the head size.
MAX_GROUP, MAX_HEAD_DIM = 32, 256
DTYPE_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
SPECIALIZED_HEAD_DIMS = (64, 128)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64,
             _i64, _i64, ctypes.c_float, _ptr, ctypes.c_int]  # fmt: skip
PREFILL_ARGTYPES = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
                    ctypes.c_float, _ptr, _i64, _i64, ctypes.c_int]  # fmt: skip
_RMS_NORM_ARGTYPES = [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, ctypes.c_int]
_ROTARY_ARGTYPES = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, ctypes.c_int]
_PACKED_MATMUL_ARGTYPES = [_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64,
                           ctypes.c_int]  # fmt: skip
SAMPLING_CANDIDATE_BYTES = 8  # csrc/sample_rows.c's candidate: a float and an int32
QUANT_TYPE_IDS = {"Q4_1": 0, "Q8_0": 1}  # csrc/packed_matmul.c's enum (Q4_0 goes as Q4_1)


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


def _build(compiler: str, target: Path, flags: list[str] = FLAGS) -> None:
    """Compile each source in a process of its own (the machine's cores at once: the sources
    take ~5 s of compiling on one core), link in a temporary folder beside the target, then
    rename the library into place: processes building at once each leave a whole library.
    `flags`: tests build for older instruction sets too."""
    target.parent.mkdir(parents=True, exist_ok=True)
    compile_flags = [flag for flag in flags if flag != "-shared"]
    with tempfile.TemporaryDirectory(dir=target.parent) as staging_name:
        staging = Path(staging_name)
        objects = [staging / f"{source.stem}.o" for source in SOURCES]
        compiles = [
            subprocess.Popen(
                [compiler, *compile_flags, "-c", str(source), "-o", str(output)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for source, output in zip(SOURCES, objects, strict=True)
        ]
        failures = [_failure(process) for process in compiles]
        for failure in failures:
            if failure is not None:
                raise failure
        library = staging / "library.so"
        subprocess.run(
            [compiler, *flags, *map(str, objects), "-o", str(library), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        library.replace(target)


def _failure(process: subprocess.Popen) -> subprocess.SubprocessError | None:
    """Wait for a compile; its error (with the compiler's message), or None."""
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired as timeout:
        process.kill()
        process.communicate()
        return timeout
    if process.returncode != 0:
        return subprocess.CalledProcessError(process.returncode, process.args, stderr=stderr)
    return None


def library_path() -> Path | None:
    """Where the library for this source, compiler and CPU lives in the cache (its name hashes
    them); None without a compiler. Raises OSError / SubprocessError where the compiler fails
    to report its version."""
    compiler = _compiler()
    if compiler is None:
        return None
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    digest = hashlib.sha256(
        "\0".join(
            [*(f.read_text() for f in SOURCES + HEADERS), version, " ".join(FLAGS),
             _cpu_identity()]
        ).encode()
    ).hexdigest()[:16]  # fmt: skip
    return cache_root() / "kernels" / f"tandem_cpu_kernels-{digest}.so"


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The kernel library, built once per (source, compiler, CPU) into the cache; None (and
    one warning) where it cannot be built or loaded."""
    try:
        target = library_path()
        if target is None:
            logger.warning("no C compiler (cc): CPU decode attention, RMSNorm, RoPE and GGUF "
                           "matmuls run in torch")  # fmt: skip
            return None
        if target.exists():
            try:
                library = ctypes.CDLL(str(target))
            except OSError:  # a damaged file: build it again
                target.unlink(missing_ok=True)
        if not target.exists():
            compiler = _compiler()
            assert compiler is not None  # library_path() found it
            _build(compiler, target)
            logger.info("built the CPU kernels: %s", target)
            library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        logger.warning("cannot build the CPU kernels (%s): decode attention, RMSNorm, RoPE "
                       "and GGUF matmuls run in torch", detail)  # fmt: skip
        return None
    for suffix in DTYPE_SUFFIXES.values():
        for head_dim in ("", *(f"_{d}" for d in SPECIALIZED_HEAD_DIMS)):
            function = getattr(library, f"paged_decode_attention_{suffix}{head_dim}")
            function.argtypes = _ARGTYPES
            function.restype = None
        for name, argtypes, restype in (
            ("rms_norm", _RMS_NORM_ARGTYPES, None),
            ("rotary", _ROTARY_ARGTYPES, None),
            ("packed_matmul", _PACKED_MATMUL_ARGTYPES, ctypes.c_int),  # -1: out of memory
            ("decode_step", [_ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int], ctypes.c_int),
            (
                "decode_steps",
                [*[_ptr] * 6, _i64, _ptr, _ptr, _i64, _ptr, ctypes.c_int],
                ctypes.c_int,
            ),
        ):
            function = getattr(library, f"{name}_{suffix}")
            function.argtypes = argtypes
            function.restype = restype
    library.quantize_rows_int8.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr]
    library.quantize_rows_int8.restype = None
    library.packed_matmul_int8_vectorized.restype = ctypes.c_int
    library.sample_rows.argtypes = [_ptr, _i64, _i64, *[_ptr] * 7, ctypes.c_int]
    library.sample_rows.restype = None
    library.argmax_rows.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int]
    library.argmax_rows.restype = None
    library.mask_rows.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64]
    library.mask_rows.restype = None
    for name in ("packed_matmul_argmax", "packed_matmul_int8_argmax"):
        function = getattr(library, name)
        function.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, ctypes.c_int]
        function.restype = None
    library.dense_matmul_f32.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr,
                                         ctypes.c_int]  # fmt: skip
    library.dense_matmul_f32.restype = None
    library.prefill_attention_f32.argtypes = PREFILL_ARGTYPES
    library.prefill_attention_f32.restype = ctypes.c_int  # -1: out of memory
    return library


def takes_logits(logits: torch.Tensor) -> bool:
    """Whether the sampling kernels take these logits: fp32 [rows, vocab] on CPU, with the
    library built (the tensor is looked at first: on other devices nothing is compiled)."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and load_library() is not None
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's first argmax of fp32 `logits` [rows, vocab] (torch's answer, in a vector pass
    per row); None where the kernel does not take it."""
    if not takes_logits(logits):
        return None
    logits = logits.contiguous()
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    load_library().argmax_rows(
        logits.data_ptr(), logits.shape[0], logits.shape[1], tokens.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return tokens


def mask_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> bool:
    """Structured outputs: -inf, in place, in each of `rows` of fp32 `logits` [*, vocab] for
    the tokens whose bit is clear in its row of `bitmask` [len(rows), words] (xgrammar's int32
    layout); False, nothing done, where the kernel does not take the logits."""
    if not takes_logits(logits) or not logits.is_contiguous():
        return False
    index = torch.tensor(rows, dtype=torch.int64)
    bitmask = bitmask.contiguous()
    load_library().mask_rows(
        logits.data_ptr(), logits.shape[1], index.data_ptr(), len(rows), bitmask.data_ptr(),
        bitmask.shape[1],
    )  # fmt: skip
    return True


def sampling_scratch_bytes(num_threads: int, vocab: int) -> int:
    """The C sampler's scratch (csrc/sample_rows.c): 2 * vocab candidates for each thread."""
    return num_threads * 2 * vocab * SAMPLING_CANDIDATE_BYTES


def sampling_columns(
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' parameters and uniforms as the C sampler reads them (sample_rows, and the
    fused decode step's bursts), in this order."""
    return (
        torch.tensor(temperature, dtype=torch.float32),
        torch.tensor(top_k, dtype=torch.int64),
        torch.tensor(top_p, dtype=torch.float32),
        torch.tensor(min_p, dtype=torch.float32),
        uniforms.to(torch.float32).contiguous(),
    )


def sample_rows(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    uniforms: torch.Tensor,
) -> torch.Tensor | None:
    """One token per row of fp32 `logits` [rows, vocab] (csrc/sample_rows.c): argmax where the
    temperature is 0, else a draw after min-p, top-k (0: none) and top-p, at the row's uniform
    in [0, 1); None where the kernel does not take it (then the caller samples in torch)."""
    if not takes_logits(logits):
        return None
    logits = logits.contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    num_threads = min(torch.get_num_threads(), max(rows, 1))  # scratch for each
    scratch = torch.empty(sampling_scratch_bytes(num_threads, vocab), dtype=torch.uint8)
    columns = sampling_columns(temperature, top_k, top_p, min_p, uniforms)
    load_library().sample_rows(
        logits.data_ptr(), rows, vocab, *(c.data_ptr() for c in columns), tokens.data_ptr(),
        scratch.data_ptr(), num_threads,
    )  # fmt: skip
    return tokens


def int8_matmul_vectorized() -> bool:
    """Whether the int8-activation matmul has a vector path here (AVX-512 VNNI and VBMI, or
    AVX2, FMA and F16C)."""
    library = load_library()
    return library is not None and bool(library.packed_matmul_int8_vectorized())


def _layer_op_library(x: torch.Tensor) -> ctypes.CDLL | None:
    """The library where a layer op on `x` can run in it: CPU, fp32 or bf16, outside
    torch.compile's tracing (which cannot see into a ctypes call)."""
    if (
        x.device.type != "cpu"
        or x.dtype not in DTYPE_SUFFIXES
        or torch.compiler.is_compiling()
        or (torch.is_grad_enabled() and x.requires_grad)  # autograd cannot see into C
    ):
        return None
    return load_library()


def dense_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """F.linear(x, weight, bias) of fp32 `x` [T, K] in one call (csrc/dense_matmul.c: a few
    rows by a dense fp32 matrix at memory speed), or None where the kernel does not take it."""
    library = _layer_op_library(x)
    tensors = (weight,) if bias is None else (weight, bias)
    if (
        library is None
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.stride(1) != 1
        or weight.dim() != 2
        or weight.shape[1] != x.shape[1]
        or (bias is not None and bias.shape != weight.shape[:1])
        or any(
            t.dtype != torch.float32
            or t.device != x.device
            or not t.is_contiguous()
            or (torch.is_grad_enabled() and t.requires_grad)
            for t in tensors
        )
    ):
        return None
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    library.dense_matmul_f32(
        weight.data_ptr(), None if bias is None else bias.data_ptr(), weight.shape[0],
        weight.shape[1], x.data_ptr(), x.stride(0), x.shape[0], out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def takes_prefill(query: torch.Tensor) -> bool:
    """Whether prefill_attention takes a chunk of these queries `[T, heads, head_dim]`: fp32 or
    bf16 on the CPU, head_dim a multiple of 8, the last dimension contiguous, outside
    torch.compile's tracing and autograd (they cannot see into C)."""
    return (
        query.dtype in (torch.float32, torch.bfloat16)
        and query.dim() == 3
        and query.shape[-1] % 8 == 0
        and query.stride(-1) == 1
        and _layer_op_library(query) is not None
    )


def prefill_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """A prompt chunk's causal attention into `out` (its rows of the output, shaped like
    `query` [T, heads, head_dim]; takes_prefill(query)): query i sits at position
    len(keys) − T + i and attends keys and values `[context_len, KVH, head_dim]` up to its
    own (csrc/prefill_attention.c). bf16 tensors are widened to fp32 for the kernel and its
    output narrowed into `out`: copies included, a call took 1.6-2.9x less time than torch's
    bf16 SDPA for the embedded model's prompts of 512-1,890 tokens on the Zen 5 EPYC."""
    if query.dtype == torch.bfloat16 and all(
        t.dtype == torch.bfloat16 for t in (keys, values, out)
    ):
        wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        _prefill_attention_f32(query.float(), keys.float(), values.float(), scale, wide)
        out.copy_(wide)
    else:
        _prefill_attention_f32(query, keys, values, scale, out)


def _prefill_attention_f32(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    if keys.stride() != values.stride() or keys.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    num_queries, num_heads, head_dim = query.shape
    context_len, num_kv_heads, _ = keys.shape
    tensors = (query, keys, values, out)
    if (
        not takes_prefill(query)
        or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors)
        or out.shape != query.shape
        or out.stride(-1) != 1
        or keys.shape != values.shape
        or keys.shape[-1] != head_dim
        or context_len < num_queries
        or num_heads % num_kv_heads
    ):
        raise ValueError(
            "prefill_attention takes fp32 (or all bf16) CPU queries, keys, values and output "
            "with contiguous rows of a head size that is a multiple of 8, whole GQA groups, and "
            "at least as many keys as queries (the chunk's own)"
        )
    if num_queries == 0:
        return
    status = load_library().prefill_attention_f32(
        query.data_ptr(), query.stride(0), query.stride(1), keys.data_ptr(), values.data_ptr(),
        keys.stride(0), keys.stride(1), num_queries, context_len, num_heads, num_kv_heads,
        head_dim, scale, out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the prefill attention could not allocate its buffers")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """models/layers.RMSNorm's result in one call, or None where the kernel does not take it
    (then the caller runs the torch version)."""
    library = _layer_op_library(x)
    if (
        library is None
        or not x.is_contiguous()
        or weight.dtype != x.dtype
        or weight.shape != (x.shape[-1],)
        or not weight.is_contiguous()
        or weight.device != x.device
        or (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return None
    out = torch.empty_like(x)
    size = x.shape[-1]
    getattr(library, f"rms_norm_{DTYPE_SUFFIXES[x.dtype]}")(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // size, size, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """models/layers.apply_rotary in place on `x` [T, heads, head_dim] (heads contiguous), with
    RotaryEmbedding's cos and sin (halves of one fp32 row per token); False where the kernel
    does not take it."""
    library = _layer_op_library(x)
    half = x.shape[-1] // 2
    if (
        library is None
        or x.dim() != 3
        or x.stride(2) != 1
        or x.stride(1) != x.shape[2]
        or x.stride(0) < x.shape[1] * x.shape[2]  # overlapping tokens
        or cos.dtype != torch.float32
        or cos.device != x.device
        or cos.shape[0] != x.shape[0]
        or cos.shape[-1] != half
        or cos.stride(-1) != 1
        or sin.data_ptr() != cos.data_ptr() + half * cos.element_size()
        or sin.stride(0) != cos.stride(0)
    ):
        return False
    getattr(library, f"rotary_{DTYPE_SUFFIXES[x.dtype]}")(
        x.data_ptr(), x.stride(0), x.shape[1], x.shape[2], cos.data_ptr(), cos.stride(0),
        x.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    return True


def packed_matmul(
    codes: torch.Tensor,
    scales: torch.Tensor,
    quant_type: str,
    out_features: int,
    x: torch.Tensor,
    int8_activations: bool = False,
) -> torch.Tensor:
    """x [T, K] times the quantized matrix (models/packed.py's kernel layout), transposed:
    [T, out_features], in x's dtype (fp16 computed through fp32). `int8_activations`: x
    quantized per 8 columns first (csrc/packed_matmul_int8.c)."""
    library = load_library()
    if library is None:
        raise RuntimeError("the CPU kernels could not be built: GGUF blocks cannot be multiplied")
    compute_dtype = x.dtype if x.dtype in DTYPE_SUFFIXES else torch.float32
    inputs = x.to(compute_dtype)
    if inputs.stride(-1) != 1:
        inputs = inputs.contiguous()
    out = torch.empty(inputs.shape[0], out_features, dtype=compute_dtype)
    status = getattr(library, f"packed_matmul_{DTYPE_SUFFIXES[compute_dtype]}")(
        codes.data_ptr(), scales.data_ptr(), QUANT_TYPE_IDS[quant_type], out_features,
        inputs.shape[1], inputs.data_ptr(), inputs.stride(0), inputs.shape[0], out.data_ptr(),
        int8_activations, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the packed matmul could not allocate its buffers")
    return out.to(x.dtype)


def packed_matmul_argmax(
    codes: torch.Tensor,
    scales: torch.Tensor,
    quant_type: str,
    out_features: int,
    x: torch.Tensor,
    int8_activations: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp32 row x [1, K] times the quantized matrix as packed_matmul multiplies it: the
    products [1, out_features] and their first argmax [1] (argmax_rows' answer), found by each
    thread in the columns it has just written (csrc/packed_matmul.c)."""
    library = load_library()
    if library is None:
        raise RuntimeError("the CPU kernels could not be built: GGUF blocks cannot be multiplied")
    if x.shape[0] != 1 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"one contiguous fp32 row, got {tuple(x.shape)} {x.dtype}")
    out = torch.empty(1, out_features)
    token = torch.empty(1, dtype=torch.int64)
    function = (
        library.packed_matmul_int8_argmax if int8_activations else library.packed_matmul_argmax
    )
    function(
        codes.data_ptr(), scales.data_ptr(), QUANT_TYPE_IDS[quant_type], out_features,
        x.shape[1], x.data_ptr(), out.data_ptr(), token.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out, token


def quantize_rows_int8(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] (fp32; K a multiple of 32) as the int8 matmul quantizes it: codes [T, K], the
    unit u of every 32 columns [T, K / 32], the multiple k of u that scales every 8 [T, K / 8]
    (int16) and Σ d·codes of every 32 [T, K / 32]; for tests."""
    library = load_library()
    if library is None:
        raise RuntimeError("the CPU kernels could not be built")
    x = x.float().contiguous()
    codes = torch.empty(x.shape, dtype=torch.int8)
    units = torch.empty(x.shape[0], x.shape[1] // 32)
    multiples = torch.empty(x.shape[0], x.shape[1] // 8, dtype=torch.int16)
    sums = torch.empty(x.shape[0], x.shape[1] // 32)
    library.quantize_rows_int8(
        x.data_ptr(), x.shape[0], x.shape[1], codes.data_ptr(), units.data_ptr(),
        multiples.data_ptr(), sums.data_ptr(),
    )  # fmt: skip
    return codes, units, multiples, sums


def kernel(dtype: torch.dtype, head_dim: int) -> ctypes._CFuncPtr:
    """The kernel for a cache of `dtype` (supports() true) and heads of `head_dim`."""
    library = load_library()
    if library is None:
        raise RuntimeError("the CPU decode-attention kernel could not be built")
    specialized = f"_{head_dim}" if head_dim in SPECIALIZED_HEAD_DIMS else ""
    return getattr(library, f"paged_decode_attention_{DTYPE_SUFFIXES[dtype]}{specialized}")


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this shape and dtype (its buffers are fixed-size)."""
    return (
        dtype in DTYPE_SUFFIXES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
    )
