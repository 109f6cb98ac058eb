"""What dtype="auto" means on a CPU, decided by measurement on the machine it runs on.

CPUs differ more than GPUs: with AMX, a bf16 GEMM is 3-5x an fp32 one; on an AVX2-only part it
is several times slower. And the two phases want different things: prefill is compute-bound
(the fastest dense GEMM wins), decode is memory-bound (the fewest bytes per weight win, if the
kernel keeps up). So a short probe over the model's own layer shapes times, once per machine and
model shape (cached), a prefill-sized matmul in fp32 and bf16, and decode-sized ones (1, 2,
4, ... rows) of the chosen dense format against the packed kernel (models/packed.py, for
GGUF Q4_0 / Q4_1 / Q8_0 weights) with fp32 and with int8 activations; where the packed kernel
wins every decode size, prefill-sized steps too (on an AVX2-only EPYC, int8 activations
against packed weights beat torch's fp32 GEMM 1.1-1.3x at 512-2,048 rows). The result: the
model's dtype, up to how many tokens a step uses the packed weights, and from how many tokens
up those steps quantize their activations to int8.

A float32 model without packed weights (an explicit dtype="float32", or "auto" where fp32
won and packed weights did not) gets a second, smaller decision the same way:
up to how many tokens its steps multiply in the C dense kernel instead of torch's GEMM.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from tandem.attention import cpu_kernel
from tandem.cache import cached_measurement
from tandem.config import ModelConfig
from tandem.cpu_load import allowed_cpus
from tandem.engine.machine_peaks import cpu_name
from tandem.models.packed import PackedWeight, QuantBlocks

logger = logging.getLogger(__name__)

PREFILL_PROBE_TOKENS = 256
DECODE_PROBE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Decode-sized matmuls stream their weights from memory, not from cache: the probe's set of
# layers is, in fp32, at least twice the CPU's last-level cache and this large (or all of the
# model's layers, if smaller); where the cache size is unknown, DECODE_PROBE_BYTES_UNKNOWN.
# On the AVX2 EPYC (32 MiB L3) the times per layer were the same with 64 MiB as with 256 MiB,
# and so were the choices, in a third of the time (2.8 s against 8.2 s).
DECODE_PROBE_MIN_BYTES = 64 << 20
DECODE_PROBE_BYTES_UNKNOWN = 256 << 20
# Past the decode sizes, steps are compute-bound (each weight is used by hundreds of rows and
# stays in cache): one layer's matrices are timed, at sizes up to the default step budget.
LARGE_PROBE_TOKENS = (512, 1024, 2048)
# Rounds over those sizes, each size's best kept: one layer's passes take 20-90 ms, and a slow
# spell of a few hundred ms right after a kernel build once decided a size (int8 at 1,024
# rows 53 ms, against 34-35 ms in three later probes).
LARGE_PROBE_ROUNDS = 2
PROBE_REPEATS = 3


@dataclass(frozen=True)
class CpuFormats:
    dtype: str  # the dense weights' (and activations') dtype: "float32" or "bfloat16"
    packed_max_tokens: int  # steps of at most this many tokens use packed 4-bit weights; 0: never
    # What was measured (ms for the probe's layer set), for the log.
    prefill_ms: dict[str, float]
    decode_ms: dict[str, dict[int, float]]
    # Packed steps of at least this many tokens quantize their activations to int8; 0: none.
    int8_min_tokens: int = 0
    # ms for one layer's matrices at LARGE_PROBE_TOKENS (where the packed weights won every
    # decode size).
    large_ms: dict[str, dict[int, float]] = field(default_factory=dict)

    def describe(self) -> str:
        packed = (
            f"packed 4-bit weights for steps of at most {self.packed_max_tokens} tokens"
            if self.packed_max_tokens
            else "no packed weights"
        )
        if self.int8_min_tokens:
            packed += f", int8 activations from {self.int8_min_tokens} tokens"
        large = f", one layer at prefill sizes {self.large_ms}" if self.large_ms else ""
        return f"{self.dtype}, {packed} (probe, ms: prefill {self.prefill_ms}, decode " + (
            f"{self.decode_ms}{large})"
        )


def cpu_formats(config: ModelConfig, packable: bool) -> CpuFormats:
    """The probe's choice for a model of `config`'s shapes on this CPU; `packable`: the
    checkpoint has 4-bit GGUF weights the packed kernel can multiply."""
    key = "|".join((
        *_machine_and_model(config), f"packable {packable}", _kernels_name(),
        f"steps up to {LARGE_PROBE_TOKENS[-1]}",
    ))  # fmt: skip

    def measure() -> dict:
        started = time.perf_counter()
        formats = probe_cpu_formats(config, packable)
        logger.info("CPU format probe took %.2f s", time.perf_counter() - started)
        return asdict(formats)

    entry = dict(cached_measurement("cpu-formats.json", key, measure, torch.get_num_threads()))
    for sizes in ("decode_ms", "large_ms"):
        entry[sizes] = {  # JSON keys are strings
            name: {int(rows): ms for rows, ms in by_rows.items()}
            for name, by_rows in entry[sizes].items()
        }
    return CpuFormats(**entry)


def dense_kernel_max_tokens(config: ModelConfig) -> int:
    """Up to how many tokens a step of a float32 model multiplies its weights in the C kernel
    (csrc/dense_matmul.c) rather than through torch's GEMM: the largest step size the kernel
    was faster at here (0: none, or no kernel), timed over the model's layer shapes once per
    machine and model shape (cached); where it won every decode size, prompt-sized steps are
    timed too, as for the packed weights. On the 2-core AVX2 EPYC it took the layers 1.6-1.7x
    less time at one token, 2.7-2.9x less at 2-4, and lost from 64 or 128 tokens up; on the Zen
    5 EPYC, with its prefetch, it won up to 1,024 rows (1.55x at 256, 1.4x at 512, 1.2x at
    1,024) and tied at 2,048, where noise picks."""
    if cpu_kernel.load_library() is None:
        return 0
    key = "|".join((
        "dense float32 kernel", *_machine_and_model(config), _kernels_name(),
        f"steps up to {LARGE_PROBE_TOKENS[-1]}",
    ))  # fmt: skip

    def measure() -> dict:
        started = time.perf_counter()
        weights = _decode_probe_weights(config)
        decode_ms: dict[str, dict[int, float]] = {"torch": {}, "kernel": {}}
        max_tokens = 0
        for rows in DECODE_PROBE_TOKENS:
            measured = _interleaved_ms(
                {
                    "torch": (weights, _dense, torch.float32),
                    "kernel": (weights, _dense_kernel, torch.float32),
                },
                rows,
            )
            for name, ms in measured.items():
                decode_ms[name][rows] = ms
            if measured["kernel"] >= measured["torch"]:
                break
            max_tokens = rows
        large_ms: dict[str, dict[int, float]] = {}
        if max_tokens == DECODE_PROBE_TOKENS[-1]:
            one_layer = weights[: len(_layer_shapes(config))]
            candidates = {
                "torch": (one_layer, _dense, torch.float32),
                "kernel": (one_layer, _dense_kernel, torch.float32),
            }
            max_tokens = _large_max_tokens(candidates, "kernel", "torch", max_tokens, large_ms)
        logger.info(
            "dense float32 kernel for steps of at most %d tokens (probe, %.2f s, ms: %s %s)",
            max_tokens, time.perf_counter() - started, decode_ms, large_ms,
        )  # fmt: skip
        return {"max_tokens": max_tokens, "decode_ms": decode_ms, "large_ms": large_ms}

    return int(
        cached_measurement("cpu-formats.json", key, measure, torch.get_num_threads())["max_tokens"]
    )


def _machine_and_model(config: ModelConfig) -> tuple[str, ...]:
    """What a measurement depends on besides the kernels: the CPU, the threads, torch, and the
    model's layer shapes."""
    return (
        f"{cpu_name()} x{os.cpu_count()}",
        f"{torch.get_num_threads()} threads",
        f"torch {torch.__version__}",
        f"layer {_layer_shapes(config)} x{config.num_hidden_layers}",
    )


