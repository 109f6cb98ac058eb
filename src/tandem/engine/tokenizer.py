"""Tokenizers for HF folders and GGUF files, both built by transformers from local files only."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tandem.models.gguf_cache import entry_dir, store
from tandem.models.loader import DEFAULT_MODEL, resolve_model_path


def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer and chat template of a model folder, a tokenizer-only folder (no
    config.json needed) or a GGUF file (from its metadata); "default": the embedded model's."""
    path = resolve_model_path(model) if str(model) == DEFAULT_MODEL else Path(model)
    if not path.exists():  # never a hub name: nothing is downloaded
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise FileNotFoundError(
            f"no usable tokenizer in {str(path)!r} ({error}); add the tokenizer files or pass "
            "skip_tokenizer_init=True and give token ids"
        ) from error


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Building the tokenizer from a GGUF's vocabulary takes seconds; a saved copy loads in a
    fraction of one."""
    entry = entry_dir(path, "tokenizer")
    if entry.is_dir():
        try:
            return AutoTokenizer.from_pretrained(entry)
        except (OSError, ValueError):
            pass  # unreadable: build it again
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    store(entry, tokenizer.save_pretrained)
    return tokenizer
