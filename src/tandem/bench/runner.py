"""One benchmark run as data: the workload sent to a server, every request's record, the
settings and the machine, and the figures derived from the records (kept in the JSON for
convenience; `tandem bench compare` recomputes them)."""

from __future__ import annotations

import asyncio
import datetime
import math
import os
import platform
import sys
from pathlib import Path

from tandem.bench.client import ClientConfig, first_model, run_workload
from tandem.bench.records import RequestRecord
from tandem.bench.report import compute_metrics
from tandem.bench.workloads import Workload

FORMAT = "tandem-bench-serve/1"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


def machine() -> dict:
    """CPU model, cores and the vector extensions that decide CPU kernels' speed."""
    info = {
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and "cpu" not in info:
            info["cpu"] = value.strip()
        if key.strip() == "flags" and "flags" not in info:
            present = set(value.split())
            info["flags"] = [flag for flag in CPU_FLAGS if flag in present]
    return info


def run_benchmark(
    workload: Workload,
    config: ClientConfig,
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    slos: dict[str, float] | None = None,
    label: str | None = None,
    warmup: bool = True,
    progress: bool = True,
    extra: dict | None = None,
) -> dict:
    """Run `workload` against the server in `config` (its model: the server's first if empty)."""
    if not config.model:
        config.model = asyncio.run(first_model(config.base_url, config.api_key))
    started = datetime.datetime.now().astimezone()
    records, warm = asyncio.run(
        run_workload(
            workload,
            config,
            request_rate,
            burstiness,
            max_concurrency,
            seed,
            warmup=warmup,
            progress=progress,
        )
    )
    # the figures come from the records as stored (rounded to the microsecond), so anyone
    # recomputing them from the JSON gets exactly the stored figures
    records = [RequestRecord.from_dict(record.to_dict()) for record in records]
    return {
        "format": FORMAT,
        "label": label or f"{workload.name}@{config.base_url}",
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "config": {
            "base_url": config.base_url,
            "model": config.model,
            "endpoint": config.endpoint,
            "request_rate": "inf" if math.isinf(request_rate) else request_rate,
            "burstiness": burstiness,
            "max_concurrency": max_concurrency,
            "seed": seed,
            "ignore_eos": config.ignore_eos,
            "temperature": config.temperature,
            "goodput": dict(slos or {}),
            **(extra or {}),
        },
        "workload": {
            "name": workload.name,
            "num_sessions": len(workload.sessions),
            "num_requests": workload.num_requests,
            **workload.params,
        },
        "machine": machine(),
        "warmup": warm,
        "records": records,
        "metrics": compute_metrics(records, slos),
    }
