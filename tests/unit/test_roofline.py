"""Step telemetry: FLOP and byte counts against hand-computed values for a tiny shape, where a
step sits against the machine's peaks, and the peaks themselves (data sheet, probe, flags)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

from tandem.core.roofline import (
    MachinePeaks,
    ModelShape,
    StepWork,
    batch_sums,
    place_step,
    sums_work,
)
from tandem.engine import machine_peaks as peaks_module
from tandem.engine.machine_peaks import machine_peaks
from tandem.engine.stats import StepStats

# 2 layers, hidden 4, intermediate 8, 2 query heads and 1 KV head of dim 2, vocabulary 10,
# every number 4 bytes. One layer's projections: q and o 4x4 each, k and v 4x2 each, gate, up
# and down 4x8 each: 16 + 16 + 8 + 8 + 3 * 32 = 144 weights; the LM head 4 x 10 = 40.
TINY = ModelShape(
    num_layers=2, hidden_size=4, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=2,
    vocab_size=10, weight_bytes=4, kv_bytes=4, activation_bytes=4,
)  # fmt: skip


def step_work(shape: ModelShape, batch: list) -> StepWork:
    return sums_work(shape, batch_sums(batch))


@dataclass
class Work:
    num_computed_tokens: int
    num_new_tokens: int
    sample: bool
    draft_token_ids: tuple[int, ...] = ()


def test_layer_and_head_weights():
    assert TINY.layer_weights == 144
    assert TINY.lm_head_weights == 40


def test_decode_and_prefill_chunk_counted_by_hand():
    """A decode (5 tokens before, 1 new, sampled) and a first prompt chunk (3 new, not sampled):
    4 new tokens, 1 sampled row. Attention: the decode token sees 6 positions; the chunk's
    tokens see 1, 2 and 3: 12 positions. KV read over 6 + 3 positions, written for 4."""
    batch = [Work(5, 1, True), Work(0, 3, False)]
    work = step_work(TINY, batch)
    projections = 2 * 4 * 144 * 2  # 2 FLOPs per weight per token, 4 tokens, 2 layers
    attention = 4 * 2 * 2 * 12 * 2  # 4 * heads * head_dim per attended position, 2 layers
    lm_head = 2 * 1 * 40
    assert work.flops == projections + attention + lm_head == 2768
    weights = 4 * (144 * 2 + 40)  # every weight once
    embedding_rows = 4 * 4 * 4  # 4 rows of 4
    kv = 4 * (2 * 1 * 2) * 2 * (9 + 4)  # a key and a value of 2 per position per layer
    activations = 4 * 4 * (8 * 4 + 3 * 8) * 2  # per token per layer: 8 hidden-, 3 inter-sized
    logits = 4 * 1 * 10
    assert work.bytes == weights + embedding_rows + kv + activations + logits == 3624
    assert work.intensity == pytest.approx(2768 / 3624)


def test_counts_add_up_over_requests_and_grow_with_context():
    one, other = Work(100, 1, True), Work(7, 20, True)
    both = step_work(TINY, [one, other])
    alone = [step_work(TINY, [w]) for w in (one, other)]
    weights = 4 * (144 * 2 + 40)
    assert both.flops == alone[0].flops + alone[1].flops
    assert both.bytes == alone[0].bytes + alone[1].bytes - weights  # weights read once
    longer = step_work(TINY, [Work(1000, 1, True)])
    assert longer.flops > alone[0].flops and longer.bytes > alone[0].bytes
    assert step_work(TINY, [Work(100, 1, False)]).flops == alone[0].flops - 2 * 40


def test_steps_that_use_packed_weights_read_their_packed_bytes():
    """All 288 layer weights also packed in 100 bytes, for steps of at most 2 new tokens: those
    read 100 bytes for them instead of 4 x 288; larger steps read the dense ones."""
    packed = dataclasses.replace(TINY, packed_weights=288, packed_bytes=100, packed_max_tokens=2)
    for batch, saved in (([Work(5, 1, True)], 4 * 288 - 100), ([Work(0, 3, True)], 0)):
        assert step_work(TINY, batch).bytes - step_work(packed, batch).bytes == saved
        assert step_work(TINY, batch).flops == step_work(packed, batch).flops


def test_decode_is_memory_bound_and_a_long_prefill_compute_bound():
    """A real shape (SmolLM2-135M in fp32) on a machine with a ridge point of 10 FLOP/byte."""
    shape = ModelShape(30, 576, 1536, 9, 3, 64, 49152, 4, 4, 4)
    machine = MachinePeaks("test", 100e9, 10e9)
    decode = place_step(step_work(shape, [Work(256, 1, True)] * 8), 0.05, machine)
    prefill = place_step(step_work(shape, [Work(0, 512, True)]), 1.0, machine)
    assert decode.bound == "memory" and prefill.bound == "compute"
    assert decode.mbu == pytest.approx(decode.bytes / 0.05 / 10e9)
    assert prefill.mfu == pytest.approx(prefill.flops / 1.0 / 100e9)
    assert machine.ridge_point == 10


def test_phase_of_a_step():
    def stats(prefill: int, decode: int) -> StepStats:
        return StepStats(prefill, decode, 1, 0, 0.01, 0.0, 0, 1)

    assert [stats(8, 0).phase, stats(0, 4).phase, stats(8, 4).phase] == [
        "prefill", "decode", "mixed",
    ]  # fmt: skip


def test_cpu_probe_is_cached_per_machine_and_flags_override(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("tandem.cache.contended", lambda *args: None)  # a quiet machine
    probed = machine_peaks(torch.device("cpu"), torch.float32)
    assert 1e8 < probed.flops_per_second < 1e15 and 1e8 < probed.bytes_per_second < 1e13
    cached = json.loads((tmp_path / "machine-peaks.json").read_text())
    assert list(cached.values()) == [[probed.flops_per_second, probed.bytes_per_second]]

    def no_probe(*args):
        raise AssertionError("probed again")

    monkeypatch.setattr(peaks_module, "_probe", no_probe)
    assert machine_peaks(torch.device("cpu"), torch.float32) == probed
    overridden = machine_peaks(torch.device("cpu"), torch.float32, peak_tflops=2.0)
    assert overridden.flops_per_second == 2e12
    assert overridden.bytes_per_second == probed.bytes_per_second
    both = machine_peaks(torch.device("cpu"), torch.float32, 2.0, 50.0)
    assert (both.flops_per_second, both.bytes_per_second) == (2e12, 50e9)


def test_known_gpu_comes_from_the_data_sheet(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    half = machine_peaks(torch.device("cuda"), torch.bfloat16)
    single = machine_peaks(torch.device("cuda"), torch.float32)
    assert (half.flops_per_second, half.bytes_per_second) == (989e12, 4.8e12)
    assert single.flops_per_second == 67e12 and "data sheet" in half.name
