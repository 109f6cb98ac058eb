"""Disaggregation in the torch-free scheduler: a decode instance's request that arrives with its
prompt computed elsewhere (`Request.remote_prefill`) and a prefill instance's request that keeps
its prompt's blocks (`Request.hold_kv`). What must hold: the pull covers exactly the blocks the
local prefix cache lacks, a receiving request computes nothing until its KV is there, then
decodes without a prefill token (or prefills locally if the pull failed), and no block is ever
freed while a transfer may still read or write it, nor kept once nothing does."""

from __future__ import annotations

import pytest

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.params import (
    KVLoad,
    RemotePrefill,
    RemoteStream,
    check_kv_transfer,
    prompt_digest,
)
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams

EOS = 2
BLOCK_SIZE = 4
NUM_BLOCKS = 64
FIRST_TOKEN = 777  # the token the (imaginary) prefill instance sampled
POLICIES = ("decode-first", "prefill-first")


def model_token(token_ids: list[int]) -> int:
    """A stand-in model: the next token depends on the whole context only."""
    return 1000 + (sum(token_ids) * 31 + len(token_ids)) % 997


def make_scheduler(batching_policy: str = "decode-first", **config: object) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 32)
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_model_len", 256)
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
    return Scheduler(SchedulerConfig(batching_policy=batching_policy, **config), kv)


def prompt_of(length: int, start: int = 10) -> list[int]:
    return list(range(start, start + length))


def remote_prefill(prompt: list[int], first_token: int = FIRST_TOKEN) -> RemotePrefill:
    """What a prefill instance would answer for `prompt` (its block ids are arbitrary here)."""
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    return RemotePrefill(
        remote_engine_id="prefill-engine",
        remote_host="127.0.0.1",
        remote_port=14579,
        remote_request_id="remote-" + str(len(prompt)),
        remote_block_ids=list(range(100, 100 + num_blocks)),
        block_size=BLOCK_SIZE,
        num_prompt_tokens=len(prompt),
        prompt_digest=prompt_digest(prompt),
        first_token_id=first_token,
        num_cached_tokens=0,
    )


def add_remote(
    scheduler: Scheduler,
    request_id: str,
    prompt: list[int],
    first_token: int = FIRST_TOKEN,
    **params: object,
) -> Request:
    """Queue a request as EngineCore.add_request does on a decode instance: the first token is
    already an output token, and the request knows where its prompt's KV waits."""
    params.setdefault("max_tokens", 4)
    request = Request(request_id, prompt, SamplingParams(**params), eos_token_id=EOS)
    remote = remote_prefill(prompt, first_token)
    request.append_output_token_ids([remote.first_token_id])
    request.remote_prefill = remote
    scheduler.add_request(request)
    return request


def add_local(
    scheduler: Scheduler, request_id: str, prompt: list[int], **params: object
) -> Request:
    params.setdefault("max_tokens", 4)
    request = Request(request_id, prompt, SamplingParams(**params), eos_token_id=EOS)
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = [model_token(s.token_ids) for s in output.scheduled if s.sample]
    scheduler.update_from_output(output, sampled)
    return output


def plan(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in output.scheduled]


