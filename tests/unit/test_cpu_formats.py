"""dtype="auto" on CPU: a probe measures the formats once per machine and model shape, its choice
is cached and logged, and an explicit dtype always wins."""

from __future__ import annotations

import json
import logging

import pytest

from tandem.attention import cpu_kernel
from tandem.cache import cache_root
from tandem.config import model_config_from_hf
from tandem.engine import cpu_formats as formats_module
from tandem.engine.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
    dense_max_tokens,
    resolve_dtype,
)
from tandem.engine.cpu_formats import (
    DECODE_PROBE_BYTES_UNKNOWN,
    DECODE_PROBE_MIN_BYTES,
    DECODE_PROBE_TOKENS,
    LARGE_PROBE_ROUNDS,
    LARGE_PROBE_TOKENS,
    CpuFormats,
    _decode_probe_layers,
    cpu_formats,
    dense_kernel_max_tokens,
    last_level_cache_bytes,
)

from helpers import needs_cpu_kernels

TINY_HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY = model_config_from_hf(TINY_HF)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    # A quiet machine (a busy one is test_cpu_load's): the probe's result is always kept.
    monkeypatch.setattr("tandem.cache.contended", lambda *args: None)
    return tmp_path


def test_probe_measures_both_phases_and_is_cached(fresh_cache, monkeypatch):
    chosen = cpu_formats(TINY, packable=True)
    assert chosen.dtype in ("float32", "bfloat16")
    assert set(chosen.prefill_ms) == {"float32", "bfloat16"}
    assert chosen.prefill_ms[chosen.dtype] == min(chosen.prefill_ms.values())
    decode = chosen.decode_ms
    int8 = cpu_kernel.int8_matmul_vectorized()
    packed_formats = {"packed", "packed int8"} if int8 else {"packed"}
    assert set(decode) == {chosen.dtype, *packed_formats}
    # Packed for every size up to its cut, where its fastest form still measured beat the
    # dense format; not at the next one.
    assert chosen.packed_max_tokens in (0, *DECODE_PROBE_TOKENS, *LARGE_PROBE_TOKENS)
    for rows, dense_ms in decode[chosen.dtype].items():
        faster = min(decode[name][rows] for name in packed_formats if rows in decode[name])
        assert (faster < dense_ms) == (rows <= chosen.packed_max_tokens)
    # int8 activations from the size after which they were the faster packed form.
    assert chosen.int8_min_tokens in (0, *DECODE_PROBE_TOKENS) and (
        int8 or not chosen.int8_min_tokens
    )
    for rows in decode[chosen.dtype]:
        if chosen.int8_min_tokens and chosen.int8_min_tokens <= rows <= chosen.packed_max_tokens:
            assert decode["packed int8"][rows] < decode["packed"].get(rows, float("inf"))
    # Prefill-sized steps, timed only where packed weights won every decode size, against the
    # packed form those steps use.
    assert bool(chosen.large_ms) == (chosen.packed_max_tokens >= DECODE_PROBE_TOKENS[-1])
    used = "packed int8" if chosen.int8_min_tokens else "packed"
    for rows, dense_ms in chosen.large_ms.get(chosen.dtype, {}).items():
        if rows <= chosen.packed_max_tokens:  # the packed form won up to its cut
            assert chosen.large_ms[used][rows] < dense_ms
        elif rows == min(r for r in LARGE_PROBE_TOKENS if r > chosen.packed_max_tokens):
            assert chosen.large_ms[used][rows] >= dense_ms  # and lost at the next size
    assert (cache_root() / "cpu-formats.json").exists()

    def no_second_probe(*args):
        raise AssertionError("the cached result should have been used")

    monkeypatch.setattr(formats_module, "probe_cpu_formats", no_second_probe)
    assert cpu_formats(TINY, packable=True) == chosen


