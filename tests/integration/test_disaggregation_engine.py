"""Disaggregation at the engine-core level, in one process over loopback, on a tiny model:
a prefill core and a decode core exchange KV through the real sender and receiver (ZeroMQ and
a gloo pair group) and give the tokens of one core doing both; the prefill side's holds end
when the decode side aborts a queued request or when they expire. Streamed transfers (both
legs at once) deliver blocks while the prompt is still being computed, and end cleanly when
either leg is aborted."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from tandem.bench.launch import free_port
from tandem.core.outputs import EngineCoreOutput
from tandem.engine.config import EngineConfig
from tandem.engine.engine_core import EngineCore
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


def make_core(model, role: str | None = None, engine_args=None, **kwargs) -> EngineCore:
    transfer = None
    if role == "prefill":
        transfer = KVTransferConfig("prefill", port=kv_port(), timeout=10, **kwargs)
    elif role == "decode":
        transfer = KVTransferConfig("decode", timeout=10)
    engine_args = {"num_kv_blocks": 64, "max_model_len": 256, "dtype": "float32"} | (
        engine_args or {}
    )
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


def one_core_tokens(core: EngineCore, request_id: str, prompt: list[int], params) -> list[int]:
    """The reference: the request's tokens from a core that does both phases."""
    core.add_request(Request(request_id, prompt, params))
    return token_ids(drain(core, {request_id})[request_id])


def assert_same_tokens(outputs: list[EngineCoreOutput], reference: list[int], params) -> None:
    """A split request's tokens are one core's, with logprobs on every output if it asked."""
    assert token_ids(outputs) == reference
    if params.logprobs is not None:
        assert all(o.new_logprobs for o in outputs if o.new_token_ids)


def assert_decoded_only(decode: EngineCore, steps_before: int) -> None:
    """Since `steps_before`, the decode core computed no prompt token of the PROMPTS it was
    given: one decode token per output token after the first (12 each)."""
    steps = list(decode.step_stats)[steps_before:]
    assert sum(s.num_prefill_tokens for s in steps) == 0
    assert sum(s.num_decode_tokens for s in steps) == len(PROMPTS) * (12 - 1)


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
        assert_same_tokens(outputs, reference, params)
    assert_decoded_only(decode, steps_before)
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


# -- streamed transfers -----------------------------------------------------------------------

CHUNKED = {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 16, "max_num_seqs": 16}


def stream_params(prefill: EngineCore, transfer_id: str) -> dict:
    """What the router gives a decode leg sent alongside its prefill leg."""
    port = prefill.config.kv_transfer.port
    return {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "transfer_id": transfer_id,
    }


def step_both(prefill: EngineCore, decode: EngineCore, finished: set[str], timeout=60.0) -> dict:
    """Step both cores, as their processes would, until the decode core's requests in
    `finished` have ended; the decode core's outputs by id."""
    outputs: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    pending = set(finished)
    while pending and time.monotonic() < deadline:
        for core in (prefill, decode):
            if core.has_work():
                for output in core.step():
                    if core is decode:
                        outputs.setdefault(output.request_id, []).append(output)
                        if output.finish_reason is not None:
                            pending.discard(output.request_id)
            else:
                core.poll_kv_transfers()
        time.sleep(0.001)
    assert not pending, f"not finished in {timeout} s: {pending}"
    return outputs


@pytest.fixture(scope="module")
def stream_cores(tiny_llama):
    """A prefill core that computes a prompt 16 tokens a step, so a long one takes several."""
    model = tiny_llama[0]
    return make_core(model, "prefill", CHUNKED), make_core(model, "decode"), make_core(model)


@pytest.mark.parametrize("params", SAMPLING, ids=["greedy", "seeded"])
@pytest.mark.parametrize("decode_first", [False, True], ids=["prefill-leg-first", "pull-first"])
def test_streamed_split_equals_one_core(stream_cores, params, decode_first):
    prefill, decode, colocated = stream_cores
    steps_before = len(decode.step_stats)
    one = dataclasses.replace(params, max_tokens=1)
    for index, prompt in enumerate(PROMPTS):
        key = f"{params.seed}-{index}-{decode_first}"
        colocated.add_request(Request(f"c{key}", prompt, params))
        reference = token_ids(drain(colocated, {f"c{key}"})[f"c{key}"])
        legs = [
            (prefill, Request(f"p{key}", prompt, one), {"do_remote_decode": True,
                                                        "transfer_id": key}),
            (decode, Request(f"d{key}", prompt, params), stream_params(prefill, key)),
        ]  # fmt: skip
        for core, request, kv_params in legs[::-1] if decode_first else legs:
            core.add_request(request, kv_params)
        outputs = step_both(prefill, decode, {f"d{key}"})[f"d{key}"]
        assert_same_tokens(outputs, reference, params)
    assert_decoded_only(decode, steps_before)
    sender = prefill.kv_connector.sender
    deadline = time.monotonic() + 5
    while sender.num_held_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.num_held_blocks == 0 and not sender._streams
    assert prefill.kv_cache_manager.num_free_blocks == 64  # nothing held: copied out
    assert decode.kv_cache_manager.num_free_blocks == 64
    assert decode.scheduler_stats().kv_num_load_failed == 0