def run_to_completion(scheduler: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_schedulable_requests():
        outputs.append(step(scheduler))
        assert len(outputs) < max_steps, "the scheduler did not finish"
    return outputs


def assert_all_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert not scheduler.requests and not scheduler.receiving and not scheduler.detached
    assert kv.num_free_blocks == kv.num_blocks


def cached_prefix_blocks(scheduler: Scheduler, prompt: list[int]) -> list[int]:
    """Block ids a new request with `prompt` (plus one token, so every full prompt block may
    hit) would find in the prefix cache."""
    kv = scheduler.kv_cache_manager
    probe = Request("probe", [*prompt, 1], SamplingParams(max_tokens=1), eos_token_id=EOS)
    blocks, _ = kv.get_computed_blocks(probe)
    kv.free(probe)  # drops the probe's hashes; it holds no block
    return [block.block_id for block in blocks]


def warm_prefix(scheduler: Scheduler, prompt: list[int]) -> list[int]:
    """Run a local request over `prompt` to completion so its full blocks are cached; their ids."""
    add_local(scheduler, "warm", prompt, max_tokens=1)
    run_to_completion(scheduler)
    assert_all_free(scheduler)
    return cached_prefix_blocks(scheduler, prompt)


# -- admission: the pull ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("prompt_len", "warm_len", "num_hit_blocks"),
    [
        (12, 0, 0),  # nothing cached: every prompt block is pulled
        (10, 0, 0),  # a partial last prompt block is pulled too
        (14, 8, 2),  # two leading blocks are local hits: pulled from block 2 on
        (12, 13, 3),  # the whole prompt is cached here: nothing to pull
    ],
)
def test_remote_request_pulls_exactly_the_blocks_its_prefix_cache_lacks(
    policy: str, prompt_len: int, warm_len: int, num_hit_blocks: int
) -> None:
    """The KVLoad starts after the local hits and ends at the last prompt block: blocks already
    here are not transferred again, and the first token's block is not the prompt's KV."""
    scheduler = make_scheduler(policy)
    prompt = prompt_of(prompt_len)
    hit_ids = warm_prefix(scheduler, prompt_of(warm_len)) if warm_len else []
    assert len(hit_ids) == num_hit_blocks
    request = add_remote(scheduler, "r", prompt)

    output = scheduler.schedule()

    assert output.scheduled == [] and output.total_num_scheduled_tokens == 0
    assert scheduler.receiving == {"r": request}
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert request.num_computed_tokens == num_hit_blocks * BLOCK_SIZE
    kv = scheduler.kv_cache_manager
    table = kv.get_block_ids("r")
    # Blocks for the whole prompt and the first token, the hits shared with the warm request.
    assert len(table) == kv.blocks_needed(prompt_len + 1)
    assert table[:num_hit_blocks] == hit_ids
    num_prompt_blocks = kv.blocks_needed(prompt_len)
    assert output.kv_loads == [
        KVLoad(
            "r",
            request.remote_prefill,
            num_hit_blocks,
            table[num_hit_blocks:num_prompt_blocks],
            request.prompt_token_ids,
        )
    ]
    assert kv.num_free_blocks == NUM_BLOCKS - len(table)
    assert scheduler.num_waiting == 0 and scheduler.num_running == 0
    assert scheduler.has_unfinished_requests() and not scheduler.has_schedulable_requests()


@pytest.mark.parametrize("policy", POLICIES)
def test_receiving_request_takes_no_budget_and_is_not_scheduled(policy: str) -> None:
    """A request waiting for its KV computes nothing: a local prompt admitted in the same step
    gets the whole budget, and later steps neither schedule it nor pull it again."""
    scheduler = make_scheduler(
        policy, max_num_batched_tokens=8, long_prefill_token_threshold=8, max_num_seqs=4
    )
    add_remote(scheduler, "r", prompt_of(30))
    add_local(scheduler, "l", prompt_of(8, start=500), max_tokens=3)

    first = step(scheduler)
    assert [load.request_id for load in first.kv_loads] == ["r"]
    assert plan(first) == [("l", 8)]
    assert first.total_num_scheduled_tokens == 8
    for _ in range(2):  # "l" decodes its last tokens; "r" still waits
        output = step(scheduler)
        assert plan(output) == [("l", 1)] and output.kv_loads == []
    assert list(scheduler.requests) == ["r"]
    assert scheduler.schedule().scheduled == []
    assert "r" in scheduler.receiving


