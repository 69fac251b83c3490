"""KV tiers under the device pool: blocks fall device -> host -> disk -> gone, come back bit for
bit, and a restarted disk tier keeps exactly the files that verify."""

from __future__ import annotations

import torch

from kvstore.events import DEVICE, DISK, HOST, BlockRemoved, BlockStored
from kvstore.hashing import ROOT_PARENT_HASH, hash_block
from tests.unit.engine_helpers import hf_greedy, random_prompts
from workers.engine import LLMEngine, SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.kv_tiers import BlockMeta, KVTiers
from workers.engine.sequence import Sequence
from workers.protocol import KVLayout

MODEL_KEY = "tiers-test"
BLOCK = 4
LAYERS, HEADS, DIM = 3, 2, 8


def _layers(num_blocks: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn((2, num_blocks, BLOCK, HEADS, DIM), generator=gen).to(dtype) for _ in range(LAYERS)]


def _layout(dtype="float32") -> KVLayout:
    return KVLayout(LAYERS, BLOCK, HEADS, DIM, dtype)


def _meta(i: int, parent=ROOT_PARENT_HASH) -> BlockMeta:
    tokens = tuple(range(i * BLOCK, (i + 1) * BLOCK))
    return BlockMeta(hash_block(parent, tokens, MODEL_KEY), parent, tokens)


def _chain(n: int) -> list[BlockMeta]:
    metas, parent = [], ROOT_PARENT_HASH
    for i in range(n):
        metas.append(_meta(i, parent))
        parent = metas[-1].block_hash
    return metas


def _block(layers, block_id: int) -> torch.Tensor:
    return torch.stack([layer[:, block_id] for layer in layers])


def _tiers(layers, host=0, disk=0, path=None, dtype="float32") -> KVTiers:
    return KVTiers(layers, _layout(dtype), MODEL_KEY, host, disk, path)


def test_blocks_fall_through_host_lru_to_disk_and_gone(tmp_path):
    layers = _layers(8)
    tiers = _tiers(layers, host=2, disk=3, path=tmp_path)
    metas = _chain(5)
    try:
        for i, meta in enumerate(metas):  # blocks 0..4 freed in this order, each then evicted
            tiers.offer(i, meta)
            tiers.wait_idle()
        held = tiers.held()
        assert held[HOST] == [m.block_hash for m in metas[3:]]  # the two most recent
        assert held[DISK] == [m.block_hash for m in metas[2:]]  # the three most recent
        events = tiers.take_events()
        stored = [(e.medium, e.block_hashes[0]) for e in events if isinstance(e, BlockStored)]
        removed = [(e.medium, e.block_hashes[0]) for e in events if isinstance(e, BlockRemoved)]
        assert [h for m, h in stored if m == HOST] == [m.block_hash for m in metas]
        assert [h for m, h in removed if m == HOST] == [m.block_hash for m in metas[:3]]
        assert [h for m, h in removed if m == DISK] == [m.block_hash for m in metas[:2]]
        assert sorted(p.name for p in tiers.directory.glob("*.kv")) == sorted(
            f"{m.block_hash.hex()}.kv" for m in metas[2:]
        )
        assert tiers.stats.host_spills == 5 and tiers.stats.disk_spills == 5
    finally:
        tiers.close()


def test_a_block_evicted_from_device_loads_back_bit_for_bit(tmp_path):
    for dtype, name in ((torch.float32, "float32"), (torch.int8, "int8")):
        layers = (
            _layers(4)
            if dtype is torch.float32
            else [torch.randint(-128, 127, (2, 4, BLOCK + 1, HEADS, DIM), dtype=torch.int8) for _ in range(LAYERS)]
        )
        layout = KVLayout(LAYERS, BLOCK, HEADS, DIM, name)
        for host, disk in ((2, 0), (0, 2), (2, 2)):
            tiers = KVTiers(layers, layout, MODEL_KEY, host, disk, tmp_path / f"{name}-{host}-{disk}")
            try:
                meta = _meta(0)
                original = _block(layers, 1).clone()
                tiers.offer(1, meta)
                tiers.evict(1, meta)  # the device pool reuses block 1 now
                for layer in layers:
                    layer[:, 1] = 0
                tiers.wait_idle()
                assert tiers.find([(meta.block_hash, meta.token_ids)]) == [meta]
                job = tiers.load([meta], [3])
                assert job.done.wait(10) and job.loaded == 1
                assert torch.equal(_block(layers, 3), original)
                stats = tiers.stats
                assert (stats.host_hits, stats.disk_hits) == ((1, 0) if host else (0, 1))
            finally:
                tiers.close()


