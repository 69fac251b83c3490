"""Block manager: exact block ids, eviction order, ref counts and events on a 10-block pool."""

import pytest

from kvstore.events import BlockRemoved, BlockStored
from kvstore.hashing import hash_prompt_blocks
from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

BS = 4


def make_seq(tokens, rid="r", salt=None):
    return Sequence(rid, list(tokens), SamplingParams(), arrival_time=0.0, cache_salt=salt)


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit like the scheduler does and mark every token computed."""
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - cached.num_tokens, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


@pytest.fixture
def bm():
    return BlockManager(num_blocks=10, block_size=BS, model_key="m")


def test_allocation_takes_blocks_in_order_and_free_returns_them(bm):
    seq = make_seq(range(10))  # 3 blocks: 2 full + 1 partial
    assert bm.allocate_slots(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 7
    seq.num_computed_tokens = 10
    bm.cache_full_blocks(seq)
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 10
    bm.check_idle()
    # the uncached partial block goes to the front of the queue, the cached chain tail-first
    assert list(bm._free)[:1] == [2]
    assert list(bm._free)[-2:] == [1, 0]


def test_prefix_hit_reuses_exact_blocks_and_leaves_one_token(bm):
    a = make_seq(range(12), "a")  # exactly 3 full blocks
    run_prefill(bm, a)
    assert a.block_table == [0, 1, 2]
    b = make_seq(range(12), "b")
    cached = bm.find_cached_prefix(b)
    # the last block is not reused: its last token must be computed to get logits
    assert [blk.block_id for blk in cached.blocks] == [0, 1]
    assert cached.num_tokens == 8
    assert bm.allocate_slots(b, 4, cached)
    assert b.block_table == [0, 1, 3]
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    bm.free(a)
    bm.free(b)
    bm.check_idle()


def test_hit_is_verified_against_tokens(bm):
    a = make_seq(range(8), "a")
    run_prefill(bm, a)
    bm.free(a)
    # forge a collision: same hash chain, different tokens in the cached block
    bm.blocks[0].token_ids = (99, 99, 99, 99)
    b = make_seq(list(range(8)) + [1], "b")
    assert bm.find_cached_prefix(b).num_tokens == 0


def test_salt_separates_tenants(bm):
    a = make_seq(range(9), "a", salt="tenant-a")
    run_prefill(bm, a)
    assert bm.find_cached_prefix(make_seq(range(9), "b", salt="tenant-b")).num_tokens == 0
    assert bm.find_cached_prefix(make_seq(range(9), "c", salt="tenant-a")).num_tokens == 8
    bm.free(a)


def test_lru_evicts_tail_of_chain_first_and_emits_events(bm):
    a = make_seq(range(16), "a")  # blocks 0..3, all full
    run_prefill(bm, a)
    events = bm.take_events()
    assert events == [BlockStored(tuple(hash_prompt_blocks(list(range(16)), BS, "m")), None)]
    bm.free(a)  # queue: 4..9 (never used), then 3, 2, 1, 0
    assert list(bm._free) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    big = make_seq(range(100, 128), "big")  # 7 blocks: takes 4..9 and evicts block 3
    assert bm.allocate_slots(big, 28)
    assert big.block_table == [4, 5, 6, 7, 8, 9, 3]
    hashes = hash_prompt_blocks(list(range(16)), BS, "m")
    assert bm.take_events() == [BlockRemoved((hashes[3],))]
    # the head of the chain survived
    c = make_seq(list(range(13)), "c")
    assert [b.block_id for b in bm.find_cached_prefix(c).blocks] == [0, 1, 2]
    bm.free(big)
    bm.check_idle()


def test_allocation_is_all_or_nothing(bm):
    a = make_seq(range(36), "a")  # 9 blocks
    assert bm.allocate_slots(a, 36)
    b = make_seq(range(100, 108), "b")  # needs 2, only 1 free
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.free(a)
    bm.check_idle()


def test_revived_cached_blocks_count_against_free_space(bm):
    a = make_seq(range(17), "a")  # 4 full blocks (0..3, cached) + 1 partial (4, uncached)
    run_prefill(bm, a)
    bm.free(a)
    assert list(bm._free) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    filler = make_seq(range(200, 224), "f")  # 6 blocks: 4..9; only the cached chain is left
    assert bm.allocate_slots(filler, 24)
    assert filler.block_table == [4, 5, 6, 7, 8, 9]
    b = make_seq(range(17), "b")
    cached = bm.find_cached_prefix(b)
    assert [blk.block_id for blk in cached.blocks] == [0, 1, 2, 3]
    # reviving 4 cached blocks plus 1 new block needs 5; only those 4 are free
    assert not bm.allocate_slots(b, 1, cached)
    assert b.block_table == [] and bm.num_free_blocks == 4
    assert all(bm.blocks[i].ref_count == 0 for i in range(4))
    bm.free(filler)
    assert bm.allocate_slots(b, 1, cached)
    assert b.block_table == [0, 1, 2, 3, 4]  # uncached blocks freed to the front, in table order
    bm.free(b)
    bm.check_idle()


def test_check_idle_detects_a_leak(bm):
    a = make_seq(range(4), "a")
    assert bm.allocate_slots(a, 4)
    with pytest.raises(AssertionError, match="referenced while idle"):
        bm.check_idle()
    bm.free(a)
    bm.check_idle()


def test_duplicate_concurrent_blocks_keep_the_first_copy(bm):
    a, b = make_seq(range(8), "a"), make_seq(range(8), "b")
    assert bm.allocate_slots(a, 8) and bm.allocate_slots(b, 8)
    for s in (a, b):
        s.num_computed_tokens = 8
        bm.cache_full_blocks(s)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert bm.blocks[2].block_hash is None  # b's copy is not registered
    bm.free(a)
    bm.free(b)
    bm.check_idle()
    assert len(bm.cached_hashes()) == 2