# -- the pull's outcome ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("warm_len", [0, 8])
def test_arrived_kv_decodes_with_zero_prefill_tokens(policy: str, warm_len: int) -> None:
    """finish_kv_load(ok=True): the next step gives the request one decode token at the first
    token's position, and its prompt blocks are in the prefix cache for later requests."""
    scheduler = make_scheduler(policy)
    prompt = prompt_of(14)
    if warm_len:
        warm_prefix(scheduler, prompt_of(warm_len))
    request = add_remote(scheduler, "r", prompt, max_tokens=3)
    scheduler.schedule()
    table = list(scheduler.kv_cache_manager.get_block_ids("r"))

    assert scheduler.finish_kv_load("r", True) is request
    assert request.status is RequestStatus.RUNNING and request.remote_prefill is None
    assert scheduler.receiving == {} and scheduler.running == [request]
    assert request.num_computed_tokens == len(prompt)
    assert request.num_cached_tokens == 0  # the prefill instance's hits: none here
    # Every full prompt block is now a prefix-cache hit (14 tokens: 3 full blocks).
    assert cached_prefix_blocks(scheduler, prompt) == table[: len(prompt) // BLOCK_SIZE]

    output = step(scheduler)
    assert plan(output) == [("r", 1)]
    assert (output.num_prefill_tokens, output.num_decode_tokens) == (0, 1)
    scheduled = output.scheduled[0]
    assert scheduled.sample and scheduled.num_computed_tokens == len(prompt)
    assert request.output_token_ids[0] == FIRST_TOKEN
    rest = run_to_completion(scheduler)
    assert all(o.num_prefill_tokens == 0 for o in rest)
    assert request.num_output_tokens == 3
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert_all_free(scheduler)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("warm_len", [0, 8])
def test_failed_pull_prefills_locally_from_the_local_hits(policy: str, warm_len: int) -> None:
    """finish_kv_load(ok=False): the request computes its prompt (and its first token's KV)
    here, from its local prefix-cache hits on, and samples its second token at the end."""
    scheduler = make_scheduler(policy)
    prompt = prompt_of(14)
    if warm_len:
        warm_prefix(scheduler, prompt_of(warm_len))
    request = add_remote(scheduler, "r", prompt, max_tokens=3)
    scheduler.schedule()

    assert scheduler.finish_kv_load("r", False) is request
    assert request.status is RequestStatus.RUNNING and request.remote_prefill is None
    assert request.num_computed_tokens == warm_len

    output = step(scheduler)
    num_new = len(prompt) + 1 - warm_len
    assert plan(output) == [("r", num_new)]
    assert (output.num_prefill_tokens, output.num_decode_tokens) == (num_new, 0)
    assert output.scheduled[0].num_computed_tokens == warm_len
    assert output.scheduled[0].sample
    assert request.output_token_ids[0] == FIRST_TOKEN
    assert request.num_output_tokens == 2
    run_to_completion(scheduler)
    assert request.num_output_tokens == 3
    assert_all_free(scheduler)


def test_arrived_kv_gives_the_same_tokens_as_a_local_request() -> None:
    """Decoding after a pull continues the same sequence a co-located request produces (the
    stand-in model reads the token ids the scheduler hands it)."""
    prompt = prompt_of(13)
    local = make_scheduler()
    reference = add_local(local, "l", prompt, max_tokens=5)
    run_to_completion(local)
    first = reference.output_token_ids[0]

    scheduler = make_scheduler()
    request = add_remote(scheduler, "r", prompt, first_token=first, max_tokens=5)
    scheduler.schedule()
    scheduler.finish_kv_load("r", True)
    run_to_completion(scheduler)
    assert request.output_token_ids == reference.output_token_ids
    assert_all_free(scheduler)


# -- aborts and seats ------------------------------------------------------------------------


@pytest.mark.parametrize("ok", [True, False])
def test_abort_while_receiving_holds_blocks_until_the_load_ends(ok: bool) -> None:
    """A transfer may still write the blocks of a request aborted while receiving: they stay
    held (in `detached`) until finish_kv_load reports the load over, then all are free."""
    scheduler = make_scheduler()
    warm_prefix(scheduler, prompt_of(8))
    add_remote(scheduler, "r", prompt_of(14))
    scheduler.schedule()
    kv = scheduler.kv_cache_manager
    table = list(kv.get_block_ids("r"))

    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert scheduler.requests == {} and scheduler.receiving == {}
    assert [block.block_id for block in scheduler.detached["r"]] == table
    assert kv.num_free_blocks == NUM_BLOCKS - len(table)
    assert not scheduler.has_unfinished_requests()
    assert "r" in scheduler.schedule().finished_request_ids

    assert scheduler.finish_kv_load("r", ok) is None
    assert_all_free(scheduler)
    assert scheduler.schedule().scheduled == []


def test_seats_count_receiving_requests() -> None:
    """max_num_seqs covers requests waiting for their KV: they hold blocks and will decode."""
    scheduler = make_scheduler(max_num_seqs=2)
    add_remote(scheduler, "r1", prompt_of(6, start=100))
    add_remote(scheduler, "r2", prompt_of(6, start=200))
    add_local(scheduler, "l", prompt_of(6, start=300))

    first = scheduler.schedule()
    assert [load.request_id for load in first.kv_loads] == ["r1", "r2"]
    assert first.scheduled == []
    assert scheduler.num_seated == 2 and scheduler.num_waiting == 1
    assert scheduler.kv_cache_manager.get_block_ids("l") == []

    scheduler.finish_kv_load("r1", True)
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    output = step(scheduler)
    assert plan(output) == [("l", 6)]
    assert scheduler.num_seated == 2
    scheduler.finish_kv_load("r2", True)
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_remote_request_waits_for_blocks_like_any_admission() -> None:
    """A request whose prompt and first token do not fit in the free blocks is not admitted
    (no pull starts) until blocks free up."""
    scheduler = make_scheduler(
        max_num_batched_tokens=256, long_prefill_token_threshold=256, max_model_len=256
    )
    hog = add_local(scheduler, "hog", prompt_of(NUM_BLOCKS * BLOCK_SIZE - 8), max_tokens=1)
    remote = add_remote(scheduler, "r", prompt_of(20, start=900))
    output = step(scheduler)
    assert plan(output) == [("hog", NUM_BLOCKS * BLOCK_SIZE - 8)]
    assert output.kv_loads == []
    assert hog.is_finished and remote.status is RequestStatus.WAITING
    output = scheduler.schedule()
    assert [load.request_id for load in output.kv_loads] == ["r"]
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_kv_load("r", False)
    assert_all_free(scheduler)


def test_stop_status_sees_the_first_token() -> None:
    """A decode instance ends a request at its first token (EOS, a stop token, max_tokens 1)
    before scheduling anything."""
    scheduler = make_scheduler()
    cases = [
        (EOS, {}, RequestStatus.FINISHED_STOPPED),
        (EOS, {"ignore_eos": True}, None),
        (EOS, {"min_tokens": 2}, None),
        (55, {"stop_token_ids": [55]}, RequestStatus.FINISHED_STOPPED),
        (55, {"max_tokens": 1}, RequestStatus.FINISHED_LENGTH),
        (55, {}, None),
    ]
    for token, params, expected in cases:
        params.setdefault("max_tokens", 4)
        request = Request("x", prompt_of(5), SamplingParams(**params), eos_token_id=EOS)
        request.append_output_token_ids([token])
        assert scheduler.stop_status(request) is expected, (token, params)


# -- the prefill side: hold_kv ---------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_finished_hold_kv_request_keeps_its_blocks_until_released(policy: str) -> None:
    """A prefill instance's request keeps its prompt blocks (cached, not free) after it finishes
    at its first token, until release_detached; other requests still hit them meanwhile."""
    scheduler = make_scheduler(policy)
    prompt = prompt_of(14)
    request = add_local(scheduler, "p", prompt, max_tokens=1)
    request.hold_kv = True
    output = scheduler.schedule()
    table = list(output.scheduled[0].block_ids)
    scheduler.update_from_output(output, [[model_token(prompt)]])

    assert request.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.requests == {} and scheduler.running == []
    kv = scheduler.kv_cache_manager
    assert len(table) == kv.blocks_needed(len(prompt))
    assert [block.block_id for block in scheduler.detached["p"]] == table
    assert kv.num_free_blocks == NUM_BLOCKS - len(table)
    assert kv.get_block_ids("p") == []
    assert cached_prefix_blocks(scheduler, prompt) == table[: len(prompt) // BLOCK_SIZE]

    # A second request sharing the prompt runs and finishes while the first one's blocks wait.
    add_local(scheduler, "q", prompt, max_tokens=2)
    run_to_completion(scheduler)
    assert kv.num_free_blocks == NUM_BLOCKS - len(table)

    scheduler.release_detached("p")
    assert_all_free(scheduler)
    scheduler.release_detached("p")  # twice (a late Release message): nothing happens
    assert_all_free(scheduler)


@pytest.mark.parametrize("running", [False, True])
def test_aborted_hold_kv_request_frees_at_once(running: bool) -> None:
    """Nobody will pull an aborted request's KV: its blocks go back to the pool at once."""
    scheduler = make_scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=8)
    request = add_local(scheduler, "p", prompt_of(20), max_tokens=1)
    request.hold_kv = True
    if running:
        step(scheduler)  # a first chunk: it holds blocks
        assert scheduler.kv_cache_manager.get_block_ids("p")
    scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert_all_free(scheduler)


def test_hold_kv_request_stopped_by_eos_keeps_its_blocks() -> None:
    """Any finish but an abort keeps the blocks: a first token that is EOS still gets its
    kv_transfer_params (the decode side then releases them)."""
    scheduler = make_scheduler()
    prompt = prompt_of(9)
    request = add_local(scheduler, "p", prompt, max_tokens=1)
    request.hold_kv = True
    output = scheduler.schedule()
    scheduler.update_from_output(output, [[EOS]])
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert len(scheduler.detached["p"]) == scheduler.kv_cache_manager.blocks_needed(len(prompt))
    scheduler.release_detached("p")
    assert_all_free(scheduler)


# -- kv_transfer_params and the config -------------------------------------------------------


def test_remote_prefill_round_trips_through_a_dict() -> None:
    remote = remote_prefill(prompt_of(9))
    params = remote.to_dict()
    assert params["do_remote_prefill"] is True
    assert RemotePrefill.from_dict(params) == remote
    assert RemotePrefill.from_dict({**params, "first_logprobs": [[5, -0.5, 1]]}).first_logprobs == [
        [5, -0.5, 1]
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"remote_host": ...}, "lacks remote_host"),
        ({"remote_block_ids": ..., "first_token_id": ...}, "lacks remote_block_ids, first_tok"),
        ({"extra": 1}, "unknown keys: extra"),
        ({"remote_port": "14579"}, "remote_port must be a int"),
        ({"remote_port": True}, "remote_port must be a int"),
        ({"first_token_id": 3.0}, "first_token_id must be a int"),
        ({"prompt_digest": 7}, "prompt_digest must be a str"),
        ({"num_cached_tokens": None}, "num_cached_tokens must be a int"),
        ({"remote_block_ids": "0,1"}, "remote_block_ids must be a list of block ids"),
        ({"remote_block_ids": [0, -1, 2]}, "remote_block_ids must be a list of block ids"),
        ({"remote_block_ids": [0, True, 2]}, "remote_block_ids must be a list of block ids"),
    ],
)
def test_remote_prefill_from_dict_names_what_is_wrong(change: dict, message: str) -> None:
    params = remote_prefill(prompt_of(9)).to_dict()
    for key, value in change.items():
        if value is ...:
            del params[key]
        else:
            params[key] = value
    with pytest.raises(ValueError, match=message):
        RemotePrefill.from_dict(params)