def test_find_stops_at_the_first_block_no_tier_holds_or_whose_tokens_differ(tmp_path):
    layers = _layers(4)
    tiers = _tiers(layers, host=4)
    metas = _chain(3)
    try:
        for i in (0, 2):  # block 1 never went down
            tiers.offer(i, metas[i])
        tiers.wait_idle()
        wanted = [(m.block_hash, m.token_ids) for m in metas]
        assert tiers.find(wanted) == [metas[0]]
        assert tiers.find([(metas[0].block_hash, (9, 9, 9, 9))]) == []
    finally:
        tiers.close()


def test_restart_keeps_exactly_the_files_that_verify(tmp_path):
    layers = _layers(6)
    metas = _chain(5)
    first = _tiers(layers, disk=8, path=tmp_path)
    for i, meta in enumerate(metas):
        first.offer(i, meta)
    first.wait_idle()
    directory = first.directory
    first.close()  # the lock goes with the process's handle

    files = {m.block_hash: directory / f"{m.block_hash.hex()}.kv" for m in metas}
    data = files[metas[1].block_hash].read_bytes()
    files[metas[1].block_hash].write_bytes(data[:-100])  # truncated
    raw = bytearray(files[metas[2].block_hash].read_bytes())
    raw[-1] ^= 0xFF  # one payload bit flipped
    files[metas[2].block_hash].write_bytes(bytes(raw))
    forged = directory / f"{metas[4].block_hash.hex()}.kv"
    forged.write_bytes(files[metas[3].block_hash].read_bytes())  # a file under another block's name
    (directory / "junk.tmp").write_bytes(b"half a write")

    restarted = _tiers(_layers(6), disk=8, path=tmp_path)
    try:
        assert restarted.directory == directory  # the restarted replica takes its old directory
        kept = set(restarted.held()[DISK])
        assert kept == {metas[0].block_hash, metas[3].block_hash}
        announced = [e for e in restarted.take_events() if isinstance(e, BlockStored)]
        assert {e.block_hashes[0] for e in announced} == kept and all(e.medium == DISK for e in announced)
        assert restarted.stats.dropped_files == 3
        assert sorted(p.name for p in directory.iterdir() if p.name != ".lock") == sorted(
            f"{metas[i].block_hash.hex()}.kv" for i in (0, 3)
        )
        job = restarted.load([metas[0]], [5])
        assert job.done.wait(10) and job.loaded == 1
        assert torch.equal(_block(restarted.layers, 5), _block(layers, 0))
    finally:
        restarted.close()


def test_a_second_live_replica_takes_its_own_directory(tmp_path):
    a = _tiers(_layers(2), disk=2, path=tmp_path)
    b = _tiers(_layers(2), disk=2, path=tmp_path)
    try:
        assert a.directory != b.directory and a.directory.parent == b.directory.parent
    finally:
        a.close()
        b.close()


def test_a_file_corrupted_after_start_is_dropped_at_load_and_the_rest_computed(tmp_path):
    layers = _layers(4)
    tiers = _tiers(layers, disk=4, path=tmp_path)
    metas = _chain(2)
    try:
        for i, meta in enumerate(metas):
            tiers.offer(i, meta)
        tiers.wait_idle()
        path = tiers.directory / f"{metas[1].block_hash.hex()}.kv"
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x01
        path.write_bytes(bytes(raw))
        job = tiers.load(metas, [2, 3])
        assert job.done.wait(10) and job.loaded == 1  # the good block only
        assert metas[1].block_hash not in tiers.held()[DISK] and not path.exists()
    finally:
        tiers.close()


# ------------------------------------------------------------ through the block manager
def _seq(tokens, rid="r") -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams(), arrival_time=0.0)


