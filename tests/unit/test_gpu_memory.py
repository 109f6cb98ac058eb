"""Sizing the KV cache by profiling (worker/gpu_memory.py): the budget arithmetic, the shape of
the profiling step (run for real on CPU), and which configurations profile at all. The CUDA
memory readings themselves are exercised by benchmarks/gpu_check.py on a GPU."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig
from tandem.worker.gpu_memory import GiB, kv_cache_budget, profile_requests
from tandem.worker.model_runner import ModelRunner, RunnerConfig


def test_budget_is_the_share_less_what_the_largest_step_needs():
    # 80 GiB device at 0.9 = 72 GiB; the step peaked at 20 GiB over a 1 GiB cache, and 0.5
    # GiB went outside torch's allocator: 72 - 19 - 0.5.
    budget = kv_cache_budget(80 * GiB, 0.9, 20 * GiB, 1 * GiB, GiB // 2)
    assert budget == int(80 * GiB * 0.9) - 19 * GiB - GiB // 2
    # Memory freed outside torch (a negative reading) is not counted as room.
    assert kv_cache_budget(80 * GiB, 0.9, 20 * GiB, 1 * GiB, -GiB) == int(72 * GiB) - 19 * GiB
    with pytest.raises(ValueError, match=r"nothing is left for the KV cache.*Raise"):
        kv_cache_budget(16 * GiB, 0.5, 9 * GiB, 0, 0)


@pytest.mark.parametrize(
    "num_tokens,num_seqs,max_model_len",
    [(2048, 256, 4096), (8192, 1, 4096), (100, 256, 4096), (37, 5, 64), (1, 8, 8)],
)
def test_profile_step_is_the_largest_step(num_tokens, num_seqs, max_model_len):
    requests = profile_requests(num_tokens, num_seqs, max_model_len, block_size=16)
    lengths = [r.num_new_tokens for r in requests]
    assert sum(lengths) == num_tokens
    assert all(0 < length <= max_model_len for length in lengths)
    assert len(requests) >= min(num_seqs, num_tokens)  # as many logits rows as can be
    assert max(lengths) - min(lengths) <= 1 or len(requests) > num_seqs
    blocks = [b for r in requests for b in r.block_ids]
    assert blocks == list(range(len(blocks)))
    assert all(len(r.block_ids) * 16 >= r.num_new_tokens for r in requests)


def test_profile_step_runs_through_a_runner(tiny_llama):
    folder, _ = tiny_llama
    requests = profile_requests(96, 4, 64, block_size=16)
    num_blocks = sum(len(r.block_ids) for r in requests)
    runner = ModelRunner(RunnerConfig(model=folder, dtype="float32", num_kv_blocks=num_blocks))
    logits = runner.execute(requests)
    assert logits.shape == (4, runner.model_config.vocab_size)


def test_cuda_profiles_unless_the_cache_size_is_given(tiny_llama):
    folder, _ = tiny_llama

    def runner(**kwargs):
        return EngineConfig.create(folder, device="cuda", max_num_seqs=16,
                                   max_num_batched_tokens=512, **kwargs).runner  # fmt: skip

    profiled = runner()
    assert (profiled.gpu_memory_utilization, profiled.profile_num_tokens,
            profiled.profile_num_seqs) == (0.9, 512, 16)  # fmt: skip
    assert runner(gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5
    assert runner(kv_cache_memory=GiB).gpu_memory_utilization is None
    assert runner(num_kv_blocks=64).gpu_memory_utilization is None
    cpu = EngineConfig.create(folder, device="cpu").runner
    assert (cpu.gpu_memory_utilization, cpu.kv_cache_memory) == (None, 2 * GiB)
    with pytest.raises(ValueError, match="pass kv_cache_memory or num_kv_blocks"):
        runner(speculative_config={"method": "draft_model", "model": str(folder),
                                   "num_speculative_tokens": 2})  # fmt: skip


def test_runner_sizes_its_cache_through_the_profile(tiny_llama, monkeypatch):
    """The runner's profiling path end to end on CPU, the device's readings faked: the
    largest step runs over a cache just big enough for it, and the real cache gets the bytes
    the profile allows."""
    import tandem.worker.model_runner as model_runner

    folder, _ = tiny_llama
    seen = {}

    class FakeProfile:
        def __init__(self, device, utilization):
            seen["utilization"] = utilization

        def kv_cache_bytes(self, step, profile_cache_bytes):
            step()
            seen["profile_cache_bytes"] = profile_cache_bytes
            return 40 * seen["bytes_per_block"] + 7

    monkeypatch.setattr(model_runner, "MemoryProfile", FakeProfile)
    config = RunnerConfig(model=folder, dtype="float32", gpu_memory_utilization=0.5,
                          profile_num_tokens=96, profile_num_seqs=4, max_model_len=64)  # fmt: skip
    small = ModelRunner(RunnerConfig(model=folder, dtype="float32", num_kv_blocks=1))
    seen["bytes_per_block"] = model_runner.kv_cache_bytes_per_block(
        small.model_config, 16, small.dtype
    )
    runner = ModelRunner(config)
    assert seen["utilization"] == 0.5
    assert seen["profile_cache_bytes"] == 8 * seen["bytes_per_block"]  # 4 x 24 tokens
    assert runner.num_kv_blocks == 40
    assert all(cache.shape[1] == 40 for cache in runner.kv_caches)
