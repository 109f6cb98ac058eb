import pytest

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.request import Request


def make_request(request_id: str, num_tokens: int, first_token: int = 0) -> Request:
    return Request(request_id, list(range(first_token, first_token + num_tokens)))


def compute(kv: KVCacheManager, request: Request, num_new_tokens: int) -> None:
    """What the scheduler does around a step: allocate, compute, index full blocks."""
    assert kv.allocate_slots(request, num_new_tokens) is not None
    request.num_computed_tokens += num_new_tokens
    kv.cache_blocks(request)


def assert_no_leak(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


def test_blocks_needed_is_ceil_division() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert [kv.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert kv.max_num_tokens == 64


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        KVCacheManager(num_blocks=0, block_size=16)


def test_allocates_only_the_missing_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", 10)
    assert kv.allocate_slots(request, 6) == [0, 1]
    request.num_computed_tokens = 6
    assert kv.allocate_slots(request, 2) == []  # tokens 6..7 fit in block 1
    request.num_computed_tokens = 8
    assert kv.allocate_slots(request, 2) == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)


def test_block_table_is_a_live_list() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    request = make_request("a", 3)
    kv.allocate_slots(request, 2)
    table = kv.get_block_ids("a")
    request.num_computed_tokens = 2
    kv.allocate_slots(request, 1)
    assert table == [0, 1]
    assert kv.get_block_ids("unknown") == []


def test_allocation_failure_allocates_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    first, second = make_request("a", 8), make_request("b", 8)
    assert kv.allocate_slots(first, 8) is not None
    assert kv.allocate_slots(second, 8) is None
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 1


def test_free_returns_every_block_tail_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", 12)
    kv.allocate_slots(request, 12)
    kv.free(request)
    assert_no_leak(kv)
    # tail block first in the free queue: evicted before the prefix blocks
    assert [block.block_id for block in kv.block_pool.free_block_queue] == [3, 2, 1, 0]
    kv.free(request)  # second free is a no-op
    assert_no_leak(kv)


def test_can_allocate_checks_the_whole_length() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    holder = make_request("holder", 8)
    kv.allocate_slots(holder, 8)
    request = make_request("b", 9)
    assert kv.can_allocate(request, 8)
    assert not kv.can_allocate(request, 9)


def test_caching_off_finds_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    first = make_request("a", 12)
    compute(kv, first, 12)
    assert kv.get_computed_blocks(make_request("b", 12)) == ([], 0)
    assert kv.block_pool.num_cached_blocks == 0


def test_hit_on_a_shared_prefix_reuses_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    first = make_request("a", 10)
    compute(kv, first, 10)  # blocks 0, 1 full; block 2 partial
    assert kv.block_pool.num_cached_blocks == 2
    second = Request("b", [*range(8), 99, 98, 97])
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(second)
    assert [block.block_id for block in hit_blocks] == kv.get_block_ids("a")[:2]
    assert num_hit_tokens == 8
    assert kv.allocate_slots(second, 3, hit_blocks) == [3]
    assert [block.ref_cnt for block in hit_blocks] == [2, 2]
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    kv.free(first)
    kv.free(second)
    assert_no_leak(kv)


def test_last_token_is_never_a_hit() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    compute(kv, make_request("a", 8), 8)
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(make_request("b", 8))
    assert num_hit_tokens == 4  # the second block holds the last token: recomputed
    assert len(hit_blocks) == 1


def test_same_block_tokens_after_a_different_prefix_miss() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    compute(kv, Request("a", [1, 2, 3, 4, 5]), 5)
    assert kv.get_computed_blocks(Request("b", [9, 9, 3, 4, 5])) == ([], 0)


def test_freed_cached_blocks_stay_findable_until_reused() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=True)
    first = make_request("a", 9)
    compute(kv, first, 9)
    kv.free(first)
    assert_no_leak(kv)
    second = make_request("b", 9)
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 8
    # all three blocks are free, but two of them are the hits: one is left to allocate
    assert kv.can_allocate(second, 12, hit_blocks)
    assert not kv.can_allocate(second, 13, hit_blocks)
    assert kv.allocate_slots(second, 1, hit_blocks) is not None
    kv.free(second)
    # an unrelated request needing every block evicts the cached ones
    third = make_request("c", 12, first_token=50)
    assert kv.allocate_slots(third, 12) is not None
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("d", 9)) == ([], 0)


def test_cache_hits_only_before_any_own_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    compute(kv, make_request("a", 9), 9)
    second = make_request("b", 9)
    hit_blocks, _ = kv.get_computed_blocks(second)
    kv.allocate_slots(second, 1)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.allocate_slots(second, 1, hit_blocks)


def test_decode_blocks_are_cached_as_they_fill() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    request = make_request("a", 3)
    compute(kv, request, 3)
    assert kv.block_pool.num_cached_blocks == 0
    request.append_output_token_ids([100])
    compute(kv, request, 1)
    assert kv.block_pool.num_cached_blocks == 1
    follower = Request("b", [0, 1, 2, 100, 7])
    assert kv.get_computed_blocks(follower)[1] == 4


def test_a_decode_grows_its_table_in_place_and_takes_nothing_when_no_block_is_free() -> None:
    """What the scheduler's decode pass relies on when a block fills: one more block, appended
    to the same list (the runner's block tables take a list they have seen to have only grown);
    with none free, nothing taken."""
    kv = KVCacheManager(num_blocks=3, block_size=4)
    compute(kv, make_request("a", 8), 8)  # two full blocks; the next token needs a third
    table = kv.get_block_ids("a")
    request = make_request("a", 9)
    request.num_computed_tokens = 8
    assert kv.allocate_slots(request, 1) == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.get_block_ids("a") is table  # grown in place: the same list
    assert kv.num_free_blocks == 0
    request = make_request("a", 13)
    request.num_computed_tokens = 12
    assert kv.allocate_slots(request, 1) is None
    assert kv.get_block_ids("a") == [0, 1, 2]


def test_a_decode_reuses_a_cached_free_block_and_drops_its_hash() -> None:
    """With prefix caching, the pool's next free block may still be indexed: a decode taking
    it must drop its hash, and the block ids must mirror the blocks."""
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=True)
    gone = make_request("gone", 8, first_token=100)
    compute(kv, gone, 8)  # two full, cached blocks
    kv.free(gone)  # free, still cached: the pool hands them out again
    compute(kv, make_request("a", 4), 4)  # one full block
    num_cached = kv.block_pool.num_cached_blocks
    request = make_request("a", 5)
    request.num_computed_tokens = 4
    assert kv.allocate_slots(request, 1) is not None
    assert [block.block_id for block in kv.held_blocks["a"]] == kv.get_block_ids("a")
    assert len(kv.get_block_ids("a")) == 2
    assert kv.block_pool.num_cached_blocks == num_cached - 1
