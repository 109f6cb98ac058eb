"""Prefix caching in the KV cache manager and the scheduler: chained hashes, cache salts, hits
verified against the cached tokens and parent (a hash collision never serves another prefix's
KV), the query/hit counters, LRU eviction, reset, and what a lookup costs."""

from __future__ import annotations

from array import array

import pytest

from tandem.core.kv_cache_manager import (
    BLOCK_HASH_FUNCTIONS,
    KVCacheManager,
    sha256_block_hash,
    token_bytes,
    xxhash_block_hash,
)
from tandem.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tandem.request import Request
from tandem.sampling_params import SamplingParams

from helpers import in_order

HASH_ALGOS = sorted(BLOCK_HASH_FUNCTIONS)


def admit(kv: KVCacheManager, request: Request) -> int:
    """What the scheduler and a step do with a new request: look up its prefix, take the hits,
    compute the rest of its prompt, index its full blocks. Returns the number of hit tokens."""
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hit_blocks) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return num_hit_tokens


def assert_no_leak(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


# -- hashing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hash_fn", "bits"), [(xxhash_block_hash, 128), (sha256_block_hash, 256)], ids=["xx", "sha"]
)
def test_hash_chains_parent_tokens_and_extra_keys(hash_fn, bits: int) -> None:
    base = hash_fn(0, [1, 2], b"")
    assert base == hash_fn(0, (1, 2), b"")  # any sequence of ints, same value
    assert 0 <= base < 2**bits
    others = [hash_fn(base, [1, 2], b""), hash_fn(0, [2, 1], b""), hash_fn(0, [1, 2], b"salt")]
    assert len({base, *others}) == 4
    assert hash_fn(2**bits - 1, [1, 2], b"") >= 0  # any parent of its own width chains


@pytest.mark.parametrize(
    "token_ids", [[], [7], list(range(16)), [2**63 - 1, -(2**63), -1, 0], (5, 6, 7)]
)
def test_token_bytes_are_an_int64_arrays_bytes(token_ids) -> None:
    assert token_bytes(token_ids) == array("q", token_ids).tobytes()


def test_hash_algo_is_chosen_once_and_checked() -> None:
    assert KVCacheManager(4, 4).hash_algo == "xxhash"  # the fast one by default
    assert KVCacheManager(4, 4, hash_algo="sha256").hash_algo == "sha256"
    with pytest.raises(ValueError, match="hash_algo must be one of xxhash, sha256, got 'md5'"):
        KVCacheManager(4, 4, hash_algo="md5")


@pytest.mark.parametrize("hash_algo", HASH_ALGOS)
def test_shared_prefix_hits_with_every_hash_algo(hash_algo: str) -> None:
    kv = KVCacheManager(16, 4, enable_caching=True, hash_algo=hash_algo)
    first = Request("a", [*range(12), 50])
    assert admit(kv, first) == 0
    second = Request("b", [*range(8), 60, 61, 62, 63, 64])
    assert admit(kv, second) == 8
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    hash_fn = BLOCK_HASH_FUNCTIONS[hash_algo]
    first_hash = hash_fn(0, range(4), b"")
    assert kv.block_pool.blocks[kv.get_block_ids("a")[0]].block_hash == first_hash
    kv.free(first)
    kv.free(second)
    assert_no_leak(kv)


# -- cache salt -------------------------------------------------------------------------------


def test_cache_salt_separates_tenants_and_the_same_salt_shares() -> None:
    kv = KVCacheManager(32, 4, enable_caching=True)
    prompt = [*range(12), 99]
    assert admit(kv, Request("a1", prompt, cache_salt="tenant-a")) == 0
    assert admit(kv, Request("b1", prompt, cache_salt="tenant-b")) == 0
    assert admit(kv, Request("none1", prompt)) == 0
    assert admit(kv, Request("a2", prompt, cache_salt="tenant-a")) == 12
    assert admit(kv, Request("b2", prompt, cache_salt="tenant-b")) == 12
    assert admit(kv, Request("none2", prompt)) == 12
    tables = {rid: kv.get_block_ids(rid)[:3] for rid in ("a1", "a2", "b1", "b2", "none1")}
    assert tables["a1"] == tables["a2"] and tables["b1"] == tables["b2"]
    assert not {*tables["a1"]} & {*tables["b1"]} and not {*tables["a1"]} & {*tables["none1"]}