def test_block_manager_spills_on_free_loads_back_and_leaks_nothing():
    layers = _layers(4)
    tiers = _tiers(layers, host=8)
    bm = BlockManager(4, BLOCK, MODEL_KEY, tiers=tiers)
    try:
        first = _seq(range(3 * BLOCK + 1), "a")
        assert bm.allocate_slots(first, first.num_tokens)
        first.num_computed_tokens = first.num_tokens
        bm.cache_full_blocks(first)
        kv = {h: _block(layers, b).clone() for h, b in zip(bm.block_hashes(first), first.block_table)}
        bm.free(first)
        other = _seq(range(1000, 1000 + 4 * BLOCK), "b")  # takes every block: evicts the three
        assert bm.allocate_slots(other, other.num_tokens)
        for layer in layers:
            layer.zero_()
        bm.free(other)
        again = _seq(range(3 * BLOCK + 1), "c")
        assert bm.find_cached_prefix(again).num_tokens == 0
        metas = bm.find_in_tiers(again, bm.find_cached_prefix(again))
        assert [m.block_hash for m in metas] == bm.block_hashes(again)[:3]
        job = bm.start_load(metas, bm.find_cached_prefix(again))
        assert job is not None and job.done.wait(10)
        bm.finish_loads()
        cached = bm.find_cached_prefix(again)
        assert cached.num_tokens == 3 * BLOCK
        for block, block_hash in zip(cached.blocks, bm.block_hashes(again)):
            assert torch.equal(_block(layers, block.block_id), kv[block_hash])
        events = bm.take_events()
        assert any(isinstance(e, BlockStored) and e.medium == DEVICE and len(e.block_hashes) == 3 for e in events[-4:])
        bm.check_idle()
    finally:
        tiers.close()


# ------------------------------------------------------------ the engine, end to end
def _engine(model_dir, tmp_path, **tiers) -> LLMEngine:
    return LLMEngine(model_dir, num_kv_blocks=24, block_size=16, max_num_batched_tokens=512, **tiers)


def _pushed_out(engine: LLMEngine, prompt, others, params):
    """Run ``prompt`` cold, then ``others`` (600 tokens through the 384-token pool: the prompt's
    blocks leave it for the tiers); the cold output."""
    (cold,) = engine.generate([prompt], params)
    engine.generate(others, params)
    engine.kv_tiers.wait_idle()
    return cold


def test_engine_serves_an_evicted_prefix_from_host_and_from_disk_exactly(tiny_llama, tmp_path):
    prompt, *others = random_prompts((200, 300, 300), seed=7)
    expected = hf_greedy(tiny_llama, tuple(prompt), 8)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for tiers in ({"host_kv_gib": 0.01}, {"disk_kv_gib": 0.01, "disk_kv_path": str(tmp_path / "d")}):
        engine = _engine(tiny_llama, tmp_path, **tiers)
        try:
            cold = _pushed_out(engine, prompt, others, params)
            assert cold.token_ids == expected and cold.num_cached_tokens == 0
            assert engine.block_manager.find_cached_prefix(_seq(prompt)).num_tokens == 0
            (warm,) = engine.generate([prompt], params)
            assert warm.token_ids == expected
            assert warm.num_cached_tokens == 192  # 12 full blocks, the last token computed
            stats = engine.stats()
            assert (stats.host_hits if "host_kv_gib" in tiers else stats.disk_hits) == 12
            assert stats.tier_loads == 1 and stats.num_loading == 0
            engine.check_idle()
        finally:
            engine.close()


def test_engine_restarted_serves_its_persisted_prefix_from_disk(tiny_llama, tmp_path):
    prompt = random_prompts((150,), seed=3)[0]
    tiers = {"disk_kv_gib": 0.01, "disk_kv_path": str(tmp_path)}
    params = SamplingParams(max_tokens=6, temperature=0.0)
    first = _engine(tiny_llama, tmp_path, **tiers)
    (cold,) = first.generate([prompt], params)
    first.kv_tiers.wait_idle()
    first.close()
    second = _engine(tiny_llama, tmp_path, **tiers)
    try:
        announced = [e for e in second.take_events() if isinstance(e, BlockStored) and e.medium == DISK]
        assert sum(len(e.block_hashes) for e in announced) == 9
        (warm,) = second.generate([prompt], params)
        assert warm.token_ids == cold.token_ids == hf_greedy(tiny_llama, tuple(prompt), 6)
        assert warm.num_cached_tokens == 144
        second.check_idle()
    finally:
        second.close()


