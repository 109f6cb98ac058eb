"""The machine's ceilings for the roofline: peak FLOP/s at the model's dtype and peak memory
bytes/s. Known GPUs come from their data sheets (dense, no sparsity); a CPU is measured at start
by a short matmul and copy probe (~0.3 s), cached per machine, dtype, thread count and torch
version. Flags override either figure."""

from __future__ import annotations

import logging
import os
import platform
import time

import torch

from tandem.cache import cached_measurement
from tandem.core.roofline import MachinePeaks

logger = logging.getLogger(__name__)

# name fragment -> (bf16/fp16 FLOP/s, fp32 FLOP/s, bytes/s); the first fragment found wins.
KNOWN_GPUS: dict[str, tuple[float, float, float]] = {
    "H200": (989e12, 67e12, 4.8e12),
    "H100": (989e12, 67e12, 3.35e12),
    "A100": (312e12, 19.5e12, 2.04e12),
    "L4": (121e12, 30.3e12, 0.3e12),
}
PROBE_MATMUL_SIZE = 1024
PROBE_COPY_BYTES = 256 << 20  # well past any last-level cache
PROBE_REPEATS = 5


def machine_peaks(
    device: torch.device,
    dtype: torch.dtype,
    peak_tflops: float | None = None,
    peak_bandwidth_gbps: float | None = None,
) -> MachinePeaks:
    """The device's peaks at `dtype`, with `peak_tflops` / `peak_bandwidth_gbps` (when given)
    in place of the table's or the probe's figure."""
    peaks = _gpu_peaks(device, dtype) if device.type == "cuda" else _cpu_peaks(dtype)
    if peak_tflops is not None or peak_bandwidth_gbps is not None:
        peaks = MachinePeaks(
            name=f"{peaks.name}, overridden",
            flops_per_second=peaks.flops_per_second if peak_tflops is None else peak_tflops * 1e12,
            bytes_per_second=(
                peaks.bytes_per_second if peak_bandwidth_gbps is None else peak_bandwidth_gbps * 1e9
            ),
        )
    return peaks


def _gpu_peaks(device: torch.device, dtype: torch.dtype) -> MachinePeaks:
    name = torch.cuda.get_device_name(device)
    for fragment, (half, single, bandwidth) in KNOWN_GPUS.items():
        if fragment in name:
            flops = single if dtype == torch.float32 else half
            return MachinePeaks(f"{name} (data sheet)", flops, bandwidth)
    logger.warning(
        "no peak figures for %s: MFU and MBU use a probe; pass --peak-tflops and "
        "--peak-bandwidth-gbps for the data sheet's",
        name,
    )
    return _probe(device, dtype, name)


def _cpu_peaks(dtype: torch.dtype) -> MachinePeaks:
    name = f"{cpu_name()} x{os.cpu_count()}"
    key = f"{name}|{dtype}|{torch.get_num_threads()} threads|torch {torch.__version__}"

    def measure() -> list[float]:
        peaks = _probe(torch.device("cpu"), dtype, name)
        return [peaks.flops_per_second, peaks.bytes_per_second]

    flops, bandwidth = cached_measurement(
        "machine-peaks.json", key, measure, torch.get_num_threads()
    )
    return MachinePeaks(f"{name} (probed)", flops, bandwidth)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _probe(device: torch.device, dtype: torch.dtype, name: str) -> MachinePeaks:
    """Best of a few runs of a square matmul (FLOP/s) and a large copy (bytes/s, read + write):
    what the hardware gives a well-shaped kernel, which the model's steps are measured against."""
    size = PROBE_MATMUL_SIZE
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    source = torch.empty(PROBE_COPY_BYTES // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    matmul_seconds = _best_seconds(lambda: torch.mm(a, b), device)
    copy_seconds = _best_seconds(lambda: target.copy_(source), device)
    return MachinePeaks(
        f"{name} (probed)",
        flops_per_second=2 * size**3 / matmul_seconds,
        bytes_per_second=2 * PROBE_COPY_BYTES / copy_seconds,
    )


def _best_seconds(work, device: torch.device) -> float:
    work()  # warm-up: first-touch page faults, kernel selection
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
