"""BlockManager against exact block ids, ref counts and free-queue order (no model), like vLLM's
tests/v1/core/test_prefix_caching.py. Block size 4 keeps the token lists short."""

import pytest

import glm5.infer.block_manager as bm_mod
from glm5.infer.block_manager import BlockManager, hash_block
from glm5.infer.request import Request
from glm5.infer.sampling import SamplingParams

BS = 4


def make_req(rid, tokens, **kwargs):
    params = kwargs.pop("params", None)
    return Request(rid, tokens, params, **kwargs)


def admit(bm, req, num_new=None):
    """What the scheduler does for a waiting request: prefix lookup, allocation, then the step runs."""
    computed = bm.get_computed_blocks(req)
    num_new = req.num_tokens - computed.num_tokens if num_new is None else num_new
    new = bm.allocate_slots(req, num_new, computed)
    assert new is not None
    req.num_computed_tokens = computed.num_tokens + num_new  # the runner computed the chunk
    bm.cache_blocks(req)
    return computed, new


def refs(bm, ids):
    return [bm.blocks[i].ref_cnt for i in ids]


def free_order(bm):
    return list(bm.free_queue)


def test_prefix_hit_ref_counts_and_free_order():
    bm = BlockManager(10, BS)
    r0 = make_req("r0", list(range(10)))  # blocks: [0..3] [4..7] [8 9]
    computed, new = admit(bm, r0)
    assert computed.block_ids == [] and new == [0, 1, 2]
    assert r0.block_ids == [0, 1, 2] and refs(bm, [0, 1, 2]) == [1, 1, 1]
    assert free_order(bm) == [3, 4, 5, 6, 7, 8, 9]
    assert bm.blocks[0].block_hash is not None and bm.blocks[1].block_hash is not None
    assert bm.blocks[2].block_hash is None  # partial block: never cached
    assert bm.usage == pytest.approx(0.3)

    r1 = make_req("r1", list(range(8)) + [100, 101, 102])  # shares two full blocks
    computed, new = admit(bm, r1)
    assert computed.block_ids == [0, 1] and computed.num_tokens == 8
    assert new == [3] and r1.block_ids == [0, 1, 3]
    assert refs(bm, [0, 1, 2, 3]) == [2, 2, 1, 1]

    bm.free(r0)
    assert refs(bm, [0, 1, 2]) == [1, 1, 0]
    assert free_order(bm) == [2, 4, 5, 6, 7, 8, 9]  # unhashed block 2 goes to the head
    bm.free(r1)
    # r1's blocks are queued tail first; unhashed 3 to the head, cached 1 then 0 to the back
    assert free_order(bm) == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    assert bm.num_free_blocks == 10 and bm.usage == 0.0

    r2 = make_req("r2", list(range(8)) + [7])  # hits the free cached blocks 0 and 1
    computed, new = admit(bm, r2)
    assert computed.block_ids == [0, 1] and new == [3]
    assert free_order(bm) == [2, 4, 5, 6, 7, 8, 9]
    assert bm.prefix_cache_queries == 10 + 11 + 9 and bm.prefix_cache_hits == 8 + 8


def test_lru_eviction_evicts_tail_blocks_first():
    bm = BlockManager(6, BS)
    r0 = make_req("r0", list(range(12)) + [99])  # 3 full blocks + 1
    admit(bm, r0)
    assert r0.block_ids == [0, 1, 2, 3]
    bm.free(r0)
    assert free_order(bm) == [3, 4, 5, 2, 1, 0]
    h = [bm.blocks[i].block_hash for i in range(3)]
    assert all(x in bm.hash_to_block_id for x in h)

    r1 = make_req("r1", [50 + i for i in range(16)])  # unrelated: needs 4 blocks, evicts 3, 4, 5, 2
    _, new = admit(bm, r1)
    assert new == [3, 4, 5, 2]
    assert h[2] not in bm.hash_to_block_id and bm.blocks[2].block_hash != h[2]
    assert h[0] in bm.hash_to_block_id and h[1] in bm.hash_to_block_id
    r2 = make_req("r2", list(range(12)) + [99])  # the first two blocks survived
    assert bm.get_computed_blocks(r2).block_ids == [0, 1]


def test_allocation_failure_changes_nothing():
    bm = BlockManager(4, BS)
    r0 = make_req("r0", list(range(8)) + [1])
    admit(bm, r0)  # blocks 0, 1 cached; 2 partial
    bm.free(r0)
    before = (free_order(bm), refs(bm, range(4)))
    r1 = make_req("r1", list(range(8)) + list(range(20, 32)))  # 20 tokens = 5 blocks > 4
    computed = bm.get_computed_blocks(r1)
    assert computed.block_ids == [0, 1]
    # 3 new blocks needed, 4 free, but 2 of the free ones are the hit blocks themselves
    assert bm.allocate_slots(r1, r1.num_tokens - 8, computed) is None
    assert (free_order(bm), refs(bm, range(4))) == before and r1.block_ids == []
    assert bm.prefix_cache_queries == 9  # a failed admission is not counted


def test_decode_appends_blocks_and_caches_when_full():
    bm = BlockManager(8, BS)
    r = make_req("r", [1, 2, 3])
    admit(bm, r)
    assert r.block_ids == [0]
    for tok in (4, 5):  # decode steps: the sampled token is computed in the next step
        r.append_output_token_ids([tok])
        assert bm.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        bm.cache_blocks(r)
    assert r.block_ids == [0, 1] and r.num_computed_tokens == 5
    assert bm.blocks[0].block_hash == hash_block(None, [1, 2, 3, 4]) and bm.blocks[0].token_ids == (1, 2, 3, 4)
    assert bm.allocate_slots(r, 1, num_lookahead_tokens=4) == [2]  # slots for drafts too