def test_an_unpackable_model_never_gets_packed_weights(fresh_cache):
    chosen = cpu_formats(TINY, packable=False)
    assert chosen.packed_max_tokens == 0 and set(chosen.decode_ms) == {chosen.dtype}


def test_a_corrupt_cache_is_probed_again(fresh_cache):
    (fresh_cache / "cpu-formats.json").write_text("{not json")
    assert cpu_formats(TINY, packable=False).dtype in ("float32", "bfloat16")
    assert json.loads((fresh_cache / "cpu-formats.json").read_text())


def test_decode_sizes_stream_a_layer_set_past_the_last_level_cache(tmp_path, monkeypatch):
    """sysfs says each cache's level, size and the CPUs sharing it; the probe's decode-sized
    matmuls read a set of layers twice what this process's CPUs can cache (at least
    DECODE_PROBE_MIN_BYTES), so they stream from memory."""
    # Four CPUs, two L3 caches of 32 MiB (two CCDs), each CPU its own L1 and L2.
    for cpu in range(4):
        caches = [("index0", 1, "32K", f"{cpu}"), ("index2", 2, "512K", f"{cpu}"),
                  ("index3", 3, "32768K", "0-1" if cpu < 2 else "2-3")]  # fmt: skip
        for index, level, size, shared in caches:
            folder = tmp_path / f"cpu{cpu}" / "cache" / index
            folder.mkdir(parents=True)
            (folder / "level").write_text(f"{level}\n")
            (folder / "size").write_text(f"{size}\n")
            (folder / "shared_cpu_list").write_text(f"{shared}\n")
        (tmp_path / f"cpu{cpu}" / "cache" / "index4").mkdir()  # unreadable: skipped
    assert last_level_cache_bytes(tmp_path, [0, 1, 2, 3]) == 64 << 20
    assert last_level_cache_bytes(tmp_path, [0, 1]) == 32 << 20  # one CCD's CPUs
    assert last_level_cache_bytes(tmp_path, [2]) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "missing", [0]) is None
    shape = model_config_from_hf({**TINY_HF, "num_hidden_layers": 1000})
    layer_bytes = 4 * sum(rows * cols for rows, cols in formats_module._layer_shapes(shape))

    def probe_bytes() -> int:
        return _decode_probe_layers(shape) * layer_bytes

    for cache_bytes, expected in (
        (96 << 20, 192 << 20),
        (8 << 20, DECODE_PROBE_MIN_BYTES),
        (None, DECODE_PROBE_BYTES_UNKNOWN),
    ):
        monkeypatch.setattr(formats_module, "last_level_cache_bytes", lambda size=cache_bytes: size)
        assert expected <= probe_bytes() < expected + layer_bytes


@pytest.mark.parametrize("int8_offered", [True, False])
@pytest.mark.parametrize(
    ("packed_wins_up_to", "expected_max_tokens"),
    [(128, 128), (256, 256), (1024, 1024), (4096, 2048)],
)
def test_packed_weights_take_prefill_sized_steps_where_they_measure_faster(
    fresh_cache, monkeypatch, packed_wins_up_to, expected_max_tokens, int8_offered
):
    """Past the decode sizes the probe times one layer's matrices (compute-bound steps), the
    packed form the model would use against the dense dtype, up to the default step budget."""
    assert LARGE_PROBE_TOKENS[-1] == DEFAULT_MAX_NUM_BATCHED_TOKENS
    if not int8_offered:
        monkeypatch.setattr(cpu_kernel, "int8_matmul_vectorized", lambda: False)
    timed: list[tuple[int, set[int]]] = []

    def fake_timings(candidates, rows):
        timed.append((rows, {len(weights) for weights, _, _ in candidates.values()}))
        dense = {"float32": 1.0 * rows, "bfloat16": 2.0 * rows}
        packed = 0.5 * rows if rows <= packed_wins_up_to else 3.0 * rows
        return {
            name: dense[name] if name in dense else packed * (0.9 if "int8" in name else 1.0)
            for name in candidates
        }

    monkeypatch.setattr(formats_module, "_interleaved_ms", fake_timings)
    chosen = cpu_formats(TINY, packable=True)
    assert (chosen.dtype, chosen.packed_max_tokens) == ("float32", expected_max_tokens)
    large_sizes = [rows for rows, _ in timed if rows > DECODE_PROBE_TOKENS[-1]]
    if packed_wins_up_to < DECODE_PROBE_TOKENS[-1]:
        assert not large_sizes and not chosen.large_ms
        return
    assert large_sizes == list(LARGE_PROBE_TOKENS) * LARGE_PROBE_ROUNDS
    assert all(matrices == {4} for rows, matrices in timed if rows in large_sizes)
    int8 = int8_offered and cpu_kernel.int8_matmul_vectorized()
    used = "packed int8" if int8 else "packed"
    assert chosen.int8_min_tokens == (1 if int8 else 0)
    assert set(chosen.large_ms) == {"float32", used}


