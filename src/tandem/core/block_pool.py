"""The KV-cache blocks as plain objects: reference counts, an LRU free list, a prefix-hash index.

A block's contents live on the device; here it is an id plus bookkeeping. A block with
ref_cnt == 0 sits in the free queue. If it also has a hash it still holds valid KV for that
prefix, so a later request can take it back out of the queue (a cache hit) until it is reused.

The hash only finds a candidate. A cached block also keeps what its KV depends on, its token ids
and its parent (the cached block before it, or the request's cache salt for a first block), and a
candidate is a hit only if both match: a hash collision, by chance or crafted, costs a miss and
never serves another prefix's KV.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

# What a block's KV depends on besides its own tokens: (None, cache salt) for a request's first
# block, (parent block, parent.generation) for any other. Compared with ==: blocks by identity.
ParentKey = tuple["KVCacheBlock | None", "int | str | None"]


def root_key(cache_salt: str | None) -> ParentKey:
    """Parent key of a request's first block."""
    return (None, cache_salt)


def chain_key(block: KVCacheBlock) -> ParentKey:
    """Parent key of the block after `block`: it names the block's current cached content, so it
    stops matching once that content is evicted, even if the block is cached again later."""
    return (block, block.generation)


def is_stale(parent_key: ParentKey) -> bool:
    """Whether the parent's content has been evicted since: a block keyed on it is unreachable."""
    parent, generation = parent_key
    return parent is not None and parent.generation != generation


# Identity equality: blocks are nodes, two blocks are never "equal". Slots: the step loop
# takes and caches a block for every request that fills one.
@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Hash of the block's tokens chained with its prefix; set once the block is full and computed.
    block_hash: int | None = None
    # What the cached KV was computed from, checked on every hit (None while not cached).
    token_ids: tuple[int, ...] | None = None
    parent_key: ParentKey | None = field(default=None, repr=False)
    # Bumped each time the block's cached content is dropped: a child's parent key goes stale.
    generation: int = 0
    # Free-queue links; both are None while the block is not in the queue.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Allocation takes from the head, freed blocks go to the tail: the head is the least recently
    freed block, the first to evict. A cached block that is hit leaves from the middle in O(1),
    which a deque cannot do. Two sentinel nodes remove every empty-list special case.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._num_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._num_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head to tail (eviction order)."""
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("pop from an empty free block queue")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        if block in self:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._num_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self._num_blocks -= 1


class BlockPool:
    """Owns every block: hands out free ones, takes them back, and indexes full blocks by hash."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self._cached_blocks: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unused ones included."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 to 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, each with ref_cnt 1.

        A reused block's old content is overwritten, so its hash entry is dropped.
        """
        queue = self.free_block_queue
        if num_blocks > len(queue):
            raise RuntimeError(f"cannot allocate {num_blocks} blocks: only {len(queue)} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = queue.popleft()
            if block.block_hash is not None:
                self.evict_cached_block(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go to the tail of the free
        queue in the given order (so pass a request's blocks tail first to evict those first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (a prefix-cache hit), pulling free ones off the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: int,
        token_ids: tuple[int, ...],
        parent_key: ParentKey,
    ) -> KVCacheBlock | None:
        """Index a full, computed block under its hash. Returns the block that holds this content
        in the cache from now on: `block`, or an earlier copy of the same content (then `block`
        stays anonymous), or None when the hash is taken by other content (a collision: `block`
        stays anonymous, and so must every block after it, having no cached parent)."""
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already cached")
        existing = self._cached_blocks.get(block_hash)
        if existing is not None:
            if existing.token_ids == token_ids and existing.parent_key == parent_key:
                return existing
            assert existing.parent_key is not None
            if not is_stale(existing.parent_key):
                return None
            self.evict_cached_block(existing)  # unreachable since its parent went: make room
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_key = parent_key
        self._cached_blocks[block_hash] = block
        return block

    def get_cached_block(
        self, block_hash: int, token_ids: Sequence[int], parent_key: ParentKey
    ) -> KVCacheBlock | None:
        """The cached block for this content, or None. A block found by hash whose tokens or
        parent differ (a collision) is not a hit."""
        block = self._cached_blocks.get(block_hash)
        if block is None or block.parent_key != parent_key or block.token_ids != tuple(token_ids):
            return None
        return block

    def evict_cached_block(self, block: KVCacheBlock) -> None:
        """Forget the block's content (no-op for an anonymous block)."""
        if block.block_hash is not None:
            del self._cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = None
            block.parent_key = None
            block.generation += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False, nothing changed) while any block is held:
        requests still running would keep serving and caching the old prefixes."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in list(self._cached_blocks.values()):
            self.evict_cached_block(block)
        return True