def test_cache_salt_is_a_key_of_the_first_block_and_so_of_the_whole_chain() -> None:
    kv = KVCacheManager(32, 4, enable_caching=True)
    prompt = [*range(12), 99]
    salted, plain = Request("s", prompt, cache_salt="t"), Request("p", prompt)
    admit(kv, salted)
    admit(kv, plain)
    blocks = kv.block_pool.blocks
    salted_hashes = [blocks[i].block_hash for i in kv.get_block_ids("s")[:3]]
    plain_hashes = [blocks[i].block_hash for i in kv.get_block_ids("p")[:3]]
    expected, parent = [], 0
    for index in range(3):
        parent = xxhash_block_hash(parent, prompt[index * 4 : index * 4 + 4], b"t" * (index == 0))
        expected.append(parent)
    assert salted_hashes == expected
    assert all(s != p for s, p in zip(salted_hashes, plain_hashes, strict=True))


@pytest.mark.parametrize("salt", ["", b"bytes", 7])
def test_cache_salt_must_be_a_non_empty_string(salt) -> None:
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        Request("a", [1, 2], cache_salt=salt)


def test_cache_salt_is_optional_and_positional_callers_still_work() -> None:
    request = Request("a", [1, 2], SamplingParams(), 2, 0.0)
    assert request.cache_salt is None and request.arrival_time == 0.0


# -- hit verification: a collision is a miss ---------------------------------------------------


@pytest.fixture
def constant_hash(monkeypatch):
    """Every block of every request hashes the same: each lookup finds a colliding candidate."""
    monkeypatch.setitem(BLOCK_HASH_FUNCTIONS, "xxhash", lambda parent, tokens, extra: 42)


@pytest.fixture
def tokens_only_hash(monkeypatch):
    """The hash ignores the parent and the salt: equal blocks after different prefixes (or at
    other positions, or of other tenants) collide."""

    def tokens_only(parent: int, tokens, extra: bytes) -> int:
        return hash(tuple(tokens))

    monkeypatch.setitem(BLOCK_HASH_FUNCTIONS, "xxhash", tokens_only)


def test_constant_hash_never_reuses_a_wrong_block(constant_hash) -> None:
    kv = KVCacheManager(32, 4, enable_caching=True)
    first = Request("a", [*range(12), 99])
    admit(kv, first)
    assert kv.block_pool.num_cached_blocks == 1  # its later blocks collided: left anonymous
    cached = kv.block_pool.blocks[kv.get_block_ids("a")[0]]
    assert cached.token_ids == (0, 1, 2, 3)
    assert admit(kv, Request("b", [*range(100, 112), 5])) == 0  # other tokens
    # same prompt: its first block is a real hit; its second finds the first block again
    # (same hash) but that one's parent is not itself, so the lookup stops there
    assert admit(kv, Request("c", [*range(12), 99])) == 4
    assert kv.get_block_ids("c")[0] == cached.block_id
    assert len(set(kv.get_block_ids("c"))) == len(kv.get_block_ids("c"))