def test_a_slow_moment_does_not_decide_a_prefill_size(fresh_cache, monkeypatch):
    """The packed weights measure slow at 1,024 rows in the first round over the prefill sizes
    only (a slow spell of the machine): the second round's time counts, and they keep every
    size."""
    calls_at: dict[int, int] = {}

    def fake_timings(candidates, rows):
        calls_at[rows] = calls_at.get(rows, 0) + 1
        slow_spell = rows == 1024 and calls_at[rows] == 1
        packed = (3.0 if slow_spell else 0.5) * rows
        return {name: 1.0 * rows if name == "float32" else 2.0 * rows if name == "bfloat16"
                else packed for name in candidates}  # fmt: skip

    monkeypatch.setattr(formats_module, "_interleaved_ms", fake_timings)
    chosen = cpu_formats(TINY, packable=True)
    assert chosen.packed_max_tokens == LARGE_PROBE_TOKENS[-1]
    assert calls_at[1024] == LARGE_PROBE_ROUNDS


def fake_choice(monkeypatch, dtype: str, packed_max_tokens: int, int8_min_tokens: int = 0) -> None:
    choice = CpuFormats(
        dtype, packed_max_tokens, {"float32": 2.0, "bfloat16": 1.0}, {}, int8_min_tokens
    )
    monkeypatch.setattr(formats_module, "cpu_formats", lambda config, packable: choice)


def test_auto_follows_the_probe_and_says_so(monkeypatch, caplog, tmp_path):
    fake_choice(monkeypatch, "bfloat16", 8, int8_min_tokens=2)
    gguf = tmp_path / "model.gguf"
    monkeypatch.setattr("tandem.engine.config.gguf_has_packable_weights", lambda path: True)
    with caplog.at_level(logging.INFO, logger="tandem.engine.config"):
        assert resolve_dtype("auto", "cpu", TINY, gguf) == ("bfloat16", 8, 2)
    assert "steps of at most 8 tokens, int8 activations from 2 tokens" in caplog.text


@pytest.mark.parametrize("dtype", ["float32", "float", "bfloat16", "half"])
def test_an_explicit_dtype_wins_and_keeps_weights_dense(monkeypatch, tmp_path, dtype):
    fake_choice(monkeypatch, "bfloat16", 8)
    expected = {"float": "float32", "half": "float16"}.get(dtype, dtype)
    assert resolve_dtype(dtype, "cpu", TINY, tmp_path / "model.gguf") == (expected, 0, 0)


def test_engine_config_carries_the_choice_to_the_runner(monkeypatch, tiny_llama):
    fake_choice(monkeypatch, "bfloat16", 4, int8_min_tokens=2)
    config = EngineConfig.create(tiny_llama[0], device="cpu")
    runner = config.runner
    assert (runner.dtype, runner.packed_max_tokens, runner.packed_int8_min_tokens) == (
        "bfloat16", 4, 2,
    )  # fmt: skip
    pinned = EngineConfig.create(tiny_llama[0], device="cpu", dtype="float32")
    assert (pinned.runner.dtype, pinned.runner.packed_max_tokens) == ("float32", 0)


