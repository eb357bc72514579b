"""KV cache block pool: per-request allocation, ref counts and prefix caching.

Prefix caching keys a block by a chained hash, hash(parent block's hash, the block's
token ids), computed for FULL blocks only: a partial block's content still changes, and
the chain makes a block's hash name its whole prefix, so equal hashes mean equal KV.

The free queue holds every block with ref_cnt == 0, oldest first. A freed block keeps its
hash and KV (it is "cached free"): a later request with the same prefix takes it back out
of the queue; otherwise it is evicted, oldest first, when a fresh block is needed. Cached
free blocks therefore count as free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from shared.serving.request import Request

BlockHash = bytes
_ROOT_HASH: BlockHash = b""


def hash_block_tokens(parent_hash: BlockHash, token_ids: list[int]) -> BlockHash:
    """Chained hash of one full block: a digest of (parent hash, token ids)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set only while registered in the cache

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (head = least recently freed).
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_block_by_hash: dict[BlockHash, KVCacheBlock] = {}
        # How many leading blocks of each live request were offered to the cache already.
        # Keyed by the Request object: a resubmitted id is another object.
        self._num_cached_blocks: dict[Request, int] = {}

    # ---- accounting ------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    # ---- prefix cache lookup -----------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        Returns (block ids, num_computed_tokens). Never the whole sequence: at least one
        token is left to compute, because the step needs a logit to sample from.
        """
        assert not request.block_ids, f"{request.request_id} already holds blocks"
        if not self.enable_prefix_caching:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the hidden state of every prompt position and a cached
            # prefix has none: recompute it (vLLM does the same). Its own blocks are still
            # registered (allocate_slots) for the requests after it.
            return [], 0
        if request.pooling_params is not None:
            # Pooling needs the final hidden state of every prompt token (MEAN, the token
            # tasks) or of the first one (CLS), and a cached prefix has none: recompute.
            # LAST could reuse a prefix; one rule for every pooling type keeps V1 and V2
            # (and the chunk boundaries the pooler sees) identical by construction.
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.cached_block_by_hash.get(block_hash)
            if block is None:
                break
            hit.append(block.block_id)
        return hit, len(hit) * self.block_size

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request` this step.

        `computed_blocks` (from get_computed_blocks, for a request holding no blocks) are
        prefix-cache hits not yet counted in request.num_computed_tokens. Returns the ids
        appended to request.block_ids this step (hits included), or None, changing
        nothing, when the pool cannot supply them.
        """
        if not computed_blocks:
            # The steady decode case, once per running request per step: the new tokens
            # fit in the blocks the request holds and fill no block, so there is nothing
            # to allocate and nothing to register in the prefix cache.
            num_after = request.num_computed_tokens + num_new_tokens
            if num_after <= len(request.block_ids) * self.block_size and (
                not self.enable_prefix_caching
                or num_after // self.block_size <= self._num_cached_blocks.get(request, 0)
            ):
                return []
        computed_blocks = computed_blocks or []
        assert not computed_blocks or not request.block_ids
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_tokens_after = num_computed + num_new_tokens
        num_required = -(-num_tokens_after // self.block_size)
        num_new_blocks = max(0, num_required - len(request.block_ids) - len(computed_blocks))
        # A hit sitting in the free queue leaves it when touched, so it is not available
        # for the fresh blocks as well.
        num_hits_in_queue = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        if num_new_blocks > self.num_free_blocks - num_hits_in_queue:
            return None

        # Touch hits before popping fresh blocks, or a pop could evict a hit.
        for block_id in computed_blocks:
            self._touch(self.blocks[block_id])
        new_block_ids = [self._pop_free_block().block_id for _ in range(num_new_blocks)]
        appended = list(computed_blocks) + new_block_ids
        request.block_ids.extend(appended)
        if self.enable_prefix_caching:
            self._num_cached_blocks.setdefault(request, 0)
            self._num_cached_blocks[request] += len(computed_blocks)
            self._cache_full_blocks(request, num_tokens_after)
        return appended

    def _touch(self, block: KVCacheBlock) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def _pop_free_block(self) -> KVCacheBlock:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:  # evict: its KV is about to be overwritten
            if self.cached_block_by_hash.get(block.block_hash) is block:
                del self.cached_block_by_hash[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def _cache_full_blocks(self, request: Request, num_tokens_after: int) -> None:
        """Register the blocks that this step's tokens fill.

        Registered before the forward writes them, as vLLM does: a request that hits such
        a block in the same step reads it in the same forward, and every layer writes the
        whole batch's K/V before its attention reads any of it.
        """
        self._update_block_hashes(request)
        num_full = min(num_tokens_after // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks[request]
        for i in range(start, num_full):
            block = self.blocks[request.block_ids[i]]
            block_hash = request.block_hashes[i]
            # A twin computed in parallel by another request stays uncached: one block per hash.
            if block.block_hash is None and block_hash not in self.cached_block_by_hash:
                block.block_hash = block_hash
                self.cached_block_by_hash[block_hash] = block
        self._num_cached_blocks[request] = max(start, num_full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Only while no request holds a block (the scheduler's
        recovery frees them all first): a registered block's KV may never have been
        written when its step failed."""
        held = self.num_total_blocks - self.num_free_blocks
        if held:
            raise RuntimeError(f"reset_prefix_cache with {held} blocks still held by requests")
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_by_hash.clear()

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks nobody uses go to the free queue tail.

        The tail block is freed first so that it is evicted before the blocks in front of
        it: a prefix is likelier to be shared than a request's private tail.
        """
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block_id] = block
        request.block_ids = []
        self._num_cached_blocks.pop(request, None)
