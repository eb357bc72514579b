"""KVCacheManager: accounting, prefix hits on full blocks, ref counts, LRU eviction."""

from __future__ import annotations

import random

import pytest

from shared.contract.sampling_params import SamplingParams
from shared.serving.block_manager import KVCacheManager
from shared.serving.request import Request

BS = 4


def make_req(tokens: list[int], req_id: str = "r") -> Request:
    return Request(req_id, tokens, SamplingParams(), None, 0)


def prefill(kv: KVCacheManager, req: Request, use_cache: bool = True) -> list[int]:
    """Schedule a whole prompt the way the scheduler does; returns the hit block ids."""
    hit, num_hit = kv.get_computed_blocks(req) if use_cache else ([], 0)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hit) is not None
    req.num_computed_tokens = req.num_tokens
    return hit


def decode(kv: KVCacheManager, req: Request, token: int) -> list[int] | None:
    req.append_output_token_id(token)
    new = kv.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def assert_consistent(kv: KVCacheManager, live: list[Request]) -> None:
    """Ref counts equal the number of live owners; free queue = unreferenced blocks."""
    owners = [0] * kv.num_total_blocks
    for req in live:
        assert len(set(req.block_ids)) == len(req.block_ids)
        for b in req.block_ids:
            owners[b] += 1
    assert [b.ref_cnt for b in kv.blocks] == owners
    assert set(kv.free_queue) == {i for i, n in enumerate(owners) if n == 0}
    assert kv.num_free_blocks + sum(n > 0 for n in owners) == kv.num_total_blocks


def test_allocation_and_free_accounting():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    req = make_req(list(range(10)))
    new = kv.allocate_slots(req, 10)
    assert new == req.block_ids and len(new) == 3  # ceil(10 / 4)
    assert kv.num_free_blocks == 7
    req.num_computed_tokens = 10
    assert decode(kv, req, 1) == []  # 11 tokens: still 3 blocks
    assert decode(kv, req, 2) == []  # 12 tokens
    new = decode(kv, req, 3)  # 13 tokens: a 4th block
    assert len(new) == 1 and req.block_ids[-1] == new[0]
    assert kv.num_free_blocks == 6
    assert_consistent(kv, [req])

    big = make_req(list(range(40)), "big")  # 10 blocks: does not fit beside req
    assert kv.allocate_slots(big, 40) is None
    assert big.block_ids == [] and kv.num_free_blocks == 6  # nothing changed
    kv.free(req)
    assert req.block_ids == [] and kv.num_free_blocks == 10
    assert kv.allocate_slots(big, 40) is not None and kv.num_free_blocks == 0


def test_prefix_hit_full_blocks_only():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(100, 110))  # 2.5 blocks
    a, b = make_req(prompt, "a"), make_req(prompt, "b")
    assert prefill(kv, a) == []
    hit, num_hit = kv.get_computed_blocks(b)
    assert hit == a.block_ids[:2] and num_hit == 2 * BS
    new = kv.allocate_slots(b, len(prompt) - num_hit, hit)
    assert new[:2] == hit and new[2] != a.block_ids[2]  # the partial block is private
    assert kv.num_free_blocks == 10 - 3 - 1
    assert_consistent(kv, [a, b])

    # Same first 10 tokens, then different: still only the 2 full blocks match, even
    # after a's third block fills with a's own tokens.
    for t in (7, 7):
        decode(kv, a, t)
    c = make_req(prompt + [1, 2, 3, 4], "c")
    assert kv.get_computed_blocks(c)[1] == 2 * BS
    # The chain: an equal second block behind a different first block is no hit.
    d = make_req([0, 0, 0, 0] + prompt[4:], "d")
    assert kv.get_computed_blocks(d) == ([], 0)


@pytest.mark.parametrize("prompt_len, expected_hit_blocks", [(4, 0), (5, 1), (8, 1), (9, 2)])
def test_prefix_hit_never_the_whole_prompt(prompt_len, expected_hit_blocks):
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(50, 50 + prompt_len))
    prefill(kv, make_req(prompt + [99] * 8, "long"))  # caches every block of the prompt
    hit, num_hit = kv.get_computed_blocks(make_req(prompt, "again"))
    assert len(hit) == expected_hit_blocks and num_hit == expected_hit_blocks * BS
    assert num_hit < prompt_len  # at least one token left to compute a logit


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    prefill(kv, make_req(list(range(12)), "a"))
    assert kv.get_computed_blocks(make_req(list(range(12)), "b")) == ([], 0)


