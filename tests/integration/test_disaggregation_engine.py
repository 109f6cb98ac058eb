"""Disaggregation at the engine-core level, in one process over loopback, on a tiny model:
a prefill core and a decode core exchange KV through the real sender and receiver (ZeroMQ and
a gloo pair group) and give the tokens of one core doing both; the prefill side's holds end
when the decode side aborts a queued request or when they expire."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tandem.bench.launch import free_port
from tandem.engine.config import EngineConfig
from tandem.engine.engine_core import EngineCore, EngineCoreOutput
from tandem.kv_transfer.config import KVTransferConfig
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams


def kv_port() -> int:
    """A port whose successor (the rendezvous store) is free too."""
    for _ in range(50):
        port = free_port()
        try:
            import socket

            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


def make_core(model, role: str | None = None, **kwargs) -> EngineCore:
    transfer = None
    if role == "prefill":
        transfer = KVTransferConfig("prefill", port=kv_port(), timeout=10, **kwargs)
    elif role == "decode":
        transfer = KVTransferConfig("decode", timeout=10)
    engine_args = {"num_kv_blocks": 64, "max_model_len": 256, "dtype": "float32"}
    if role == "decode" and "max_num_seqs" in kwargs:
        engine_args["max_num_seqs"] = kwargs.pop("max_num_seqs")
    return EngineCore(EngineConfig.create(model, kv_transfer_config=transfer, **engine_args))


def drain(core: EngineCore, finished: set[str], timeout: float = 60.0) -> dict[str, list]:
    """Step until every request in `finished`... has finished; tokens and outputs by id."""
    tokens: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    pending = set(finished)
    while pending and time.monotonic() < deadline:
        if core.has_work():
            outputs: list[EngineCoreOutput] = core.step()
        else:
            core.poll_kv_transfers()
            time.sleep(0.005)
            outputs = []
        for output in outputs:
            tokens.setdefault(output.request_id, []).append(output)
            if output.finish_reason is not None:
                pending.discard(output.request_id)
    assert not pending, f"not finished in {timeout} s: {pending}"
    return tokens


def token_ids(outputs: list[EngineCoreOutput]) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


def prefill_params(core: EngineCore, request_id: str, prompt: list[int], params) -> dict:
    one = dataclasses.replace(params, max_tokens=1)
    core.add_request(Request(request_id, prompt, one), {"do_remote_decode": True})
    outputs = drain(core, {request_id})[request_id]
    kv_params = outputs[-1].kv_transfer_params
    assert kv_params is not None and kv_params["do_remote_prefill"] is True
    return kv_params


@pytest.fixture(scope="module")
def cores(tiny_llama):
    model = tiny_llama[0]
    prefill, decode = make_core(model, "prefill"), make_core(model, "decode")
    return prefill, decode, make_core(model)


PROMPTS = [list(range(3, 3 + length)) for length in (5, 16, 37, 70)]
SAMPLING = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=3),
]


@pytest.mark.parametrize("params", SAMPLING, ids=["greedy", "seeded"])
def test_split_requests_equal_one_core_and_the_decode_core_prefills_nothing(cores, params):
    prefill, decode, colocated = cores
    steps_before = len(decode.step_stats)
    for index, prompt in enumerate(PROMPTS):
        request_id = f"{params.seed}-{index}"
        colocated.add_request(Request(f"c{request_id}", prompt, params))
        reference = token_ids(drain(colocated, {f"c{request_id}"})[f"c{request_id}"])
        kv_params = prefill_params(prefill, f"p{request_id}", prompt, params)
        decode.add_request(Request(f"d{request_id}", prompt, params), kv_params)
        outputs = drain(decode, {f"d{request_id}"})[f"d{request_id}"]
        assert token_ids(outputs) == reference
        if params.logprobs is not None:
            assert all(o.new_logprobs for o in outputs if o.new_token_ids)
    steps = list(decode.step_stats)[steps_before:]
    assert sum(s.num_prefill_tokens for s in steps) == 0
    assert sum(s.num_decode_tokens for s in steps) == len(PROMPTS) * (12 - 1)
    deadline = time.monotonic() + 5
    while prefill.kv_cache_manager.num_free_blocks < 64 and time.monotonic() < deadline:
        prefill.poll_kv_transfers()
        time.sleep(0.01)
    assert prefill.kv_cache_manager.num_free_blocks == 64  # every hold ended once pulled
    assert decode.kv_cache_manager.num_free_blocks == 64


def test_aborting_a_queued_decode_request_frees_its_prefill_hold(tiny_llama):
    """A decode core with one seat: the second request waits for it, is aborted there, and the
    prefill core is told at once instead of holding its blocks until they expire."""
    model = tiny_llama[0]
    prefill = make_core(model, "prefill", hold_seconds=600)
    decode = make_core(model, "decode", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    other = list(range(100, 137))  # no prefix in common with PROMPTS[3]
    first = prefill_params(prefill, "a", PROMPTS[3], params)
    second = prefill_params(prefill, "b", other, params)
    held = 64 - prefill.kv_cache_manager.num_free_blocks
    assert held == 5 + 3  # 70 and 37 prompt tokens in blocks of 16
    decode.add_request(Request("a", PROMPTS[3], params), first)
    decode.add_request(Request("b", other, params), second)
    for _ in range(3):  # "a" takes the seat and decodes; "b" waits for it
        decode.step() if decode.has_work() else time.sleep(0.05)
    assert decode.scheduler.requests["b"].status is RequestStatus.WAITING
    decode.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    deadline = time.monotonic() + 5
    while prefill.kv_cache_manager.num_free_blocks < 64 and time.monotonic() < deadline:
        prefill.poll_kv_transfers()
        time.sleep(0.01)
    # "a"'s blocks went when they were sent; "b"'s when the decode core released them.
    assert prefill.kv_cache_manager.num_free_blocks == 64
    assert prefill.scheduler_stats().kv_num_expired == 0
    drain(decode, {"a"})
    assert decode.kv_cache_manager.num_free_blocks == 64


def test_a_hold_nobody_pulls_expires(tiny_llama):
    prefill = make_core(tiny_llama[0], "prefill", hold_seconds=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prefill_params(prefill, "x", PROMPTS[1], params)
    assert prefill.kv_cache_manager.num_free_blocks == 64 - 1
    time.sleep(0.4)
    prefill.poll_kv_transfers()
    assert prefill.kv_cache_manager.num_free_blocks == 64
    assert prefill.scheduler_stats().kv_num_expired == 1