def test_last_token_is_always_recomputed():
    bm = BlockManager(8, BS)
    admit(bm, make_req("a", list(range(8))))
    b = make_req("b", list(range(8)))
    computed = bm.get_computed_blocks(b)
    assert computed.block_ids == [0] and computed.num_tokens == 4


def test_cache_salt_isolates_and_prompt_logprobs_skip():
    bm = BlockManager(12, BS)
    admit(bm, make_req("a", list(range(9)), cache_salt="tenant-1"))
    assert bm.get_computed_blocks(make_req("b", list(range(9)), cache_salt="tenant-2")).block_ids == []
    assert bm.get_computed_blocks(make_req("c", list(range(9)))).block_ids == []
    assert bm.get_computed_blocks(make_req("d", list(range(9)), cache_salt="tenant-1")).block_ids == [0, 1]
    lp = make_req("e", list(range(9)), cache_salt="tenant-1", params=SamplingParams(prompt_logprobs=1))
    assert bm.get_computed_blocks(lp).block_ids == []


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens, extra=None: b"same")
    bm = BlockManager(8, BS)
    admit(bm, make_req("a", [1, 2, 3, 4, 5]))
    assert bm.hash_to_block_id == {b"same": 0}
    other = make_req("b", [9, 9, 9, 9, 5])  # same (fake) hash, different tokens
    assert bm.get_computed_blocks(other).block_ids == []
    same = make_req("c", [1, 2, 3, 4, 6])
    assert bm.get_computed_blocks(same).block_ids == [0]


def test_duplicate_blocks_stay_unregistered():
    bm = BlockManager(8, BS)
    a, b = make_req("a", list(range(5))), make_req("b", list(range(5)))
    ca, cb = bm.get_computed_blocks(a), bm.get_computed_blocks(b)  # computed in the same step
    bm.allocate_slots(a, 5, ca)
    bm.allocate_slots(b, 5, cb)
    for r in (a, b):
        r.num_computed_tokens = 5
        bm.cache_blocks(r)
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    assert bm.hash_to_block_id == {a.block_hashes[0]: 0} and bm.blocks[2].block_hash is None
    bm.free(b)
    assert free_order(bm)[:2] == [2, 3]


def test_reset_prefix_cache_and_memory_sizing():
    bm = BlockManager.from_memory(10 * 1000 + 999, bytes_per_block=1000, block_size=BS)
    assert bm.num_blocks == 10
    a = make_req("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.hash_to_block_id == {} and bm.get_computed_blocks(make_req("b", list(range(9)))).block_ids == []
    with pytest.raises(ValueError, match="bytes_per_block"):
        BlockManager.num_blocks_for_memory(100, 0)


def test_chained_hash_depends_on_parent():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], "salt") != h0
    assert hash_block(None, [1, 2, 3, 4]) == h0  # deterministic


def test_partial_block_registered_at_free_and_reused_by_copy():
    """`cache_partial_blocks`: a freed request's last block of k < BS computed rows is registered under
    (parent hash, its k tokens); a request continuing that prefix takes the full blocks, a fresh block for the
    next one and a copy of the k rows into it (the source held until `release_copies`); a request that
    differs inside those k tokens reuses the rows before the difference; eviction forgets the partial block."""
    bm = BlockManager(10, BS, cache_partial_blocks=True)
    r0 = make_req("r0", list(range(10)))  # [0..3] [4..7] [8 9]: 2 full blocks, 2 rows of a third
    admit(bm, r0)
    partial = r0.block_ids[2]
    bm.free(r0)
    assert len(bm.blocks[partial].partial_keys) == 2 and list(bm.free_queue)[0] != partial  # kept (LRU tail side)
    r1 = make_req("r1", list(range(10)) + [50, 51])  # continues the prefix: 10 tokens reused, 2 computed
    computed = bm.get_computed_blocks(r1)
    assert computed.num_tokens == 10 and computed.partial == (partial, 2)
    new = bm.allocate_slots(r1, 2, computed)
    assert len(new) == 1 and new[0] != partial and bm.blocks[partial].ref_cnt == 1  # held for the copy
    copies = bm.take_copies()
    assert copies == [(partial, new[0], 2)] and bm.take_copies() == []
    bm.release_copies(copies)
    assert bm.blocks[partial].ref_cnt == 0 and partial in bm.free_queue
    other = make_req("r2", list(range(9)) + [77, 78])  # differs at token 9: the partial block's first row
    c2 = bm.get_computed_blocks(other)
    assert c2.num_tokens == 9 and c2.partial == (partial, 1)
    far = make_req("r4", list(range(8)) + [77, 78])  # differs at token 8: the full blocks only
    c4 = bm.get_computed_blocks(far)
    assert c4.num_tokens == 8 and c4.partial is None
    one_left = make_req("r3", list(range(10)))  # the same 10 tokens: one is left to compute (a 1-row prefix)
    c3 = bm.get_computed_blocks(one_left)
    assert c3.num_tokens == 9 and c3.partial == (partial, 1)
    while partial in bm.free_queue:  # allocate everything: the partial block is evicted and forgotten
        bm._pop_free()
    assert not bm.blocks[partial].partial_keys and not bm.partial_to_block_id


def test_partial_blocks_off_by_default():
    bm = BlockManager(10, BS)
    r0 = make_req("r0", list(range(10)))
    admit(bm, r0)
    bm.free(r0)
    assert not bm.partial_to_block_id
    assert bm.get_computed_blocks(make_req("r1", list(range(10)) + [5])).num_tokens == 8