def test_compiling_says_so_where_no_step_is_left_to_compile(monkeypatch, caplog, tiny_llama):
    fake_choice(monkeypatch, "float32", DEFAULT_MAX_NUM_BATCHED_TOKENS, int8_min_tokens=1)
    with caplog.at_level(logging.INFO, logger="tandem.engine.config"):
        EngineConfig.create(tiny_llama[0], device="cpu", compilation_config=3)
    assert "no step is compiled" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem.engine.config"):
        EngineConfig.create(tiny_llama[0], device="cpu", compilation_config=3,
                            max_num_batched_tokens=4096)  # fmt: skip
    assert "no step is compiled" not in caplog.text


@needs_cpu_kernels
def test_the_dense_kernel_probe_is_measured_cached_and_logged(fresh_cache, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.engine.cpu_formats"):
        max_tokens = dense_kernel_max_tokens(TINY)
    assert f"dense float32 kernel for steps of at most {max_tokens} tokens" in caplog.text
    (entry,) = (
        value
        for key, value in json.loads((fresh_cache / "cpu-formats.json").read_text()).items()
        if key.startswith("dense float32 kernel")
    )
    assert entry["max_tokens"] == max_tokens
    torch_ms, kernel_ms = (
        {int(rows): ms for rows, ms in entry["decode_ms"][name].items()}
        for name in ("torch", "kernel")
    )
    # The kernel at every size up to its cut, where it measured faster; not at the next one.
    for rows, ms in torch_ms.items():
        assert (kernel_ms[rows] < ms) == (rows <= max_tokens)
    monkeypatch.setattr(formats_module, "_interleaved_ms", None)  # a second probe would fail
    assert dense_kernel_max_tokens(TINY) == max_tokens


def test_only_float32_models_without_packed_weights_on_cpu_use_the_dense_kernel(
    monkeypatch, tiny_llama
):
    monkeypatch.setattr(formats_module, "dense_kernel_max_tokens", lambda config: 16)
    assert dense_max_tokens("float32", 0, "cpu", TINY) == 16
    assert dense_max_tokens("bfloat16", 0, "cpu", TINY) == 0
    assert dense_max_tokens("float32", 8, "cpu", TINY) == 0  # packed weights take small steps
    assert dense_max_tokens("float32", 0, "cuda:0", TINY) == 0
    config = EngineConfig.create(tiny_llama[0], device="cpu", dtype="float32")
    assert config.runner.dense_max_tokens == 16


@needs_cpu_kernels
@pytest.mark.parametrize("kernel_wins_up_to, expected", [(128, 128), (256, 256), (1024, 1024)])
def test_the_dense_kernel_takes_prompt_sized_steps_where_it_measures_faster(
    fresh_cache, monkeypatch, kernel_wins_up_to, expected
):
    """Where the kernel won every decode size, one layer's matrices are timed at the prompt
    sizes (LARGE_PROBE_ROUNDS rounds), and it keeps the sizes it wins there too."""
    timed: list[tuple[int, int]] = []

    def fake_timings(candidates, rows):
        timed.append((rows, len(candidates["kernel"][0])))
        return {"torch": 1.0 * rows, "kernel": (0.5 if rows <= kernel_wins_up_to else 2.0) * rows}

    monkeypatch.setattr(formats_module, "_interleaved_ms", fake_timings)
    assert dense_kernel_max_tokens(TINY) == expected
    large = [(rows, matrices) for rows, matrices in timed if rows > DECODE_PROBE_TOKENS[-1]]
    if kernel_wins_up_to < DECODE_PROBE_TOKENS[-1]:
        assert not large
        return
    assert [rows for rows, _ in large] == list(LARGE_PROBE_TOKENS) * LARGE_PROBE_ROUNDS
    assert {matrices for _, matrices in large} == {4}  # one layer's
