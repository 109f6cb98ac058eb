"""Per-request block tables on top of the BlockPool, and the one place that does block math.

Blocks are allocated as tokens need them, never reserved up to the maximum length, so waste is
at most one partly filled block per request. With prefix caching on, every full block that has
been computed is indexed by a hash chained over all tokens before it; a new request whose
leading blocks hash the same reuses them instead of recomputing them.

The hash only indexes: a hit is also checked against the tokens and parent the block was
computed from (see block_pool), so the default hash is a fast one (xxh3, 128 bits) rather than a
cryptographic one; sha256 stays as an option.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence

try:  # a declared dependency, but the engine core must import where only torch is installed
    import xxhash
except ImportError:  # pragma: no cover - exercised on bare GPU machines
    xxhash = None

from tandem.core.block_pool import (
    BlockPool,
    KVCacheBlock,
    ParentKey,
    chain_key,
    is_stale,
    root_key,
)
from tandem.request import Request

_ROOT_HASH = 0  # parent hash of a request's first block

# (parent hash, the block's token ids, extra keys) -> the block's hash
BlockHashFunction = Callable[[int, Sequence[int], bytes], int]


# Token-id packers by block length, made once each.
_PACKERS: dict[int, struct.Struct] = {}


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The ids as native int64s (the bytes of array("q", ...)), by a packer made once per
    length: twice as fast as an array (~0.2 against ~0.4-0.6 us for a block of 16), and the
    step loop hashes a block for every request that fills one."""
    packer = _PACKERS.get(len(token_ids))
    if packer is None:
        packer = _PACKERS[len(token_ids)] = struct.Struct(f"={len(token_ids)}q")
    return packer.pack(*token_ids)


