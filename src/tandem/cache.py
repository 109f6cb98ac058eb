"""Where tandem keeps what it computes once per machine or per model file (GGUF metadata, the
machine's measured peaks and formats): never needed, only faster when present."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    explicit = os.environ.get("TANDEM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem"


def cached_measurement(file_name: str, key: str, measure: Callable[[], Any]) -> Any:
    """`measure()`'s JSON-able result for `key`, from `file_name` in the cache root when it has
    one; otherwise measured and added (written atomically: a temporary file renamed into
    place). An unreadable file measures again; an unwritable one only logs."""
    path = cache_root() / file_name
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return cached[key]
    cached[key] = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(cached, indent=1))
        staging.replace(path)
    except OSError as error:
        logger.warning("cannot cache a measurement in %s (%s)", path, error)
    return cached[key]
