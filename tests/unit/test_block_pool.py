import pytest

from tandem.core.block_pool import (
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    chain_key,
    is_stale,
    root_key,
)

ROOT = root_key(None)


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


# -- FreeBlockQueue ---------------------------------------------------------------------------


def test_queue_keeps_insertion_order_and_pops_from_the_head() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 4
    assert ids(queue) == [0, 1, 2, 3]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert ids(queue) == [1, 2, 3, 0]


def test_queue_removes_from_the_middle_and_the_ends() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert len(queue) == 2
    assert blocks[2] not in queue
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[1] in queue


def test_queue_rejects_double_append_and_foreign_remove() -> None:
    block = KVCacheBlock(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(block)
    queue.remove(block)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)


def test_queue_pop_from_empty_raises() -> None:
    queue = FreeBlockQueue([])
    with pytest.raises(IndexError):
        queue.popleft()
    assert list(queue) == []


# -- BlockPool --------------------------------------------------------------------------------


def test_new_pool_is_all_free() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8
    assert pool.usage == 0.0
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0)


def test_get_new_blocks_takes_from_the_head_with_one_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [block.ref_cnt for block in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage == 0.75


def test_get_new_blocks_raises_when_short_and_takes_nothing() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="cannot allocate 3 blocks: only 2 are free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0]])
    pool.free_blocks([blocks[3]])
    assert ids(pool.free_block_queue) == [2, 0, 3]
    assert ids(pool.get_new_blocks(2)) == [2, 0]


def test_ref_counts_never_go_negative() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    with pytest.raises(RuntimeError, match="freed more often than it was taken"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 2


def test_shared_block_is_free_only_after_the_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2


def test_touch_takes_a_free_block_out_of_the_middle_of_the_queue() -> None:
    pool = BlockPool(4)
    middle = pool.blocks[2]
    pool.touch([middle])
    assert middle.ref_cnt == 1
    assert ids(pool.free_block_queue) == [0, 1, 3]
    assert ids(pool.get_new_blocks(3)) == [0, 1, 3]


def test_cached_block_is_found_by_hash_while_free() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_block(block, 1234, (1, 2), ROOT) is block
    assert (block.block_hash, block.token_ids, block.parent_key) == (1234, (1, 2), ROOT)
    pool.free_blocks([block])
    assert pool.get_cached_block(1234, [1, 2], ROOT) is block
    assert pool.num_free_blocks == 3  # cached but unused: still counts as free
    pool.touch([pool.get_cached_block(1234, [1, 2], ROOT)])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2


def test_a_hash_hit_is_verified_against_tokens_and_parent() -> None:
    pool = BlockPool(3)
    parent, block = pool.get_new_blocks(2)
    pool.cache_block(parent, 1, (1, 2), ROOT)
    pool.cache_block(block, 2, (3, 4), chain_key(parent))
    assert pool.get_cached_block(2, [3, 4], chain_key(parent)) is block
    assert pool.get_cached_block(2, [3, 5], chain_key(parent)) is None  # other tokens
    assert pool.get_cached_block(2, [3, 4], ROOT) is None  # same tokens, first block
    assert pool.get_cached_block(2, [3, 4], chain_key(block)) is None  # other parent
    assert pool.get_cached_block(1, [1, 2], root_key("tenant")) is None  # other salt
    assert pool.get_cached_block(3, [3, 4], chain_key(parent)) is None  # unknown hash


def test_reusing_a_cached_block_drops_its_content() -> None:
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 7, (1,), ROOT)
    child_key = chain_key(block)
    pool.free_blocks([block])
    (reused,) = pool.get_new_blocks(1)
    assert reused is block
    assert (block.block_hash, block.token_ids, block.parent_key) == (None, None, None)
    assert pool.get_cached_block(7, [1], ROOT) is None
    assert pool.num_cached_blocks == 0
    # the block's old content is gone: a child keyed on it can never be reached again, even
    # once the block caches the very same content anew
    assert is_stale(child_key)
    pool.cache_block(block, 7, (1,), ROOT)
    assert chain_key(block) != child_key
    assert not is_stale(ROOT)


def test_first_block_with_the_same_content_stays_the_cached_copy() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_block(first, 5, (1,), ROOT) is first
    assert pool.cache_block(second, 5, (1,), ROOT) is first
    assert pool.get_cached_block(5, [1], ROOT) is first
    assert second.block_hash is None
    with pytest.raises(ValueError, match="block 0 is already cached"):
        pool.cache_block(first, 6, (1,), ROOT)


def test_a_colliding_block_stays_anonymous() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, 5, (1,), ROOT)
    assert pool.cache_block(second, 5, (2,), ROOT) is None
    assert second.block_hash is None and second.token_ids is None
    assert pool.get_cached_block(5, [1], ROOT) is first
    assert pool.get_cached_block(5, [2], ROOT) is None


def test_an_entry_whose_parent_was_evicted_gives_way() -> None:
    pool = BlockPool(3)
    parent, child, newcomer = pool.get_new_blocks(3)
    pool.cache_block(parent, 1, (1,), ROOT)
    pool.cache_block(child, 2, (2,), chain_key(parent))
    pool.evict_cached_block(parent)  # child is unreachable now
    pool.cache_block(parent, 1, (1,), ROOT)
    assert pool.cache_block(newcomer, 2, (2,), chain_key(parent)) is newcomer
    assert child.block_hash is None
    assert pool.get_cached_block(2, [2], chain_key(parent)) is newcomer


def test_evict_cached_block() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 9, (1,), ROOT)
    pool.evict_cached_block(block)
    assert pool.get_cached_block(9, [1], ROOT) is None
    assert block.block_hash is None
    assert block.generation == 1
    pool.evict_cached_block(block)  # anonymous: no-op
    assert block.generation == 1


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for index, block in enumerate(blocks):
        pool.cache_block(block, index, (index,), ROOT)
    pool.free_blocks([blocks[1], blocks[3], blocks[0], blocks[2]])
    pool.touch([blocks[3]])  # a hit takes it out of the queue...
    pool.free_blocks([blocks[3]])  # ...and back at the tail: most recently used
    assert ids(pool.get_new_blocks(2)) == [1, 0]
    still_cached = [pool.get_cached_block(i, [i], ROOT) is not None for i in range(4)]
    assert still_cached == [False, False, True, True]
    assert pool.num_cached_blocks == 2


def test_reset_prefix_cache_is_refused_while_a_block_is_held() -> None:
    pool = BlockPool(3)
    held, free = pool.get_new_blocks(2)
    pool.cache_block(held, 1, (1,), ROOT)
    pool.cache_block(free, 2, (2,), ROOT)
    pool.free_blocks([free])
    assert not pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 2
    pool.free_blocks([held])
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert all(block.block_hash is None and block.token_ids is None for block in pool.blocks)
    assert pool.num_free_blocks == 3
    assert pool.reset_prefix_cache()  # nothing cached: still a success
