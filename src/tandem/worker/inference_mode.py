"""torch.inference_mode for functions that run every step.

torch's own decorator builds and enters a context manager on every call: about 2 µs, several
times that right after a forward has run through the caches, and a batch-1 decode step on a
CPU calls two such functions (the runner's forward, the fused decode step). The engine's step
loops (llm.py, core_process.py) run under inference mode throughout, so a per-step function
only needs to enter it where a caller has not: a direct `EngineCore.step()`, the executor
thread of async scheduling, tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

Params = ParamSpec("Params")
Result = TypeVar("Result")


def inference_mode(function: Callable[Params, Result]) -> Callable[Params, Result]:
    """`function` under torch.inference_mode(), entered only where it is not on already."""

    @functools.wraps(function)
    def wrapper(*args: Params.args, **kwargs: Params.kwargs) -> Result:
        if torch.is_inference_mode_enabled():
            return function(*args, **kwargs)
        with torch.inference_mode():
            return function(*args, **kwargs)

    return wrapper
