"""Per-request block tables on top of the BlockPool, and the one place that does block math.

Blocks are allocated as tokens need them, never reserved up to the maximum length, so waste is
at most one partly filled block per request. With prefix caching on, every full block that has
been computed is indexed by a hash chained over all tokens before it; a new request whose
leading blocks hash the same reuses them instead of recomputing them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from tandem.core.block_pool import BlockPool, KVCacheBlock
from tandem.request import Request

_ROOT_HASH = 0  # parent hash of a request's first block


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block, chained over its parent so equal hashes mean equal prefixes.

    SHA-256 rather than Python's 64-bit hash(): a collision would silently serve another
    prompt's KV, and a user could craft one on purpose against the built-in hash.
    """
    payload = parent_hash.to_bytes(32, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.sha256(payload).digest(), "little")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Same tables as ids, grown in step with _req_to_blocks, so a step never rebuilds them.
        self._req_to_block_ids: dict[str, list[int]] = {}
        # Prefix caching: hashes of each request's full blocks, and how many of its blocks are
        # already indexed in the pool.
        self._req_to_block_hashes: dict[str, list[int]] = {}
        self._req_num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def max_num_tokens(self) -> int:
        """Tokens the whole cache can hold: the most one request can ever reach."""
        return self.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table. The live list, not a copy: read it before the next step."""
        return self._req_to_block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as (blocks, number of tokens they hold).

        The last token is never served from the cache: it must be computed to get logits to
        sample from, and a block shared with another request is never written.
        """
        if not self.enable_caching:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in self._block_hashes(request, max_num_blocks)[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        return hit_blocks, len(hit_blocks) * self.block_size

    def can_allocate(
        self, request: Request, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> bool:
        """Whether the request could hold `num_tokens` tokens in total right now (the scheduler's
        admission test: the whole remaining prefill must fit, or the request is not started)."""
        num_missing = self._num_missing_blocks(request.request_id, num_tokens, new_computed_blocks)
        return self._has_room(num_missing, new_computed_blocks)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        """Grow the request's table to cover num_computed_tokens + the tokens of
        `new_computed_blocks` (prefix-cache hits, only when the request holds no blocks yet)
        + `num_new_tokens`. Returns the ids of the newly allocated blocks, or None, having
        allocated nothing, when the pool cannot supply them."""
        request_id = request.request_id
        if new_computed_blocks and self._req_to_blocks.get(request_id):
            raise ValueError(f"request {request_id} already holds blocks; cache hits come first")
        num_tokens = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_new_tokens
        )
        num_missing = self._num_missing_blocks(request_id, num_tokens, new_computed_blocks)
        if not self._has_room(num_missing, new_computed_blocks):
            return None
        blocks = self._req_to_blocks.setdefault(request_id, [])
        block_ids = self._req_to_block_ids.setdefault(request_id, [])
        if new_computed_blocks:
            # Touch before allocating: a hit block in the free queue must not be handed out.
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            block_ids.extend(block.block_id for block in new_computed_blocks)
            self._req_num_cached_blocks[request_id] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_missing)
        blocks.extend(new_blocks)
        new_block_ids = [block.block_id for block in new_blocks]
        block_ids.extend(new_block_ids)
        return new_block_ids

    def cache_blocks(self, request: Request) -> None:
        """Index the request's blocks that are now full and computed, for later requests to hit.
        Called after a step has computed them, so a hit never reads KV still being written."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_full_blocks = request.num_computed_tokens // self.block_size
        num_cached = self._req_num_cached_blocks.get(request_id, 0)
        if num_full_blocks <= num_cached:
            return
        block_hashes = self._block_hashes(request, num_full_blocks)
        blocks = self._req_to_blocks[request_id]
        for index in range(num_cached, num_full_blocks):
            self.block_pool.cache_block(blocks[index], block_hashes[index])
        self._req_num_cached_blocks[request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its last blocks are evicted first (a
        later request sharing the prefix needs the leading ones). Safe to call twice."""
        request_id = request.request_id
        blocks = self._req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self._req_to_block_ids.pop(request_id, None)
        self._req_to_block_hashes.pop(request_id, None)
        self._req_num_cached_blocks.pop(request_id, None)

    def _num_missing_blocks(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        num_held = len(self._req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        return max(0, self.blocks_needed(num_tokens) - num_held)

    def _has_room(self, num_missing: int, new_computed_blocks: Sequence[KVCacheBlock]) -> bool:
        # Hit blocks nobody holds are counted as free, but touching them takes them out.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return num_missing <= self.num_free_blocks - num_free_hits

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Hashes of the request's first `num_blocks` full blocks, computed once per block."""
        block_hashes = self._req_to_block_hashes.setdefault(request.request_id, [])
        token_ids = request.all_token_ids
        size = self.block_size
        for index in range(len(block_hashes), num_blocks):
            parent_hash = block_hashes[-1] if block_hashes else _ROOT_HASH
            block_tokens = token_ids[index * size : (index + 1) * size]
            block_hashes.append(hash_block_tokens(parent_hash, block_tokens))
        return block_hashes