def test_optional_remote_prefill_fields_have_defaults() -> None:
    params = remote_prefill(prompt_of(9)).to_dict()
    for optional in ("first_logprobs", "generator_state", "num_cached_tokens", "do_remote_prefill"):
        del params[optional]
    remote = RemotePrefill.from_dict(params)
    assert remote.first_logprobs is None and remote.generator_state is None
    assert remote.num_cached_tokens == 0 and remote.do_remote_prefill is True


STREAM = {"do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_port": 14579,
          "transfer_id": "t1"}  # fmt: skip


def check(params: dict, role: str, max_tokens: int = 8, **sampling: object) -> object:
    sampling_params = SamplingParams(max_tokens=max_tokens, **sampling)
    return check_kv_transfer(params, role, prompt_of(9), sampling_params, BLOCK_SIZE, 4096)


def test_a_decode_leg_cannot_ask_for_prompt_logprobs() -> None:
    streamed = {**remote_prefill(prompt_of(9)).to_dict(), "transfer_id": "t1"}
    for params in (STREAM, streamed, remote_prefill(prompt_of(9)).to_dict()):
        with pytest.raises(ValueError, match="prompt_logprobs need the prompt computed here"):
            check(params, "decode", prompt_logprobs=1)


def test_a_decode_leg_without_a_first_token_is_a_stream() -> None:
    assert check(STREAM, "decode") == RemoteStream("10.0.0.7", 14579, "t1")
    # The answer of a prefill leg that streamed: pulled by its transfer id.
    streamed = {**remote_prefill(prompt_of(9)).to_dict(), "transfer_id": "t1"}
    assert check(streamed, "decode").transfer_id == "t1"
    assert check({"do_remote_decode": True, "transfer_id": "t1"}, "prefill", 1) is None


