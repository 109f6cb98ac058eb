"""Whether other work shared this process's CPUs over an interval: a timing taken then says
more about the neighbours than about this machine's kernels, and must not be kept.

On 2 cores a second busy process slows a multithreaded matmul 2-30x, and unevenly: kernels
with more synchronization suffer more, so even interleaved candidates can come out in the
wrong order (a probe run beside the test suite chose fp32 activations and 32-token packed
steps, 25% slower at batch 1). Linux's /proc/stat counts each CPU's busy time; what this
process used of it (os.times) is ours, the rest (hypervisor steal included) is someone else's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# Other work beyond the CPUs the measurement leaves spare, in cores, that marks it as
# contended: an idle machine showed 0.01 over a 10 s probe, one competing busy loop 0.75.
CONTENDED_CORES = 0.2
# Other work under this much CPU time is housekeeping, whatever the interval's length.
NEGLIGIBLE_SECONDS = 0.02


@dataclass(frozen=True)
class CpuClock:
    wall: float  # seconds, monotonic
    own: float  # this process's CPU seconds (all threads, user + system)
    busy: float | None  # busy CPU seconds of the CPUs this process may run on; None: unknown


def cpu_clock() -> CpuClock:
    own = os.times()
    return CpuClock(time.perf_counter(), own.user + own.system, _busy_seconds())


def other_cores(start: CpuClock, end: CpuClock) -> float | None:
    """How many CPUs' worth of other work ran on this process's CPUs between two readings
    (None where the system does not say)."""
    if start.busy is None or end.busy is None or end.wall <= start.wall:
        return None
    others = (end.busy - start.busy) - (end.own - start.own)
    return others / (end.wall - start.wall) if others > NEGLIGIBLE_SECONDS else 0.0


def contended(start: CpuClock, end: CpuClock, cores: int) -> float | None:
    """Other work's CPU count over the interval when it took CPUs that a measurement running
    `cores` threads needed; None when it did not (or the system does not say). Spare CPUs are
    counted by physical core: a hyperthread beside a busy thread shares its core."""
    others = other_cores(start, end)
    spare = max(0, physical_cores(allowed_cpus()) - cores)
    return others if others is not None and others > spare + CONTENDED_CORES else None


def physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """How many cores the logical CPUs `cpus` are on (their thread-sibling sets in sysfs); one
    per CPU where the system does not say."""
    siblings = set()
    for cpu in cpus:
        try:
            siblings.add((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except OSError:
            siblings.add(str(cpu))
    return len(siblings)


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def _busy_seconds() -> float | None:
    """Busy time (user, nice, system, irq, softirq, steal) of the CPUs this process may run on,
    from /proc/stat; None off Linux."""
    allowed = allowed_cpus()
    ticks = 0
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if int(name[3:]) in allowed:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                    ticks += user + nice + system + irq + softirq + steal
    except (OSError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")