def sha256_block_hash(parent_hash: int, token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
    payload = parent_hash.to_bytes(32, "little") + token_bytes(token_ids) + extra_keys
    return int.from_bytes(hashlib.sha256(payload).digest(), "little")


def xxhash_block_hash(parent_hash: int, token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
    payload = parent_hash.to_bytes(16, "little") + token_bytes(token_ids) + extra_keys
    return xxhash.xxh3_128_intdigest(payload)


# cache_blocks: a request none of whose blocks has been offered to the cache yet.
_NO_PARENT_YET = object()

# Each chains the parent's hash, so equal hashes mean (up to collisions) equal prefixes. Token
# bytes have a fixed length per block size, so the extra keys at the end cannot blur with them.
BLOCK_HASH_FUNCTIONS: dict[str, BlockHashFunction] = {
    "xxhash": xxhash_block_hash,
    "sha256": sha256_block_hash,
}


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        hash_algo: str = "xxhash",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if hash_algo not in BLOCK_HASH_FUNCTIONS:
            raise ValueError(
                f"hash_algo must be one of {', '.join(BLOCK_HASH_FUNCTIONS)}, got {hash_algo!r}"
            )
        if enable_caching and hash_algo == "xxhash" and xxhash is None:
            raise ValueError(
                "prefix caching hashes with xxhash, which is not installed: pip install xxhash, "
                "or choose hash_algo='sha256'"
            )
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self._hash_block = BLOCK_HASH_FUNCTIONS[hash_algo]
        self.block_pool = BlockPool(num_blocks)
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Same tables as ids, grown in step with _req_to_blocks, so a step never rebuilds them.
        self._req_to_block_ids: dict[str, list[int]] = {}
        # Prefix caching: hashes of each request's full blocks (computed once each), how many
        # of its blocks have been offered to the cache, and the parent key of the next one
        # (None once a collision or an evicted parent broke its chain: no block after it can
        # be cached, it could never be reached).
        self._req_to_block_hashes: dict[str, list[int]] = {}
        self._req_num_cached_blocks: dict[str, int] = {}
        self._req_next_parent: dict[str, ParentKey | None] = {}
        # Prometheus-style counters (vLLM's meaning), first admissions only: prompt tokens
        # looked up, and those found in the cache. Recompute after a preemption is not a hit.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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
        sample from, and a block shared with another request is never written. A request that
        wants prompt logprobs takes no hits (as in vLLM): it needs logits at every prompt
        position. Its blocks are still cached for others.
        """
        if not self._looks_up(request):
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        token_ids = request.all_token_ids
        size = self.block_size
        parent_key = root_key(request.cache_salt)
        hit_blocks: list[KVCacheBlock] = []
        # Hashes are computed one block ahead of need, so a miss at block 0 hashes one block.
        for index in range(max_num_blocks):
            block_hash = self._block_hashes(request, index + 1)[index]
            block_tokens = token_ids[index * size : (index + 1) * size]
            block = self.block_pool.get_cached_block(block_hash, block_tokens, parent_key)
            if block is None:
                break
            hit_blocks.append(block)
            parent_key = chain_key(block)
        return hit_blocks, len(hit_blocks) * size

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
        blocks = self._req_to_blocks.get(request_id)  # None: its first blocks (admission)
        num_hits = len(new_computed_blocks)
        if num_hits and blocks:
            raise ValueError(f"request {request_id} already holds blocks; cache hits come first")
        num_hit_tokens = num_hits * self.block_size
        num_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_missing = self._num_missing_blocks(request_id, num_tokens, new_computed_blocks)
        if not self._has_room(num_missing, new_computed_blocks):
            return None
        if blocks is None:
            self._on_admission(request, num_hit_tokens)
            blocks = self._req_to_blocks[request_id] = []
        block_ids = self._req_to_block_ids.setdefault(request_id, [])
        if num_hits:
            # Touch before allocating: a hit block in the free queue must not be handed out.
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            block_ids.extend(block.block_id for block in new_computed_blocks)
            self._req_num_cached_blocks[request_id] = len(new_computed_blocks)
            self._req_next_parent[request_id] = chain_key(new_computed_blocks[-1])
        new_blocks = self.block_pool.get_new_blocks(num_missing)
        blocks.extend(new_blocks)
        new_block_ids = [block.block_id for block in new_blocks]
        block_ids.extend(new_block_ids)
        return new_block_ids

    @property
    def held_blocks(self) -> Mapping[str, list[KVCacheBlock]]:
        """Request id -> the blocks it holds, for reading only (the scheduler's decode path
        checks that a request's blocks hold its next token without a call per request)."""
        return self._req_to_blocks

    @property
    def held_block_ids(self) -> Mapping[str, list[int]]:
        """Request id -> its block table (the live lists), for reading only: the scheduler
        reads every running request's each step, without a call per request. A list only
        grows; a request that gives blocks back gets a new one."""
        return self._req_to_block_ids

    def cache_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Index the request's blocks that are now full and computed, for later requests to hit.
        Called after a step has computed them, so a hit never reads KV still being written.
        `num_computed_tokens`: the tokens whose KV the completed steps wrote, where the
        request's own count runs ahead of them (async scheduling counts a step in flight)."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached = self._req_num_cached_blocks.get(request_id, 0)
        if num_full_blocks <= num_cached:
            return
        self._req_num_cached_blocks[request_id] = num_full_blocks
        parent_key = self._req_next_parent.get(request_id, _NO_PARENT_YET)
        if parent_key is _NO_PARENT_YET:
            parent_key = root_key(request.cache_salt)
        if parent_key is None or is_stale(parent_key):
            # A collision broke the chain, or the cached copy of the last block (another
            # request's, not held by this one) was evicted: later blocks would be unreachable.
            self._req_next_parent[request_id] = None
            return
        block_hashes = self._req_to_block_hashes.setdefault(request_id, [])
        blocks = self._req_to_blocks[request_id]
        token_ids = request.all_token_ids
        size = self.block_size
        cache_block = self.block_pool.cache_block
        for index in range(num_cached, num_full_blocks):
            block_tokens = tuple(token_ids[index * size : (index + 1) * size])
            if index == len(block_hashes):  # (the one new block of a decode, in most calls)
                self._append_hash(request, block_hashes, block_tokens)
            elif index > len(block_hashes):
                self._block_hashes(request, index + 1)
            cached = cache_block(blocks[index], block_hashes[index], block_tokens, parent_key)
            if cached is None:
                self._req_next_parent[request_id] = None
                return
            parent_key = (cached, cached.generation)  # chain_key(cached), in line
        self._req_next_parent[request_id] = parent_key

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past the first `num_tokens` tokens (slots of rejected
        drafts, or of guesses never verified). They are past its computed tokens, so never
        cached."""
        request_id = request.request_id
        blocks = self._req_to_blocks.get(request_id)
        num_kept = self.blocks_needed(num_tokens)
        if not blocks or len(blocks) <= num_kept:
            return
        tail = blocks[num_kept:]
        del blocks[num_kept:]
        # A new list, not one shortened in place: a runner's block tables (BlockTables) take a
        # list they have seen before to have only grown.
        block_id_lists = self._req_to_block_ids
        block_id_lists[request_id] = block_id_lists[request_id][:num_kept]
        self.block_pool.free_blocks(reversed(tail))

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache. Refused (False, nothing changed) while any block is held by
        a request; True once every cached block is forgotten."""
        return self.block_pool.reset_prefix_cache()

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its last blocks are evicted first (a
        later request sharing the prefix needs the leading ones). Safe to call twice."""
        request_id = request.request_id
        blocks = self._req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self._req_to_block_ids.pop(request_id, None)
        self._req_to_block_hashes.pop(request_id, None)
        self._req_num_cached_blocks.pop(request_id, None)
        self._req_next_parent.pop(request_id, None)

    def detach(self, request: Request) -> list[KVCacheBlock]:
        """Take the request's blocks out of its table without freeing them: they stay held
        (and cached) until `release` (KV a decode instance will pull, or blocks a transfer is
        still writing)."""
        blocks = self._req_to_blocks.get(request.request_id, [])
        self._req_to_blocks[request.request_id] = []
        self.free(request)
        return blocks

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Free blocks that `detach` took, tail first (as `free`)."""
        self.block_pool.free_blocks(reversed(blocks))

    def _on_admission(self, request: Request, num_cached_tokens: int) -> None:
        """A request gets its first blocks: count its lookup if this is its first admission
        (a resume after preemption recomputes tokens it had; that is no cache hit)."""
        if request.num_preemptions > 0:
            return
        request.num_cached_tokens = num_cached_tokens
        if self._looks_up(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached_tokens

    def _looks_up(self, request: Request) -> bool:
        """Whether the request's prompt is looked up in the prefix cache (and counted)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def _num_missing_blocks(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        num_held = len(self._req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        return max(0, self.blocks_needed(num_tokens) - num_held)

    def _has_room(self, num_missing: int, new_computed_blocks: Sequence[KVCacheBlock]) -> bool:
        # Hit blocks nobody holds are counted as free, but touching them takes them out.
        num_free_hits = 0
        if new_computed_blocks:  # (most calls have none: a decode's next block)
            num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return num_missing <= len(self.block_pool.free_block_queue) - num_free_hits

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Hashes of the request's first `num_blocks` full blocks, computed once per block."""
        block_hashes = self._req_to_block_hashes.setdefault(request.request_id, [])
        token_ids = request.all_token_ids
        size = self.block_size
        for index in range(len(block_hashes), num_blocks):
            self._append_hash(request, block_hashes, token_ids[index * size : (index + 1) * size])
        return block_hashes

    def _append_hash(
        self, request: Request, block_hashes: list[int], block_tokens: Sequence[int]
    ) -> None:
        """Hash the request's next full block (`block_tokens`) onto its hashes so far."""
        if block_hashes:
            block_hashes.append(self._hash_block(block_hashes[-1], block_tokens, b""))
        else:
            salt = request.cache_salt
            extra_keys = b"" if salt is None else salt.encode()
            block_hashes.append(self._hash_block(_ROOT_HASH, block_tokens, extra_keys))
