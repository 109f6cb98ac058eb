"""What takes seconds to read out of a GGUF file's metadata (its config, the tokenizer that
transformers builds from its vocabulary, the index of its tensors), kept on disk so that later
starts read small files. An entry is keyed by the file's path, size, inode, modification and
change times (a copy that kept the modification time is still another file: the tensor
index's offsets must not outlive it) and by the versions of the readers that built it; it is
written to a temporary folder and renamed into place, so two processes starting at once never
see half of one. An unwritable cache only costs the time."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tandem.cache import cache_root

logger = logging.getLogger(__name__)

FORMAT = 1


def entry_dir(gguf_path: Path, kind: str) -> Path:
    """Where the `kind` entry of this GGUF file lives (it may not exist yet)."""
    stat = gguf_path.stat()
    key = "|".join(
        [str(FORMAT), str(gguf_path.resolve()), str(stat.st_size), str(stat.st_mtime_ns),
         str(stat.st_ino), str(stat.st_ctime_ns), version("gguf"), version("transformers")]
    )  # fmt: skip
    return cache_root() / "gguf" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:24]}"


def store(entry: Path, write: Callable[[Path], None]) -> None:
    """Fill `entry` with what `write(folder)` writes, atomically; failures are only logged."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".staging-"))
    except OSError as error:
        logger.warning("cannot cache in %s (%s): the next start reads the GGUF again", entry, error)
        return
    try:
        write(staging)
        staging.rename(entry)
    except OSError as error:  # another process got there first, or the disk is full
        if not entry.exists():
            logger.warning("cannot cache in %s (%s)", entry, error)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)


def cached_json(gguf_path: Path, kind: str, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`build()`'s result for this file, from the cache when it has it."""
    entry = entry_dir(gguf_path, kind)
    with contextlib.suppress(OSError, ValueError):
        return json.loads((entry / "data.json").read_text())
    data = build()
    store(entry, lambda folder: (folder / "data.json").write_text(json.dumps(data)))
    return data