def _kernels_name() -> str:
    """Which kernels the probe times: the built C library (its name hashes its source) or
    torch's int4 op."""
    path = cpu_kernel.library_path() if cpu_kernel.load_library() is not None else None
    return f"kernels {path.name if path is not None else 'torch int4'}"


def _layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's matmuls: fused QKV, O, fused gate/up, down."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return [
        (config.q_size + 2 * config.kv_size, hidden),
        (hidden, config.q_size),
        (2 * inter, hidden),
        (hidden, inter),
    ]


def _decode_probe_weights(config: ModelConfig) -> list[torch.Tensor]:
    """fp32 matrices of the model's layer shapes, for enough layers that decode-sized matmuls
    stream them from memory."""
    return [torch.zeros(shape) for _ in range(_decode_probe_layers(config))
            for shape in _layer_shapes(config)]  # fmt: skip


def _decode_probe_layers(config: ModelConfig) -> int:
    """How many layers' matrices make _decode_probe_bytes in fp32 (all the model's, at most)."""
    layer_bytes = 4 * sum(rows * cols for rows, cols in _layer_shapes(config))
    probe_bytes = _decode_probe_bytes()
    return max(1, min(config.num_hidden_layers, -(-probe_bytes // layer_bytes)))


def _decode_probe_bytes() -> int:
    cache_bytes = last_level_cache_bytes()
    if cache_bytes is None:
        return DECODE_PROBE_BYTES_UNKNOWN
    return max(DECODE_PROBE_MIN_BYTES, 2 * cache_bytes)


def last_level_cache_bytes(
    sysfs: Path = Path("/sys/devices/system/cpu"), cpus: Iterable[int] | None = None
) -> int | None:
    """The last-level cache this process's CPUs (`cpus`: default, its affinity) can fill: the
    highest level Linux's sysfs lists, times the distinct caches of that level they sit on (a
    multi-CCD EPYC or a multi-socket Xeon has several); None where the system does not say."""
    cpus = sorted(allowed_cpus() if cpus is None else cpus)
    caches: dict[int, dict[str, int]] = {}  # level -> the CPUs sharing a cache -> its bytes
    for cpu in cpus:
        for index in (sysfs / f"cpu{cpu}" / "cache").glob("index*"):
            try:
                level = int((index / "level").read_text())
                size = (index / "size").read_text().strip()
                shared = (index / "shared_cpu_list").read_text().strip()
            except (OSError, ValueError):
                continue
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
            digits = size.rstrip("KMGkmg")
            if digits.isdigit():
                caches.setdefault(level, {})[shared] = int(digits) * scale
    return sum(caches[max(caches)].values()) if caches else None


def probe_cpu_formats(config: ModelConfig, packable: bool) -> CpuFormats:
    shapes = _layer_shapes(config)
    fp32 = _decode_probe_weights(config)
    num_layers = len(fp32) // len(shapes)
    one_layer = fp32[: len(shapes)]
    prefill_ms = _interleaved_ms(
        {
            "float32": (one_layer, _dense, torch.float32),
            "bfloat16": ([w.bfloat16() for w in one_layer], _dense, torch.bfloat16),
        },
        PREFILL_PROBE_TOKENS,
    )
    dtype = min(prefill_ms, key=prefill_ms.__getitem__)
    dense = fp32 if dtype == "float32" else [w.bfloat16() for w in fp32]
    del fp32
    decode_ms: dict[str, dict[int, float]] = {dtype: {}}
    large_ms: dict[str, dict[int, float]] = {}
    packed_max_tokens = int8_min_tokens = 0
    if packable:
        packed = [_packed_zeros(shape) for _ in range(num_layers) for shape in shapes]
        running = {"packed": packed}
        if packed[0].codes is not None and cpu_kernel.int8_matmul_vectorized():
            running["packed int8"] = [replace(weight, int8_min_tokens=1) for weight in packed]
        decode_ms.update({name: {} for name in running})
        activations = getattr(torch, dtype)
        for rows in DECODE_PROBE_TOKENS:
            measured = _interleaved_ms(
                {
                    dtype: (dense, _dense, activations),
                    **{name: (weights, _packed, activations) for name, weights in running.items()},
                },
                rows,
            )
            for name, ms in measured.items():
                decode_ms[name][rows] = ms
            best = min(decode_ms[name][rows] for name in running)
            if best >= decode_ms[dtype][rows]:
                break
            packed_max_tokens = rows
            # fp32 activations at twice int8's time are out of the running (their cost per row
            # grows faster).
            if running.keys() == {"packed", "packed int8"} and decode_ms["packed"][rows] > 2 * best:
                del running["packed"]
        # int8 from the smallest step size after which it was the faster packed format at
        # every size measured.
        for rows in reversed([r for r in DECODE_PROBE_TOKENS if r <= packed_max_tokens]):
            int8_ms = decode_ms.get("packed int8", {}).get(rows)
            fp32_ms = decode_ms["packed"].get(rows)
            if int8_ms is None or (fp32_ms is not None and fp32_ms <= int8_ms):
                break
            int8_min_tokens = rows
        if packed_max_tokens == DECODE_PROBE_TOKENS[-1]:
            # fp32 activations leave the running only where int8 is the faster form
            used = "packed int8" if int8_min_tokens else "packed"
            assert used in running
            one_layer = {
                dtype: (dense[: len(shapes)], _dense, activations),
                used: (running[used][: len(shapes)], _packed, activations),
            }
            packed_max_tokens = _large_max_tokens(
                one_layer, used, dtype, packed_max_tokens, large_ms
            )
    return CpuFormats(dtype, packed_max_tokens, prefill_ms, decode_ms, int8_min_tokens, large_ms)


def _large_max_tokens(
    one_layer: dict[str, Candidate],
    challenger: str,
    incumbent: str,
    max_tokens: int,
    large_ms: dict[str, dict[int, float]],
) -> int:
    """`max_tokens` grown over LARGE_PROBE_TOKENS while the challenger (one layer's matrices:
    such steps are compute-bound and reuse each weight from cache) stays faster than the
    incumbent: LARGE_PROBE_ROUNDS rounds over the sizes, each size's best kept in `large_ms`,
    so that a slow spell does not decide one."""
    for _ in range(LARGE_PROBE_ROUNDS):
        for rows in LARGE_PROBE_TOKENS:
            for name, ms in _interleaved_ms(one_layer, rows).items():
                by_rows = large_ms.setdefault(name, {})
                by_rows[rows] = min(ms, by_rows.get(rows, ms))
    for rows in LARGE_PROBE_TOKENS:
        if large_ms[challenger][rows] >= large_ms[incumbent][rows]:
            break
        max_tokens = rows
    return max_tokens


def _dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)


def _dense_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = cpu_kernel.dense_matmul(x, weight)
    assert out is not None, "the probe's matrices are ones the dense kernel takes"
    return out


def _packed(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    return weight.matmul(x)


def _packed_zeros(shape: tuple[int, int]) -> PackedWeight:
    """A Q4_1 matrix of zeros (20-byte blocks: d, m, 16 bytes of codes)."""
    rows, cols = shape
    blocks = np.zeros((rows, cols // 32 * 20), dtype=np.uint8)
    return PackedWeight.from_blocks(QuantBlocks(blocks, "Q4_1", cols), max_tokens=0)


# A candidate format: its weights, how to multiply by one of them, the activations' dtype.
Candidate = tuple[list, Callable, torch.dtype]


def _interleaved_ms(candidates: dict[str, Candidate], rows: int) -> dict[str, float]:
    """Each candidate's best of a few passes of `rows` activations through all its weights,
    the candidates taking turns pass by pass: a moment when the machine is slow slows every
    candidate, where timing one after the other let it decide the comparison (a probe timed so
    on a noisy day chose fp32 activations for steps of up to 7 tokens, where int8 is faster)."""
    inputs = {
        name: {
            in_features: torch.randn(rows, in_features).to(dtype)
            for in_features in {_in_features(weight) for weight in weights}
        }
        for name, (weights, _, dtype) in candidates.items()
    }

    def one_pass(name: str) -> float:
        weights, matmul, _ = candidates[name]
        start = time.perf_counter()
        for weight in weights:
            matmul(inputs[name][_in_features(weight)], weight)
        return time.perf_counter() - start

    for name in candidates:  # warm-up: first touch, kernel selection
        one_pass(name)
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(PROBE_REPEATS):
        for name in candidates:
            best[name] = min(best[name], one_pass(name))
    return {name: round(seconds * 1e3, 3) for name, seconds in best.items()}


def _in_features(weight: torch.Tensor | PackedWeight) -> int:
    return weight.in_features if isinstance(weight, PackedWeight) else weight.shape[1]
