"""Where tandem keeps what it computes once per machine or per model file (GGUF metadata, the
machine's measured peaks and formats): never needed, only faster when present."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.cpu_load import contended, cpu_clock

logger = logging.getLogger(__name__)

# Measurements taken while other processes competed for the CPUs (cached_measurement).
_this_process_only: dict[tuple[Path, str], Any] = {}


def cache_root() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    explicit = os.environ.get("TANDEM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem"


def cached_measurement(file_name: str, key: str, measure: Callable[[], Any], cores: int) -> Any:
    """`measure()`'s JSON-able result for `key`, from `file_name` in the cache root when it has
    one; otherwise measured and added (written atomically: a temporary file renamed into
    place). A measurement that other processes competed with for the `cores` CPUs it runs on
    is kept for this process only (measured again at the next start): on disk a slow choice
    would stay for good. An unreadable file measures again; an unwritable one only logs."""
    path = cache_root() / file_name
    if (path, key) in _this_process_only:
        return _this_process_only[path, key]
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return cached[key]
    start = cpu_clock()
    result = measure()
    others = contended(start, cpu_clock(), cores)
    if others is not None:
        logger.warning(
            "other processes kept %.1f CPUs busy during this measurement (%s): its result is "
            "used but not cached, and measured again at the next start; start tandem on an "
            "idle machine to keep it",
            others, key,
        )  # fmt: skip
        _this_process_only[path, key] = result
        return result
    cached[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(cached, indent=1))
        staging.replace(path)
    except OSError as error:
        logger.warning("cannot cache a measurement in %s (%s)", path, error)
    return result