@pytest.mark.parametrize(
    ("params", "role", "message"),
    [
        ({**STREAM, "remote_block_ids": [1]}, "decode", "unknown keys: remote_block_ids"),
        ({**STREAM, "transfer_id": ""}, "decode", "transfer_id must be a string of 1 to 256"),
        ({**STREAM, "transfer_id": 5}, "decode", "transfer_id must be a string"),
        ({**STREAM, "remote_port": 0}, "decode", "remote_port must be a port number"),
        ({**STREAM, "remote_host": None}, "decode", "remote_host must be the prefill"),
        (STREAM, "prefill", "asks for a decode instance"),
        ({"do_remote_decode": True, "transfer_id": ["x"]}, "prefill", "transfer_id must be"),
    ],
)
def test_stream_params_name_what_is_wrong(params: dict, role: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check(params, role, 1 if role == "prefill" else 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"role": "both"}, "prefill or decode, got 'both'"),
        ({"role": "router"}, "prefill or decode"),
        ({"role": "prefill", "port": 0}, "kv port must be in 1..65534"),
        ({"role": "prefill", "port": 65535}, r"port \+ 1 is used too"),
        ({"role": "decode", "timeout": 0}, "must be positive"),
        ({"role": "decode", "hold_seconds": -1}, "must be positive"),
        ({"role": "decode", "chunk_bytes": 0}, "must be positive"),
    ],
)
def test_kv_transfer_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig(**kwargs)


def test_kv_transfer_config_accepts_the_edges() -> None:
    config = KVTransferConfig("prefill", port=65534, timeout=0.1, hold_seconds=0.1, chunk_bytes=1)
    assert (config.role, config.host, config.port) == ("prefill", "127.0.0.1", 65534)
    assert KVTransferConfig("decode").port == 14579