def test_chunk_caches_only_blocks_it_completes():
    # A block is offered to the cache once its KV is fully scheduled, not when its tokens
    # are known: a 6-token chunk of a 10-token prompt completes block 0 only.
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(10))
    a = make_req(prompt, "a")
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    assert kv.get_computed_blocks(make_req(prompt, "probe"))[1] == BS
    kv.free(a)  # aborted mid-prefill: block 1 is half written and must stay unhashed
    assert kv.get_computed_blocks(make_req(prompt, "probe"))[1] == BS


def test_shared_block_survives_first_owner():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(10))
    a, b = make_req(prompt, "a"), make_req(prompt, "b")
    prefill(kv, a)
    shared = prefill(kv, b)
    assert [kv.blocks[i].ref_cnt for i in shared] == [2, 2]
    kv.free(a)
    assert [kv.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert not set(shared) & set(kv.free_queue)
    assert kv.num_free_blocks == 10 - 3  # b's 2 shared + 1 private
    assert_consistent(kv, [b])
    kv.free(b)
    assert kv.num_free_blocks == 10
    assert_consistent(kv, [])


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    prompt_a = list(range(8))  # exactly 2 full blocks
    a = make_req(prompt_a, "a")
    prefill(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    assert kv.num_free_blocks == 4  # cached free blocks count as free

    # Reuse: the same prompt plus one token hits both freed blocks, taking them out of
    # the free queue.
    a2 = make_req(prompt_a + [9], "a2")
    assert prefill(kv, a2) == a_blocks
    assert kv.num_free_blocks == 4 - 3
    kv.free(a2)

    # Eviction: fresh blocks go first, then the oldest freed; a's tail block was freed
    # before its head block, so the head (the likelier shared prefix) survives longest.
    b = make_req([500 + i for i in range(8)], "b")
    prefill(kv, b, use_cache=False)
    assert not set(b.block_ids) & set(a_blocks)  # never-cached / a2's private tail first
    assert kv.get_computed_blocks(make_req(prompt_a + [9], "probe"))[0] == a_blocks
    c = make_req([700, 701, 702], "c")
    prefill(kv, c, use_cache=False)
    assert c.block_ids == [a_blocks[1]]  # a's tail evicted first
    assert kv.get_computed_blocks(make_req(prompt_a + [9], "probe"))[0] == a_blocks[:1]
    assert_consistent(kv, [b, c])


def test_evicted_block_rehashes_for_new_content():
    kv = KVCacheManager(num_blocks=2, block_size=BS, enable_prefix_caching=True)
    a = make_req([1, 2, 3, 4, 5], "a")
    prefill(kv, a)
    kv.free(a)
    b = make_req([6, 7, 8, 9, 10], "b")  # evicts both of a's blocks
    prefill(kv, b)
    kv.free(b)
    assert kv.get_computed_blocks(make_req([1, 2, 3, 4, 5], "a2")) == ([], 0)
    assert kv.get_computed_blocks(make_req([6, 7, 8, 9, 10], "b2"))[1] == BS


def test_every_block_free_after_random_workload():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=24, block_size=BS, enable_prefix_caching=True)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[Request] = []
    for i in range(60):
        if live and (rng.random() < 0.4 or len(live) > 5):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            base = rng.choice(prefixes)
            req = make_req(base[: rng.randrange(1, 13)] + [rng.randrange(50)], f"r{i}")
            hit, num_hit = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - num_hit, hit) is None:
                continue
            req.num_computed_tokens = req.num_tokens
            live.append(req)
            for _ in range(rng.randrange(6)):
                if decode(kv, req, rng.randrange(50)) is None:
                    break
        assert_consistent(kv, live)
    for req in live:
        kv.free(req)
    assert kv.num_free_blocks == kv.num_total_blocks
    assert all(b.ref_cnt == 0 for b in kv.blocks)
