"""The publisher's per-medium bookkeeping, in memory: which best tier each held block is indexed
under, and which events cost Redis a write (tests/integration/test_index.py checks what lands
in a real redis-server)."""

from __future__ import annotations

import logging

from kvstore.config import IndexConfig, WorkerSpec
from kvstore.events import DISK, HOST, AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.hashing import hash_prompt_blocks
from kvstore.publisher import IndexPublisher
from kvstore.record import PrefixMatch

BLOCK = 16
A, B, C, D = hash_prompt_blocks(list(range(4 * BLOCK)), BLOCK, "tiny-llama")


def publisher() -> IndexPublisher:
    # Never started: nothing connects, submit() only records and queues.
    config = IndexConfig(redis_url="redis://127.0.0.1:1/0", model_key="tiny-llama")
    spec = WorkerSpec(
        worker_id="w", role="prefill", address="w:9000", total_blocks=64, block_size=BLOCK, kv_cache_dtype="bfloat16"
    )
    return IndexPublisher(config, spec)


def test_a_block_is_indexed_under_the_best_tier_that_still_holds_it() -> None:
    p = publisher()
    p.submit([BlockStored((A, B), None)])
    assert p.held_tiers() == {A: "device", B: "device"}
    assert p.buffered_events == 1

    p.submit([BlockStored((A, B), A, medium=HOST)])  # host copies: device is still the best tier
    assert p.held_tiers() == {A: "device", B: "device"}
    assert p.buffered_events == 1  # nothing for Redis to change

    p.submit([BlockRemoved((B,))])  # evicted from device, the host copy remains
    assert p.held_tiers() == {A: "device", B: "host"}
    assert p.held_blocks() == frozenset({A, B})
    assert p.buffered_events == 2

    p.submit([BlockRemoved((B,), medium=HOST)])
    assert p.held_tiers() == {A: "device"}
    assert p.held_blocks() == frozenset({A})
    assert p.buffered_events == 3

    p.submit([BlockRemoved((B,), medium=HOST)])  # already gone: no change, no write
    assert p.buffered_events == 3


def test_disk_only_blocks_move_up_and_down_the_tiers() -> None:
    p = publisher()
    p.submit([BlockStored((C, D), None, medium=DISK)])
    assert p.held_tiers() == {C: "disk", D: "disk"}
    p.submit([BlockStored((C,), None, medium=HOST)])  # loaded back into host memory
    assert p.held_tiers() == {C: "host", D: "disk"}
    p.submit([BlockStored((C,), None)])
    assert p.held_tiers() == {C: "device", D: "disk"}
    p.submit([BlockRemoved((C,)), BlockRemoved((C,), medium=HOST)])  # the disk copy answers again
    assert p.held_tiers() == {C: "disk", D: "disk"}
    p.submit([BlockRemoved((C, D), medium=DISK)])
    assert p.held_tiers() == {}
    assert p.buffered_events == 6  # one write per best-tier change


def test_clear_drops_every_tier_and_supersedes_what_was_queued() -> None:
    p = publisher()
    p.submit([BlockStored((A,), None), BlockStored((B,), A, medium=HOST), BlockStored((C,), B, medium=DISK)])
    assert p.buffered_events == 3
    p.submit([AllBlocksCleared()])
    assert p.held_tiers() == {}
    assert p.buffered_events == 1  # the clear alone
    p.submit([BlockStored((A,), None, medium=DISK)])
    assert p.held_tiers() == {A: "disk"}


def test_an_unknown_medium_is_skipped_and_logged_once(caplog) -> None:
    p = publisher()
    with caplog.at_level(logging.ERROR, logger="kvstore"):
        p.submit([BlockStored((A,), None, medium="tape"), BlockStored((B,), None, medium="tape")])
        p.submit([BlockRemoved((A,), medium="tape"), BlockStored((C,), None)])
    assert p.held_tiers() == {C: "device"}
    assert [r.getMessage() for r in caplog.records] == [
        "worker w: block events for unknown medium 'tape' (expected one of device, host, disk) are not indexed"
    ]


def test_prefix_match_device_blocks_are_what_is_not_on_host_or_disk() -> None:
    assert PrefixMatch(10, host=3, disk=2).device == 5
    assert PrefixMatch(4).device == 4