def test_quantized_cache_blocks_come_back_with_their_scales(tiny_llama, tmp_path):
    prompt, *others = random_prompts((200, 300, 300), seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    plain = _engine(tiny_llama, tmp_path, kv_cache_dtype="int8")
    (expected,) = plain.generate([prompt], params)
    plain.close()
    engine = _engine(tiny_llama, tmp_path, kv_cache_dtype="int8", host_kv_gib=0.01)
    try:
        _pushed_out(engine, prompt, others, params)
        (warm,) = engine.generate([prompt], params)
        assert warm.num_cached_tokens == 192 and warm.token_ids == expected.token_ids
    finally:
        engine.close()


def test_tiers_are_refused_up_front_when_they_cannot_be(tiny_llama, tmp_path):
    import pytest

    with pytest.raises(ValueError, match="disk_kv_path"):
        LLMEngine(tiny_llama, num_kv_blocks=8, disk_kv_gib=1.0)
    with pytest.raises(ValueError, match="host_kv_gib=.* does not fit"):
        LLMEngine(tiny_llama, num_kv_blocks=8, host_kv_gib=100000.0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLMEngine(tiny_llama, num_kv_blocks=8, host_kv_gib=0.01, enable_prefix_caching=False)


def test_a_load_holds_the_device_cached_prefix_it_extends():
    layers = _layers(4)
    tiers = _tiers(layers, host=8)
    bm = BlockManager(4, BLOCK, MODEL_KEY, tiers=tiers)
    try:
        first = _seq(range(4 * BLOCK + 1), "a")
        assert bm.allocate_slots(first, first.num_tokens - 1)  # the 4 full blocks
        first.num_computed_tokens = 4 * BLOCK
        bm.cache_full_blocks(first)
        table = list(first.block_table)
        bm.free(first)  # all four cached and free; blocks 3, 2 first in line for reuse
        tiers.wait_idle()
        other = _seq(range(1000, 1000 + 2 * BLOCK), "b")
        assert bm.allocate_slots(other, other.num_tokens)  # evicts the chain's last two blocks
        other.num_computed_tokens = other.num_tokens
        bm.cache_full_blocks(other)
        bm.free(other)  # cached too, behind the chain's first two in line for reuse
        again = _seq(range(4 * BLOCK + 1), "c")
        cached = bm.find_cached_prefix(again)
        assert [b.block_id for b in cached.blocks] == table[:2]
        metas = bm.find_in_tiers(again, cached)
        assert len(metas) == 2
        job = bm.start_load(metas, cached)
        # other's blocks, not the first in line: the cached two the load extends
        assert job is not None and sorted(job.block_ids) == sorted(table[2:])
        assert job.done.wait(10)
        bm.finish_loads()
        assert bm.find_cached_prefix(again).num_tokens == 4 * BLOCK
        bm.check_idle()
    finally:
        tiers.close()


def test_a_request_aborted_while_its_blocks_load_leaves_none_held(tiny_llama, tmp_path):
    prompt, *others = random_prompts((200, 300, 300), seed=5)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine = _engine(tiny_llama, tmp_path, host_kv_gib=0.01)
    try:
        _pushed_out(engine, prompt, others, params)
        engine.scheduler.idle_load_s = 0.0  # no waiting within the step: the load stays under way
        engine.add_request("back", prompt, params)
        assert engine.step() == []  # its load started; it waits, nothing else runs
        assert engine.stats().num_loading == 1
        engine.abort("back")
        assert engine.has_unfinished()  # the load's blocks still to settle
        while engine.has_unfinished():
            engine.step()
        assert engine.stats().num_free_blocks == engine.num_kv_blocks
        engine.check_idle()
    finally:
        engine.close()


def test_a_short_load_joins_the_step_that_started_it(tiny_llama, tmp_path):
    prompt, *others = random_prompts((200, 300, 300), seed=5)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine = _engine(tiny_llama, tmp_path, host_kv_gib=0.01)
    try:
        cold = _pushed_out(engine, prompt, others, params)
        engine.add_request("back", prompt, params)
        (first,) = engine.step()  # loaded (the engine was idle: nobody waited) and prefilled at once
        assert first.token_ids == cold.token_ids[:1] and engine.stats().host_hits == 12
        while engine.has_unfinished():
            engine.step()
        engine.check_idle()
    finally:
        engine.close()


def test_evicting_a_block_the_thread_is_copying_waits_for_the_copy():
    import threading

    layers = _layers(4)
    tiers = _tiers(layers, host=4)
    meta = _meta(0)
    try:
        with tiers._lock:
            tiers._copying.add(1)  # as the tier thread marks a batch it copies outside the lock
        evicting = threading.Thread(target=tiers.evict, args=(1, meta))
        evicting.start()
        evicting.join(0.3)
        assert evicting.is_alive()  # the device block must not be handed out mid-copy
        with tiers._lock:
            tiers._copying.clear()
            tiers._copied.notify_all()
        evicting.join(5)
        assert not evicting.is_alive() and tiers.held()[HOST] == [meta.block_hash]
    finally:
        tiers.close()