def test_blocks_arrive_while_the_prompt_is_still_computing(stream_cores):
    """After two of the prompt's five 16-token steps, its first two blocks are in the decode
    core's cache, equal to the prefill core's, while the decode request still waits."""
    prefill, decode, _ = stream_cores
    prompt = list(range(200, 270))  # 70 tokens (five blocks) no core has seen: no cache hits
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    one = dataclasses.replace(params, max_tokens=1)
    decode.add_request(Request("d-early", prompt, params), stream_params(prefill, "early"))
    decode.step()  # admits it and starts the pull
    prefill.add_request(Request("p-early", prompt, one), {"do_remote_decode": True,
                                                          "transfer_id": "early"})  # fmt: skip
    for _ in range(2):
        prefill.step()
    assert prefill.scheduler.requests["p-early"].num_computed_tokens == 32
    source = prefill.kv_cache_manager.get_block_ids("p-early")[:2]
    target = decode.kv_cache_manager.get_block_ids("d-early")[:2]
    src_ids, dst_ids = torch.tensor(source), torch.tensor(target)

    def arrived() -> bool:
        return all(
            torch.equal(p[:, src_ids], d[:, dst_ids])
            for p, d in zip(prefill.runner.kv_caches, decode.runner.kv_caches, strict=True)
        )

    deadline = time.monotonic() + 10
    while not arrived() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert arrived()
    assert decode.scheduler.requests["d-early"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    step_both(prefill, decode, {"d-early"})
    assert decode.kv_cache_manager.num_free_blocks == 64


def test_aborted_prefill_leg_makes_the_decode_core_prefill(stream_cores):
    prefill, decode, colocated = stream_cores
    prompt = list(range(72, 2, -1))  # no core has it cached: the prefill takes five steps
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = one_core_tokens(colocated, "c-cut", prompt, params)
    prefill.add_request(
        Request("p-cut", prompt, dataclasses.replace(params, max_tokens=1)),
        {"do_remote_decode": True, "transfer_id": "cut"},
    )
    decode.add_request(Request("d-cut", prompt, params), stream_params(prefill, "cut"))
    prefill.step()
    prefill.finish_requests(["p-cut"], RequestStatus.FINISHED_ABORTED)
    failed_before = decode.scheduler_stats().kv_num_load_failed
    outputs = step_both(prefill, decode, {"d-cut"})["d-cut"]
    assert token_ids(outputs) == reference
    assert decode.scheduler_stats().kv_num_load_failed == failed_before + 1
    assert prefill.kv_cache_manager.num_free_blocks == 64
    assert decode.kv_cache_manager.num_free_blocks == 64


def test_aborted_decode_leg_ends_the_stream(stream_cores):
    """The decode request goes while its prompt computes: the prefill side drops what it copied
    out and copies no more, and both caches end empty."""
    prefill, decode, _ = stream_cores
    prompt = list(range(190, 120, -1))  # uncached: the prefill goes on after the abort
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    decode.add_request(Request("d-gone", prompt, params), stream_params(prefill, "gone"))
    decode.step()
    prefill.add_request(
        Request("p-gone", prompt, dataclasses.replace(params, max_tokens=1)),
        {"do_remote_decode": True, "transfer_id": "gone"},
    )
    prefill.step()
    decode.finish_requests(["d-gone"], RequestStatus.FINISHED_ABORTED)
    drain(prefill, {"p-gone"})
    sender = prefill.kv_connector.sender
    deadline = time.monotonic() + 10
    while (sender._streams or decode.scheduler.detached) and time.monotonic() < deadline:
        decode.poll_kv_transfers()
        time.sleep(0.01)
    assert not sender._streams and sender.num_held_blocks == 0
    assert prefill.kv_cache_manager.num_free_blocks == 64
    assert decode.kv_cache_manager.num_free_blocks == 64


def test_a_transfer_id_is_used_once(stream_cores):
    prefill, _, _ = stream_cores
    one = SamplingParams(temperature=0.0, max_tokens=1)
    kv_params = {"do_remote_decode": True, "transfer_id": "twice"}
    prefill.add_request(Request("p-once", PROMPTS[0], one), kv_params)
    with pytest.raises(ValueError, match="transfer_id 'twice' is already in use"):
        prefill.add_request(Request("p-twice", PROMPTS[0], one), kv_params)
    drain(prefill, {"p-once"})
    prefill.kv_connector.sender._release([], ["twice"])


def test_a_streamed_prefill_answer_pulled_afterwards(stream_cores):
    """A client that runs the legs one after the other with a transfer id (the prefill leg's
    answer names it): the decode core pulls the finished stream and gives the same tokens."""
    prefill, decode, colocated = stream_cores
    prompt = list(range(250, 209, -1))
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    reference = one_core_tokens(colocated, "c-late", prompt, params)
    prefill.add_request(
        Request("p-late", prompt, dataclasses.replace(params, max_tokens=1)),
        {"do_remote_decode": True, "transfer_id": "late"},
    )
    answer = drain(prefill, {"p-late"})["p-late"][-1].kv_transfer_params
    assert answer["transfer_id"] == "late"
    assert prefill.kv_cache_manager.num_free_blocks == 64  # copied out, nothing held
    decode.add_request(Request("d-late", prompt, params), answer)
    outputs = step_both(prefill, decode, {"d-late"})["d-late"]
    assert token_ids(outputs) == reference
    assert decode.kv_cache_manager.num_free_blocks == 64


def test_a_stream_end_that_does_not_fit_the_request_makes_it_prefill(stream_cores):
    """The decode leg asks for logprobs that the prefill leg did not compute: the stream
    arrives, but its first token cannot be used, so the decode core computes the prompt (one
    failed load) and still answers what one core answers."""
    prefill, decode, colocated = stream_cores
    prompt = list(range(199, 166, -1))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    reference = one_core_tokens(colocated, "c-mis", prompt, params)
    before = decode.scheduler_stats()
    decode.add_request(Request("d-mis", prompt, params), stream_params(prefill, "mis"))
    leg = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill.add_request(Request("p-mis", prompt, leg), {"do_remote_decode": True,
                                                        "transfer_id": "mis"})  # fmt: skip
    outputs = step_both(prefill, decode, {"d-mis"})["d-mis"]
    assert token_ids(outputs) == reference
    after = decode.scheduler_stats()
    assert after.kv_num_load_failed == before.kv_num_load_failed + 1
    assert after.kv_num_loaded == before.kv_num_loaded
    assert decode.kv_cache_manager.num_free_blocks == 64


def test_a_second_pull_of_one_transfer_is_refused(stream_cores):
    """Two decode requests name one transfer: the first gets the stream, the second is refused
    at once and computes its prompt; both answer what one core answers."""
    prefill, decode, colocated = stream_cores
    prompt = list(range(230, 181, -1))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    reference = one_core_tokens(colocated, "c-twice", prompt, params)
    before = decode.scheduler_stats()
    for request_id in ("d-first", "d-second"):
        decode.add_request(Request(request_id, prompt, params), stream_params(prefill, "dup"))
        decode.step()
    prefill.add_request(
        Request("p-dup", prompt, dataclasses.replace(params, max_tokens=1)),
        {"do_remote_decode": True, "transfer_id": "dup"},
    )
    outputs = step_both(prefill, decode, {"d-first", "d-second"})
    assert token_ids(outputs["d-first"]) == token_ids(outputs["d-second"]) == reference
    after = decode.scheduler_stats()
    assert after.kv_num_loaded == before.kv_num_loaded + 1
    assert after.kv_num_load_failed == before.kv_num_load_failed + 1
    assert decode.kv_cache_manager.num_free_blocks == 64


def test_an_ended_transfer_makes_the_waiting_decode_core_prefill_at_once(stream_cores):
    """What the router does when a prefill leg is refused (a 503 from a full prefill
    instance): it ends the transfer on the prefill instance's KV channel, and the decode core
    waiting for it computes the prompt without waiting out its timeout; a prefill leg that
    still comes for it is not copied out."""
    from tandem.router.app import end_transfer

    prefill, decode, colocated = stream_cores
    prompt = list(range(240, 201, -1))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    reference = one_core_tokens(colocated, "c-end", prompt, params)
    before = decode.scheduler_stats()
    started = time.monotonic()
    decode.add_request(Request("d-end", prompt, params), stream_params(prefill, "ended"))
    decode.step()
    end_transfer(("127.0.0.1", prefill.config.kv_transfer.port), "ended")
    outputs = step_both(prefill, decode, {"d-end"})["d-end"]
    assert time.monotonic() - started < 8  # the decode core's transfer timeout is 10 s
    assert token_ids(outputs) == reference
    assert decode.scheduler_stats().kv_num_load_failed == before.kv_num_load_failed + 1
    prefill.add_request(
        Request("p-end", prompt, dataclasses.replace(params, max_tokens=1)),
        {"do_remote_decode": True, "transfer_id": "ended"},
    )
    drain(prefill, {"p-end"})
    sender = prefill.kv_connector.sender
    assert "ended" not in sender._streams and sender.num_held_blocks == 0
    assert prefill.kv_cache_manager.num_free_blocks == 64


def test_streamed_split_with_async_scheduling_on_the_prefill_core(tiny_llama, stream_cores):
    """With async scheduling a step's blocks are copied out when that step lands, while the
    next one is in flight; the decode core still gets exactly the prompt's KV. (The prefill
    core runs its steps to the end before the decode core computes: a step's forward context
    is one per process, and two cores that compute at once in one process would share it.
    The decode core's transfer threads receive meanwhile.)"""
    _, decode, colocated = stream_cores
    prefill = make_core(tiny_llama[0], "prefill", {**CHUNKED, "async_scheduling": True})
    assert prefill.async_scheduling
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = dataclasses.replace(params, max_tokens=1)
    prompts = [list(range(9, 80)), list(range(81, 140)), list(range(141, 160))]
    references = [
        one_core_tokens(colocated, f"c-async{index}", prompt, params)
        for index, prompt in enumerate(prompts)
    ]
    for index, prompt in enumerate(prompts):  # together: steps mix the three prompts
        key = f"async{index}"
        decode.add_request(Request(f"d-{key}", prompt, params), stream_params(prefill, key))
        prefill.add_request(Request(f"p-{key}", prompt, one), {"do_remote_decode": True,
                                                               "transfer_id": key})  # fmt: skip
    failed_before = decode.scheduler_stats().kv_num_load_failed
    decode.step()  # admits them and starts their pulls: nothing to compute yet
    drain(prefill, {f"p-async{i}" for i in range(len(prompts))})
    outputs = drain(decode, {f"d-async{i}" for i in range(len(prompts))})
    for index, reference in enumerate(references):
        assert token_ids(outputs[f"d-async{index}"]) == reference
    assert decode.scheduler_stats().kv_num_load_failed == failed_before
    assert prefill.kv_cache_manager.num_free_blocks == 64
    assert decode.kv_cache_manager.num_free_blocks == 64


def test_pairing_again_ends_the_old_pairs_thread(stream_cores):
    """A decode core whose pair group broke pairs again with a new Hello: the prefill core's
    thread for the old pair ends (it used to wait on its queue for good, with its group)."""
    prefill, decode, colocated = stream_cores
    receiver = decode.kv_connector.receiver
    prefix = f"tandem-kv-send-{receiver.peer_id}/"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def split(key: str, prompt: list[int]) -> None:
        reference = one_core_tokens(colocated, f"c-{key}", prompt, params)
        decode.add_request(Request(f"d-{key}", prompt, params), stream_params(prefill, key))
        prefill.add_request(
            Request(f"p-{key}", prompt, dataclasses.replace(params, max_tokens=1)),
            {"do_remote_decode": True, "transfer_id": key},
        )
        assert token_ids(step_both(prefill, decode, {f"d-{key}"})[f"d-{key}"]) == reference

    def pair_threads() -> set[threading.Thread]:  # every prefill core's, for this decode core
        return {t for t in threading.enumerate() if t.name.startswith(prefix)}

    split("pair", list(range(120, 96, -1)))  # paired now, if no earlier test did
    before = pair_threads()
    peer = receiver._peers[("127.0.0.1", prefill.config.kv_transfer.port)]
    peer.broken_groups.add(peer.group)
    split("again", list(range(96, 72, -1)))
    deadline = time.monotonic() + 5
    while len(pair_threads()) > len(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    after = pair_threads()
    assert len(after - before) == 1 and len(before - after) == 1  # one new, the old one gone