def test_equal_tokens_after_another_prefix_or_salt_are_no_hit(tokens_only_hash) -> None:
    kv = KVCacheManager(32, 4, enable_caching=True)
    admit(kv, Request("a", [7, 7, 7, 7, 1, 2, 3, 4, 0]))
    assert kv.block_pool.num_cached_blocks == 2
    # [1, 2, 3, 4] is cached, but as a second block after [7, 7, 7, 7]: not a first block...
    assert admit(kv, Request("b", [1, 2, 3, 4, 5])) == 0
    # ...nor a second block after [8, 8, 8, 8] (which is not cached anyway)
    assert admit(kv, Request("c", [8, 8, 8, 8, 1, 2, 3, 4, 0])) == 0
    # and [7, 7, 7, 7] cached without a salt is not a tenant's first block
    assert admit(kv, Request("d", [7, 7, 7, 7, 1, 2, 3, 4, 9], cache_salt="t")) == 0
    assert admit(kv, Request("e", [7, 7, 7, 7, 1, 2, 3, 4, 9])) == 8


class PrefixCheckingModel:
    """A fake model whose KV at a position is the whole context up to it (what real KV depends
    on). Before computing new tokens it reads the context back from the cache, asserts it is
    the request's own, and samples from what it read: a wrong hit fails or changes outputs."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots: dict[int, tuple[int, ...]] = {}

    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:
        size = self.kv.block_size
        sampled = {}
        for s in output.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            context: tuple[int, ...] = ()
            for position in range(end):
                slot = s.block_ids[position // size] * size + position % size
                if position < s.num_computed_tokens:
                    context = self.slots[slot]
                    assert context == tuple(s.token_ids[: position + 1]), "wrong block reused"
                else:
                    context = (*context, s.token_ids[position])
                    self.slots[slot] = context
            if s.sample:
                sampled[s.request_id] = [3 + hash(context) % 5]
        return sampled


def run_workload(kv: KVCacheManager, prompts: list[list[int]], salts=None) -> list[Request]:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64), kv
    )
    model = PrefixCheckingModel(kv)
    salts = salts or [None] * len(prompts)
    requests = [
        Request(f"r{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True), cache_salt=salt)
        for i, (prompt, salt) in enumerate(zip(prompts, salts, strict=True))
    ]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        scheduler.update_from_output(output, in_order(output, model.execute(output)))
    assert not scheduler.has_unfinished_requests()
    assert_no_leak(kv)
    return requests


# Repeated blocks at other positions, after other prefixes, and long shared prefixes.
PATTERN = [1, 2, 3, 4]
WORKLOAD = [
    PATTERN * 4 + [9],
    [5, 5, 5, 5] + PATTERN * 3 + [9],
    PATTERN * 4 + [8, 7],
    PATTERN * 2 + [6, 6, 6, 6] + PATTERN + [9],
    [6, 6, 6, 6] + PATTERN * 2,
    PATTERN * 3 + [5, 5, 5, 5, 2],
    PATTERN * 4 + [9],
    [5, 5, 5, 5] + PATTERN * 3 + [9],
]


@pytest.mark.parametrize(
    ("hashing", "hash_algo"),
    [
        ("real", "xxhash"),
        ("real", "sha256"),
        ("constant_hash", "xxhash"),  # the fixtures replace the default algorithm
        ("tokens_only_hash", "xxhash"),
    ],
)
@pytest.mark.parametrize("num_blocks", [64, 10], ids=["roomy", "evicting"])
def test_outputs_equal_without_caching(request, hashing, hash_algo, num_blocks) -> None:
    if hashing != "real":
        request.getfixturevalue(hashing)
    reference = run_workload(KVCacheManager(64, 4, enable_caching=False), WORKLOAD)
    kv = KVCacheManager(num_blocks, 4, enable_caching=True, hash_algo=hash_algo)
    cached = run_workload(kv, WORKLOAD)
    assert [r.output_token_ids for r in cached] == [r.output_token_ids for r in reference]
    if hashing == "real":
        assert kv.prefix_cache_hits > 0
    if num_blocks == 10:
        assert any(r.num_preemptions for r in cached)
    assert kv.prefix_cache_hits == sum(r.num_cached_tokens for r in cached)


def test_tenants_never_read_each_others_blocks_even_on_collisions(tokens_only_hash) -> None:
    prompts = [PATTERN * 3 + [9]] * 4
    kv = KVCacheManager(64, 4, enable_caching=True)
    # the model asserts that every context it reads back is the request's own
    requests = run_workload(kv, prompts, salts=["a", "b", "a", None])
    assert requests[1].num_cached_tokens == requests[3].num_cached_tokens == 0
    assert kv.prefix_cache_hits == requests[2].num_cached_tokens


# -- keeping the chain when the same prefix is computed twice at once --------------------------


def test_blocks_computed_twice_at_once_still_chain() -> None:
    kv = KVCacheManager(32, 4, enable_caching=True)
    prefix = list(range(8))
    short, long = Request("a", [*prefix, 50]), Request("b", [*prefix, 60, 61, 62, 63, 64])
    for request in (short, long):  # admitted in one step: neither hits
        assert kv.get_computed_blocks(request) == ([], 0)
        kv.allocate_slots(request, request.num_tokens)
    for request in (short, long):
        request.num_computed_tokens = request.num_tokens
        kv.cache_blocks(request)
    # b's first two blocks duplicate a's and stay anonymous; its third chains onto a's second
    assert kv.block_pool.num_cached_blocks == 3
    follower = Request("c", [*prefix, 60, 61, 62, 63, 70])
    assert admit(kv, follower) == 12
    assert kv.get_block_ids("c")[:3] == kv.get_block_ids("a")[:2] + kv.get_block_ids("b")[2:3]


def test_no_block_is_cached_after_an_evicted_parent() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    prefix = list(range(8))
    short, long = Request("a", [*prefix, 50]), Request("b", [*prefix, 60, 61])
    for request in (short, long):
        kv.allocate_slots(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(short)
    kv.cache_blocks(long)  # b's blocks 0-1 are anonymous copies of a's
    kv.free(short)
    kv.allocate_slots(Request("x", list(range(100, 120))), 20)  # evicts a's blocks
    assert kv.block_pool.num_cached_blocks == 0
    long.append_output_token_ids([62, 63])
    kv.allocate_slots(long, 2)
    long.num_computed_tokens += 2
    kv.cache_blocks(long)  # block 2 is full, but its cached parent is gone
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(Request("c", [*prefix, 60, 61, 62, 63, 0])) == ([], 0)


# -- counters ---------------------------------------------------------------------------------


def make_scheduler(num_blocks: int, enable_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_caching)
    config = SchedulerConfig(
        max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64, long_prefill_token_threshold=32
    )
    return Scheduler(config, kv)


def run_steps(scheduler: Scheduler, until=None) -> None:
    for _ in range(500):
        if not scheduler.has_unfinished_requests() or (until is not None and until()):
            return
        output = scheduler.schedule()
        sampled = [7 + len(s.token_ids) % 5 for s in output.scheduled if s.sample]
        scheduler.update_from_output(output, sampled)
    raise AssertionError("did not finish")


def add(scheduler: Scheduler, request_id: str, prompt: list[int], max_tokens: int) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    scheduler.add_request(request)
    return request


def test_counters_count_first_admissions_and_never_a_resume() -> None:
    scheduler = make_scheduler(num_blocks=6)
    kv = scheduler.kv_cache_manager
    first = add(scheduler, "first", list(range(9)), max_tokens=1)
    run_steps(scheduler)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    a = add(scheduler, "a", list(range(9)), max_tokens=6)  # 2 blocks cached
    b = add(scheduler, "b", list(range(50, 59)), max_tokens=6)
    run_steps(scheduler, until=lambda: b.num_preemptions > 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (27, 8)
    run_steps(scheduler)  # b resumes, hitting its own freed blocks: not counted
    assert b.num_preemptions > 0 and b.num_cached_tokens == 0 and a.num_cached_tokens == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (27, 8)
    assert kv.prefix_cache_hits == first.num_cached_tokens + a.num_cached_tokens


def test_counters_stay_zero_with_caching_off() -> None:
    scheduler = make_scheduler(num_blocks=16, enable_caching=False)
    for index in range(3):
        add(scheduler, f"r{index}", list(range(9)), max_tokens=2)
    run_steps(scheduler)
    kv = scheduler.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_lookups_and_refused_admissions_count_nothing() -> None:
    kv = KVCacheManager(4, 4, enable_caching=True)
    admit(kv, Request("a", list(range(9))))
    request = Request("b", list(range(20)))
    for _ in range(3):
        kv.get_computed_blocks(request)  # a request stuck at the head of the queue
    hits, _ = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, 12, hits) is None  # no room
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    assert request.num_cached_tokens == 0


def test_prompt_logprobs_requests_take_no_hits_but_feed_the_cache() -> None:
    """Prompt logprobs need logits at every prompt position, so such a request computes its
    whole prompt (vLLM does the same); it is not counted as a lookup, and its blocks still
    serve later requests."""
    kv = KVCacheManager(16, 4, enable_caching=True)
    prompt = [*range(12), 50]
    admit(kv, Request("a", prompt))
    wants = Request("b", prompt, SamplingParams(prompt_logprobs=0))
    assert admit(kv, wants) == 0
    assert wants.num_cached_tokens == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (13, 0)
    kv.free(Request("a", prompt))
    assert admit(kv, Request("c", prompt)) == 12  # b's blocks (or a's) serve it


# -- LRU eviction and reset -------------------------------------------------------------------


def test_least_recently_used_cached_prefix_is_evicted_first() -> None:
    kv = KVCacheManager(6, 4, enable_caching=True)
    prompt_a, prompt_b = [*range(8), 99], [*range(20, 28), 99]
    for request_id, prompt in (("a", prompt_a), ("b", prompt_b), ("a2", prompt_a)):
        request = Request(request_id, prompt)
        admit(kv, request)
        kv.free(request)  # a2 hit a's blocks: a is now more recent than b
    assert kv.block_pool.num_cached_blocks == 4
    kv.allocate_slots(Request("x", list(range(40, 48))), 8)  # 2 blocks: b's tail goes first
    assert kv.get_computed_blocks(Request("b3", prompt_b))[1] == 4
    assert kv.get_computed_blocks(Request("a3", prompt_a))[1] == 8


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    first = Request("a", [*range(8), 99])
    admit(kv, first)
    assert not kv.reset_prefix_cache()  # a still holds its blocks: refused, nothing dropped
    assert kv.block_pool.num_cached_blocks == 2
    kv.free(first)
    assert kv.reset_prefix_cache()
    assert kv.block_pool.num_cached_blocks == 0
    again = Request("b", [*range(8), 99])
    assert admit(kv, again) == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (18, 0)  # counters are kept
    kv.free(again)
    assert admit(kv, Request("c", [*range(8), 99])) == 8  # caching works after a reset


# -- cost of a lookup -------------------------------------------------------------------------


def test_a_lookup_hashes_each_block_once_and_stops_at_the_first_miss(monkeypatch) -> None:
    calls = []

    def counting_hash(parent, tokens, extra):
        calls.append(tuple(tokens))
        return xxhash_block_hash(parent, tokens, extra)

    monkeypatch.setitem(BLOCK_HASH_FUNCTIONS, "xxhash", counting_hash)
    kv = KVCacheManager(64, 4, enable_caching=True)
    request = Request("a", list(range(64)))
    assert kv.get_computed_blocks(request) == ([], 0)
    assert len(calls) == 1  # empty cache: one block hashed, then the miss ends the lookup
    kv.get_computed_blocks(request)
    assert len(calls) == 1  # cached per request
    kv.allocate_slots(request, 64)
    request.num_computed_tokens = 64
    kv.cache_blocks(request)
    assert len(calls) == 16  # every full block hashed exactly once
    follower = Request("b", [*range(8), *range(100, 156)])
    assert kv.get_computed_blocks(follower)[1] == 8
    assert len(calls) == 16 + 3  # two hits and the miss
