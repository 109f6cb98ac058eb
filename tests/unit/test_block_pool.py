import pytest

from tandem.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


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
    pool.cache_block(block, block_hash=1234)
    pool.free_blocks([block])
    assert pool.get_cached_block(1234) is block
    assert pool.num_free_blocks == 3  # cached but unused: still counts as free
    pool.touch([pool.get_cached_block(1234)])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2


def test_reusing_a_cached_block_drops_its_hash() -> None:
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, block_hash=7)
    pool.free_blocks([block])
    (reused,) = pool.get_new_blocks(1)
    assert reused is block
    assert block.block_hash is None
    assert pool.get_cached_block(7) is None
    assert pool.num_cached_blocks == 0


def test_first_block_with_a_hash_stays_the_cached_copy() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, block_hash=5)
    pool.cache_block(second, block_hash=5)
    assert pool.get_cached_block(5) is first
    assert second.block_hash is None
    pool.cache_block(first, block_hash=6)  # already cached: keeps its hash
    assert first.block_hash == 5
    assert pool.get_cached_block(6) is None


def test_evict_cached_block() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, block_hash=9)
    pool.evict_cached_block(block)
    assert pool.get_cached_block(9) is None
    assert block.block_hash is None
    pool.evict_cached_block(block)  # anonymous: no-op
