"""Where tandem keeps what it computes once per machine or per model file (GGUF metadata, the
machine's measured peaks): never needed, only faster when present."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    explicit = os.environ.get("TANDEM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem"
