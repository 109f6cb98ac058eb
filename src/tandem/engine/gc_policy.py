"""The step loop and Python's cyclic garbage collector.

A step creates a few short-lived objects per running request (its scheduled entry, its output,
token lists) that reference counting frees when the step ends; none of them form cycles. At
CPython's default first-generation threshold (700 allocations) the collector still runs
several times inside every step of a large batch, each run promotes the step's live objects
to an older generation, and so the older generations' collections, which traverse everything
the process holds (the model's modules, the tokenizer, every request), come every few steps.
Measured with benchmarks/step_overhead.py's stand-in device at 1,024 running requests, those
collections were half of the step loop's time.

So the engine-core process freezes what exists once it has started (`freeze_startup_objects`:
never traversed again), and the step loops (the core process's, and `LLM.generate`'s) run with
a first-generation threshold high enough that a step's own objects are freed by reference
counting before a collection sees them (`step_loop_gc`).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Allocations between first-generation collections inside a step loop: above what a step of a
# thousand running requests keeps alive at once (~5 objects each).
STEP_LOOP_GEN0_THRESHOLD = 50_000


def freeze_startup_objects() -> None:
    """Collect once, then move every object that exists to the permanent generation: the
    model, the tokenizer and the modules outlive the process's work and are never garbage.
    Only where one engine owns the process (its objects would never be collected after it
    went away)."""
    gc.collect()
    gc.freeze()


_lock = threading.Lock()
_depth = 0  # step loops running now (generate calls nest, or run on several threads)
_previous: tuple[int, ...] = ()


@contextmanager
def step_loop_gc() -> Iterator[None]:
    """While any step loop runs, the first generation is collected every
    STEP_LOOP_GEN0_THRESHOLD allocations (or the process's own threshold, if higher); the
    thresholds from before the first come back after the last."""
    global _depth, _previous
    with _lock:
        if _depth == 0:
            _previous = gc.get_threshold()
            gc.set_threshold(max(_previous[0], STEP_LOOP_GEN0_THRESHOLD), *_previous[1:])
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_previous)
