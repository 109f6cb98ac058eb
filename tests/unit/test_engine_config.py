"""EngineConfig.create: vLLM's knobs, checked and resolved before anything heavy loads (only the
model's config.json is read), and the CLI's flags that feed it."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import msgspec
import pytest
import torch

from tandem.cli import add_engine_args, engine_kwargs
from tandem.engine.config import EngineConfig, compile_layers, resolve_dtype
from tandem.engine.messages import AddRequest
from tandem.engine.vllm_args import check_vllm_only_args
from tandem.request import Request
from tandem.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama[0]


def test_defaults_are_vllms(folder):
    config = EngineConfig.create(folder, device="cpu")
    assert config.seed == 0 and config.max_logprobs == 20
    assert config.logprobs_mode == "raw_logprobs"
    assert config.scheduler.scheduling_policy == "fcfs"
    assert config.scheduler.batching_policy == "decode-first"
    assert config.scheduler.enable_chunked_prefill
    assert config.scheduler.max_num_batched_tokens == 2048
    assert config.runner.dtype in ("float32", "bfloat16")  # auto on CPU: the probe's choice
    assert config.generation_config_path == config.model_path  # "auto"
    assert config.tokenizer_source == config.model_path


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(trust_remote_code=True), ValueError, "never runs code shipped with a checkpoint"),
        (dict(tensor_parallel_size=2), ValueError, "tensor_parallel_size must be 1"),
        (dict(dtype="float64"), ValueError, "dtype 'float64' is not supported"),
        (dict(dtype=torch.int8), ValueError, "not supported"),
        (dict(logprobs_mode="logits"), ValueError, "logprobs_mode must be one of"),
        (dict(max_logprobs=-2), ValueError, "max_logprobs must be >= 0 or -1"),
        (dict(seed=1.5), ValueError, "seed must be an int or None"),
        (dict(scheduling_policy="decode-first"), ValueError, "is batching_policy"),
        (dict(batching_policy="fcfs"), ValueError, "batching_policy must be one of"),
        (
            dict(gpu_memory_utilization=1.5),
            ValueError,
            r"gpu_memory_utilization must be in \(0, 1]",
        ),
        (dict(swap_space=-1), ValueError, "swap_space must be >= 0"),
        (dict(num_scheduler_steps=0), ValueError, "num_scheduler_steps must be >= 1"),
        (dict(num_scheduler_steps=True), ValueError, "num_scheduler_steps must be an int"),
        (dict(num_scheduler_steps=4, async_scheduling=True), ValueError, "async_scheduling"),
        (dict(adapt_cpu_threads=1), ValueError, "adapt_cpu_threads must be True or False"),
        (dict(stream_writes_first="yes"), ValueError, "stream_writes_first must be True"),
        (dict(tokenizer="/nonexistent/tok"), FileNotFoundError, "tokenizer path"),
        (dict(generation_config="/nonexistent"), FileNotFoundError, "generation_config="),
        (
            dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_num_seqs=8),
            ValueError,
            r"max_num_batched_tokens \(64\) must be >= max_model_len \(256\)",
        ),
    ],
)
def test_bad_knobs_are_refused_with_what_to_change(folder, kwargs, error, message):
    with pytest.raises(error, match=message):
        EngineConfig.create(folder, device="cpu", **kwargs)


def test_dtype_names_as_vllm_reads_them(folder):
    def dtype(value):
        return EngineConfig.create(folder, device="cpu", dtype=value).runner.dtype

    assert dtype("half") == "float16"
    assert dtype("float") == "float32"
    assert dtype("bfloat16") == "bfloat16"
    assert dtype(torch.float16) == "float16"


def test_auto_dtype_on_cuda(folder, monkeypatch):
    """On CPU, auto follows the format probe (test_cpu_formats.py); on CUDA, the checkpoint."""
    model_config = EngineConfig.create(folder, device="cpu", dtype="float32").model_config
    assert model_config.torch_dtype == "float32"  # save_pretrained of an fp32 model
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "cuda", model_config, folder) == ("bfloat16", 0, 0)  # fp32: bf16
    unknown = replace(model_config, torch_dtype=None)
    assert resolve_dtype("auto", "cuda", unknown, folder) == ("bfloat16", 0, 0)
    saved_fp16 = replace(model_config, torch_dtype="float16")
    assert resolve_dtype("auto", "cuda", saved_fp16, folder) == ("float16", 0, 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_dtype("auto", "cuda:0", model_config, folder) == ("float16", 0, 0)


def test_knobs_without_effect_here_are_logged(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.engine.config"):
        EngineConfig.create(
            folder, device="cpu", gpu_memory_utilization=0.8, swap_space=4, enforce_eager=True
        )
    assert "gpu_memory_utilization=0.8 has no effect on CPU" in caplog.text
    assert "swap_space=4 has no effect" in caplog.text
    assert "enforce_eager=True has no effect on CPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tandem.engine.config"):
        EngineConfig.create(folder, device="cpu")  # not given: nothing to say
    assert caplog.text == ""


def test_without_chunked_prefill_the_budget_covers_max_model_len(folder):
    config = EngineConfig.create(folder, device="cpu", enable_chunked_prefill=False)
    assert not config.scheduler.enable_chunked_prefill
    assert config.scheduler.max_num_batched_tokens == 2048  # max(256, 2048)
    config = EngineConfig.create(
        folder, device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=256
    )
    assert config.scheduler.max_num_batched_tokens == 256


def test_max_logprobs_refuses_with_both_numbers(folder):
    config = EngineConfig.create(folder, device="cpu", max_logprobs=5)
    config.check_logprobs(SamplingParams(logprobs=5, prompt_logprobs=5))
    with pytest.raises(ValueError, match="logprobs=6 is more than max_logprobs=5"):
        config.check_logprobs(SamplingParams(logprobs=6))
    with pytest.raises(ValueError, match="prompt_logprobs=7 is more than max_logprobs=5"):
        config.check_logprobs(SamplingParams(prompt_logprobs=7))
    with pytest.raises(ValueError, match=r"whole vocabulary.*max_logprobs=5"):
        config.check_logprobs(SamplingParams(logprobs=-1))
    config.check_logprobs(SamplingParams(logprobs=0, logprob_token_ids=[1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="logprob_token_ids has 6 ids, more than max_logprobs=5"):
        config.check_logprobs(SamplingParams(logprobs=0, logprob_token_ids=list(range(6))))
    unlimited = EngineConfig.create(folder, device="cpu", max_logprobs=-1)
    unlimited.check_logprobs(SamplingParams(logprobs=-1, prompt_logprobs=300))


def test_engine_wide_logprobs_mode_fills_only_unset_requests(folder):
    config = EngineConfig.create(folder, device="cpu", logprobs_mode="processed_logprobs")
    assert config.request_params(SamplingParams(logprobs=1)).logprobs_mode == "processed_logprobs"
    explicit = SamplingParams(logprobs=1, logprobs_mode="raw_logits")
    assert config.request_params(explicit).logprobs_mode == "raw_logits"


def test_generation_config_sources(folder, tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.25, "top_p": 0.5, "max_new_tokens": 7, "do_sample": True})
    )
    config = EngineConfig.create(folder, device="cpu", generation_config=tmp_path)
    assert config.sampling_defaults() == {"temperature": 0.25, "top_p": 0.5, "max_tokens": 7}
    overridden = EngineConfig.create(
        folder, device="cpu", generation_config=tmp_path,
        override_generation_config={"temperature": 0.0},
    )  # fmt: skip
    assert overridden.sampling_defaults()["temperature"] == 0.0
    vllm = EngineConfig.create(
        folder, device="cpu", generation_config="vllm", override_generation_config={"top_k": 5}
    )
    assert vllm.generation_config_path is None and vllm.sampling_defaults() == {"top_k": 5}


def test_vllm_only_arguments():
    check_vllm_only_args(dict(quantization=None, tokenizer_mode="auto", hf_overrides={}))
    with pytest.raises(ValueError, match="quantization='awq' is not supported: GGUF"):
        check_vllm_only_args(dict(quantization="awq"))
    with pytest.raises(ValueError, match="leave it at 1"):
        check_vllm_only_args(dict(pipeline_parallel_size=2))
    with pytest.raises(TypeError, match=r"does not have: no_such_arg.*coming-from-vllm"):
        check_vllm_only_args(dict(no_such_arg=1))


def test_vllm_only_arguments_without_effect_are_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.engine.vllm_args"):
        check_vllm_only_args(dict(disable_custom_all_reduce=True))
    assert "disable_custom_all_reduce=True has no effect" in caplog.text


def test_cli_flags_feed_the_same_config(folder):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([
        "--dtype", "half", "--seed", "7", "--scheduling-policy", "priority",
        "--batching-policy", "prefill-first", "--no-enable-chunked-prefill",
        "--max-logprobs", "5", "--logprobs-mode", "processed_logits", "--generation-config",
        "vllm", "--override-generation-config", '{"top_k": 3}', "--no-enable-prefix-caching",
        "--disable-log-stats", "--num-scheduler-steps", "3",
    ])  # fmt: skip
    assert engine_kwargs(args)["num_scheduler_steps"] == 3  # (fp16 runs one: no fused step)
    config = EngineConfig.create(folder, **engine_kwargs(args))
    assert config.runner.dtype == "float16" and config.seed == 7
    assert config.scheduler.scheduling_policy == "priority"
    assert config.scheduler.batching_policy == "prefill-first"
    assert not config.scheduler.enable_chunked_prefill and not config.enable_prefix_caching
    assert config.max_logprobs == 5 and config.logprobs_mode == "processed_logits"
    assert config.sampling_defaults() == {"top_k": 3} and config.disable_log_stats


def test_priority_crosses_the_process_boundary():
    message = AddRequest("r", [1, 2], SamplingParams(), 2, 1.0, None, priority=-3)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=AddRequest)
    assert decoded.priority == -3
    with pytest.raises(ValueError, match="priority must be an int"):
        Request("r", [1], priority=1.5)


@pytest.mark.parametrize(
    "value,expected",
    [(None, False), (0, False), (3, True), ({"level": 1}, True), ({"mode": 0}, False)],
)
def test_compilation_config_levels(value, expected):
    assert compile_layers(value, "cpu") is expected


@pytest.mark.parametrize("value", [4, -1, True, "3", {"level": 9}, {"backend": "inductor"}])
def test_compilation_config_refuses_what_it_cannot_do(value):
    with pytest.raises(ValueError, match="compilation_config"):
        compile_layers(value, "cpu")


def test_compilation_on_cuda_is_logged_as_no_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.engine.config"):
        assert compile_layers(3, "cuda") is False
    assert "no effect on CUDA" in caplog.text


def test_attention_backend_and_decode_graphs_per_device(folder):
    """CUDA: triton attention and decode graphs up to max_num_seqs, unless enforce_eager or
    the torch backend; CPU: the cpu backend where its kernel builds (else torch), eager.
    Nothing here touches a GPU: the choice is made before anything loads."""
    import importlib.util

    from tandem.attention import cpu_kernel

    def runner(**kwargs):
        return EngineConfig.create(folder, max_num_seqs=64, max_model_len=128, **kwargs).runner

    cpu = runner(device="cpu")
    expected = "cpu" if cpu_kernel.load_library() is not None else "torch"
    assert (cpu.attention_backend, cpu.decode_graph_max_batch) == (expected, 0)
    if importlib.util.find_spec("triton") is None:
        return
    cuda = runner(device="cuda")
    assert (cuda.attention_backend, cuda.decode_graph_max_batch, cuda.max_model_len) == (
        "triton", 64, 128,
    )  # fmt: skip
    assert runner(device="cuda", enforce_eager=True).decode_graph_max_batch == 0
    eager_torch = runner(device="cuda", attention_backend="torch")
    assert (eager_torch.attention_backend, eager_torch.decode_graph_max_batch) == ("torch", 0)
    assert runner(device="cuda", block_size=8).attention_backend == "triton"


def test_multi_step_scheduling_is_on_by_default_only_where_decode_steps_run_fused(folder):
    """Several forwards a step where a CPU's decode steps run fused (packed weights, the cpu
    attention backend), and nowhere else unless asked; never with async scheduling."""
    fp32 = EngineConfig.create(folder, device="cpu", dtype="float32")
    assert fp32.runner.packed_max_tokens == 0 and fp32.scheduler.num_scheduler_steps == 1
    asked = EngineConfig.create(folder, device="cpu", dtype="float32", num_scheduler_steps=4)
    assert asked.scheduler.num_scheduler_steps == 1  # logged: no fused decode step here
    overlapped = EngineConfig.create(folder, device="cpu", async_scheduling=True)
    assert overlapped.scheduler.num_scheduler_steps == 1
    auto = EngineConfig.create(folder, device="cpu")
    fused = auto.runner.packed_max_tokens > 0 and auto.runner.attention_backend == "cpu"
    assert auto.scheduler.num_scheduler_steps == (8 if fused else 1)
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    both = EngineConfig.create(folder, device="cpu", num_scheduler_steps=4,
                               speculative_config=ngram)  # fmt: skip
    assert both.scheduler.num_speculative_tokens == 2
    assert both.scheduler.num_scheduler_steps == (4 if fused else 1)


def test_stream_writes_first_on_cpu_only(folder):
    """On CPU the forward takes every core the API process needs to write the chunks; on a
    GPU the core waiting for them would leave the device idle."""
    assert EngineConfig.create(folder, device="cpu").stream_writes_first
    assert not EngineConfig.create(folder, device="cuda").stream_writes_first
    config = EngineConfig.create(folder, device="cpu", stream_writes_first=False)
    assert not config.stream_writes_first
