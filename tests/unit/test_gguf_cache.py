"""The GGUF metadata cache: a second read comes from it and equals the first; a stale or broken
entry is never used."""

from __future__ import annotations

import os

import gguf
import numpy as np
from transformers import AutoTokenizer

from tandem.cache import cache_root
from tandem.config import model_config_from_hf
from tandem.engine.tokenizer import load_tokenizer
from tandem.models import gguf_loader
from tandem.models.gguf_cache import cached_json, entry_dir
from tandem.models.gguf_loader import _hf_config, gguf_model_config
from tandem.models.loader import resolve_model_path

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🎉"}]
TEXTS = ["Hello world!", "  tabs\tand\nnewlines ", "中文 é", "<|im_start|>user\nhi<|im_end|>"]


def test_cache_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    assert entry_dir(resolve_model_path("default"), "config").parent == tmp_path / "gguf"


def test_cached_tokenizer_equals_the_one_built_from_the_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = resolve_model_path("default")
    built = load_tokenizer("default")
    assert entry_dir(path, "tokenizer").is_dir()
    cached = load_tokenizer("default")
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for tokenizer in (built, cached):
        for text in TEXTS:
            for special in (True, False):
                expected = reference(text, add_special_tokens=special).input_ids
                assert tokenizer(text, add_special_tokens=special).input_ids == expected
        assert tokenizer.get_vocab() == reference.get_vocab()
        assert tokenizer.eos_token_id == reference.eos_token_id
        assert tokenizer.all_special_ids == reference.all_special_ids
        rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert rendered == reference.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=True
        )


def test_cached_config_equals_the_metadata_and_a_changed_file_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve_model_path("default")
    path = tmp_path / "model.gguf"
    path.write_bytes(source.read_bytes())
    expected = model_config_from_hf(_hf_config(path))
    assert gguf_model_config(path) == expected
    entry = entry_dir(path, "config")
    assert (entry / "data.json").is_file()
    assert gguf_model_config(path) == expected
    os.utime(path, ns=(1, 1))  # the file changed: another entry
    assert entry_dir(path, "config") != entry


def test_broken_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "any.gguf"
    path.write_bytes(b"x")
    assert cached_json(path, "config", lambda: {"a": 1}) == {"a": 1}
    (entry_dir(path, "config") / "data.json").write_text("{not json")
    assert cached_json(path, "config", lambda: {"a": 2}) == {"a": 2}


def test_tensors_come_from_the_cached_index_without_parsing_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = resolve_model_path("default")
    gguf_loader._tensors.cache_clear()
    architecture, first = gguf_loader._tensors(path)
    reader = gguf.GGUFReader(path)
    assert architecture == "llama" and len(first) == len(reader.tensors) > 0
    for ours, theirs in zip(first, reader.tensors, strict=True):
        assert (ours.name, ours.type_name) == (theirs.name, theirs.tensor_type.name)
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data)

    def parse(*args, **kwargs):
        raise AssertionError("the file was parsed again")

    gguf_loader._tensors.cache_clear()
    gguf_loader._reader.cache_clear()
    monkeypatch.setattr(gguf, "GGUFReader", parse)
    _, second = gguf_loader._tensors(path)
    for ours, again in zip(first, second, strict=True):
        assert ours.shape == again.shape and np.array_equal(ours.data, again.data)
    gguf_loader._tensors.cache_clear()
