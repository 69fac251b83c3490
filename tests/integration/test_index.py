"""The Redis prefix index against a real redis-server: lookups, generations, purge, outages."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest
import redis

from deploy.pools.routers import PrefixAwareRouter
from kvstore.compat import IncompatibleWorkerError
from kvstore.config import IndexConfig, WorkerSpec
from kvstore.events import DISK, HOST, AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.hashing import hash_prompt_blocks
from kvstore.index import PrefixIndex
from kvstore.keys import IndexKeys
from kvstore.link import IndexAuthError
from kvstore.publisher import IndexPublisher
from kvstore.record import PrefixMatch
from tests.redis_server import RedisServer, free_port

MODEL = "tiny-llama"
BLOCK = 16
KEYS = IndexKeys(MODEL)
HOST_TIER, DISK_TIER = "1", "2"  # wtier values (kvstore.keys)


def make_config(url: str, **overrides: object) -> IndexConfig:
    fast = dict(
        heartbeat_interval_s=0.2,
        ttl_s=0.6,
        lookup_timeout_s=0.05,
        write_timeout_s=1.0,
        purge_interval_s=60.0,
        reconnect_backoff_s=0.02,
        reconnect_backoff_max_s=0.2,
    )
    fast.update(overrides)
    return IndexConfig(redis_url=url, model_key=MODEL, **fast)  # type: ignore[arg-type]


def spec(
    worker_id: str, role: str = "prefill", block_size: int = BLOCK, kv_cache_dtype: str = "bfloat16"
) -> WorkerSpec:
    return WorkerSpec(
        worker_id=worker_id,
        role=role,
        address=f"{worker_id}:9000",
        total_blocks=1000,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
    )


def chain(tokens: list[int]) -> list[bytes]:
    return hash_prompt_blocks(tokens, BLOCK, MODEL)


PROMPT = chain(list(range(10 * BLOCK)))  # 10 blocks
# Shares PROMPT's first 2 blocks, then diverges.
BRANCH = chain(list(range(2 * BLOCK)) + [7] * (8 * BLOCK))
assert PROMPT[:2] == BRANCH[:2] and PROMPT[2] != BRANCH[2]


async def started(config: IndexConfig, worker: WorkerSpec, *stored: list[bytes]) -> IndexPublisher:
    publisher = IndexPublisher(config, worker)
    await publisher.start()
    publisher.submit(BlockStored(tuple(hashes), None) for hashes in stored)
    assert await publisher.flush()
    return publisher


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s}s"
        await asyncio.sleep(0.05)


def blk_entries(client: redis.Redis, block_hash: bytes) -> dict[str, str]:
    return client.hgetall(KEYS.blk(block_hash))


async def test_longest_prefix_for_overlapping_chains(redis_url: str) -> None:
    config = make_config(redis_url)
    a = await started(config, spec("a"), PROMPT[:8])
    b = await started(config, spec("b"), PROMPT[:4], PROMPT[5:8])  # gap at block 4
    c = await started(config, spec("c", role="decode"), BRANCH[:6])
    index = PrefixIndex(config)
    assert await index.start()
    try:
        assert await index.longest_prefix(PROMPT) == {"a": 8, "b": 4, "c": 2}
        assert await index.longest_prefix(BRANCH) == {"a": 2, "b": 2, "c": 6}
        assert await index.longest_prefix(PROMPT, role="prefill") == {"a": 8, "b": 4}
        assert await index.longest_prefix(chain([3] * 64)) == {"a": 0, "b": 0, "c": 0}
        assert await index.longest_prefix([]) == {"a": 0, "b": 0, "c": 0}

        a.submit([BlockRemoved((PROMPT[3],))])
        c.submit([AllBlocksCleared()])
        assert await a.flush() and await c.flush()
        assert await index.longest_prefix(PROMPT) == {"a": 3, "b": 4, "c": 0}

        b.set_load(free_blocks=600, num_running=3, num_waiting=1)
        await wait_until(lambda: _free_blocks_of(index, "b", 600), timeout_s=2.0)
        records = await index.live_workers(role="prefill")
        assert records is not None and sorted(records) == ["a", "b"]
        rec = records["b"]
        assert (rec.role, rec.address, rec.generation, rec.total_blocks, rec.block_size) == (
            "prefill",
            "b:9000",
            b.generation,
            1000,
            BLOCK,
        )
        assert (rec.free_blocks, rec.num_running, rec.num_waiting) == (600, 3, 1)
        assert rec.kv_cache_usage == pytest.approx(0.4)
    finally:
        for publisher in (a, b, c):
            await publisher.stop()
        await index.close()
    with redis.Redis.from_url(redis_url, decode_responses=True) as raw:
        assert raw.keys(f"{KEYS.prefix}blk:*") == []  # orderly leave removes every entry


async def _free_blocks_of(index: PrefixIndex, worker_id: str, free_blocks: int) -> bool:
    records = await index.live_workers()
    return records is not None and records[worker_id].free_blocks == free_blocks


async def test_restarted_worker_gets_new_generation_and_stale_entries_do_not_count(
    redis_url: str,
) -> None:
    config = make_config(redis_url)
    old = await started(config, spec("w"), PROMPT[:6])
    await old.stop(deregister=False)  # crashed: its record and entries stay behind
    new = await started(config, spec("w"), PROMPT[:2])
    index = PrefixIndex(config)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert new.generation != old.generation
        assert await index.longest_prefix(PROMPT) == {"w": 2}
        assert blk_entries(raw, PROMPT[5]) == {}  # the new start dropped the old entries
        # An entry of another generation (e.g. written late by the dead process) never counts.
        raw.hset(KEYS.blk(PROMPT[2]), "w", old.generation)
        assert await index.longest_prefix(PROMPT) == {"w": 2}
        new.submit([BlockStored(tuple(PROMPT[2:4]), PROMPT[1])])
        assert await new.flush()
        assert await index.longest_prefix(PROMPT) == {"w": 4}
        assert blk_entries(raw, PROMPT[2]) == {"w": new.generation}
        assert raw.smembers(KEYS.wblocks("w")) == {h.hex() for h in PROMPT[:4]}
    finally:
        await new.stop()
        await index.close()
        raw.close()


async def test_old_process_of_a_restarted_worker_cannot_write(redis_url: str) -> None:
    config = make_config(redis_url)
    old = await started(config, spec("w"), PROMPT[:1])
    new = await started(config, spec("w"), PROMPT[:2])  # same id while the old one still runs
    index = PrefixIndex(config)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        old.submit([BlockStored(tuple(PROMPT[1:8]), PROMPT[0])])
        assert not await old.flush()  # fenced: the record carries the new generation
        assert await index.longest_prefix(PROMPT) == {"w": 2}
        assert raw.smembers(KEYS.wblocks("w")) == {h.hex() for h in PROMPT[:2]}
        assert blk_entries(raw, PROMPT[5]) == {}
        await old.stop()  # deregistering must not remove the new process's entries
        assert await index.longest_prefix(PROMPT) == {"w": 2}
    finally:
        await new.stop()
        await index.close()
        raw.close()


async def test_killed_worker_stops_counting_at_expiry_and_is_purged(redis_url: str) -> None:
    config = make_config(redis_url, ttl_s=0.6)
    killed = await started(config, spec("k"), PROMPT[:5])
    alive = await started(config, spec("l"), PROMPT[:3])
    index = PrefixIndex(config)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert await index.longest_prefix(PROMPT) == {"k": 5, "l": 3}
        await killed.stop(deregister=False)
        await wait_until(lambda: _equals(index.longest_prefix(PROMPT), {"l": 3}), timeout_s=3.0)
        # Ignored before any purge: its entries are still there.
        assert blk_entries(raw, PROMPT[0]) == {"k": killed.generation, "l": alive.generation}

        assert await index.purge_dead_workers() == ["k"]
        assert blk_entries(raw, PROMPT[0]) == {"l": alive.generation}
        assert raw.exists(KEYS.blk(PROMPT[3]), KEYS.blk(PROMPT[4]), KEYS.wblocks("k")) == 0
        assert raw.hgetall(KEYS.registry) == {"l": alive.generation}
        assert await index.purge_dead_workers() == []

        # A live publisher sweeps on its own, too.
        sweeper = await started(make_config(redis_url, purge_interval_s=0.2), spec("s"))
        await alive.stop(deregister=False)
        await wait_until(lambda: _no_key(raw, KEYS.wblocks("l")), timeout_s=4.0)
        assert raw.keys(f"{KEYS.prefix}blk:*") == []
        assert raw.hgetall(KEYS.registry) == {"s": sweeper.generation}
        await sweeper.stop()
    finally:
        await index.close()
        raw.close()


async def _equals(result: Awaitable[object], expected: object) -> bool:
    return await result == expected


async def _no_key(raw: redis.Redis, key: str) -> bool:
    return raw.exists(key) == 0


async def test_redis_killed_then_restarted_empty(make_redis_server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvstore")
    server: RedisServer = make_redis_server()
    config = make_config(server.url, ttl_s=1.0)
    publisher = await started(config, spec("w"), PROMPT[:4])
    index = PrefixIndex(config)
    try:
        assert await index.longest_prefix(PROMPT) == {"w": 4}
        server.kill()
        for _ in range(5):
            assert await index.longest_prefix(PROMPT) is None
            assert await index.live_workers() is None
        publisher.submit([BlockStored(tuple(PROMPT[4:6]), PROMPT[3])])  # never raises
        publisher.submit([BlockRemoved((PROMPT[0],))])
        await asyncio.sleep(0.3)  # the publisher notices and backs off
        assert publisher.buffered_events >= 1
        assert publisher.held_blocks() == frozenset(PROMPT[1:6])
        lost = [r for r in caplog.records if "lost" in r.getMessage()]
        assert len(lost) == 2  # one line per link (index, publisher), not one per call

        server.restart()  # empty: no record, no blocks, no scripts
        await wait_until(lambda: _equals(index.longest_prefix(PROMPT[1:]), {"w": 5}), 5.0)
        assert await index.longest_prefix(PROMPT) == {"w": 0}  # block 0 was removed meanwhile
        assert publisher.buffered_events == 0
        regained = [r for r in caplog.records if "regained" in r.getMessage()]
        assert len(regained) == 2
    finally:
        await publisher.stop()
        await index.close()


async def test_slow_redis_lookup_answers_none_within_deadline(redis_url: str) -> None:
    config = make_config(redis_url)
    publisher = await started(config, spec("w"), PROMPT[:3])
    index = PrefixIndex(config)
    raw = redis.Redis.from_url(redis_url)
    try:
        # Connected and answering first, so that the paused call below is the lookup itself. The
        # pause is long (3 s against a 50 ms deadline): on a loaded machine the lookup must still
        # reach Redis while it is paused (a 400 ms pause once ended before it did, in CI).
        await wait_until(lambda: _equals(index.longest_prefix(PROMPT), {"w": 3}), 5.0)
        raw.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        # Redis answers {"w": 3} once the pause ends: None proves the lookup gave up at its deadline.
        assert await index.longest_prefix(PROMPT) is None
        await wait_until(lambda: _equals(index.longest_prefix(PROMPT), {"w": 3}), 10.0)
    finally:
        await publisher.stop()
        await index.close()
        raw.close()


async def test_buffer_drops_oldest_while_redis_is_away_then_republishes() -> None:
    server = RedisServer(port=free_port())  # not started yet: Redis is away at worker start
    config = make_config(server.url, max_buffered_events=4)
    publisher = IndexPublisher(config, spec("w"))
    await publisher.start()  # does not raise: the worker serves without the index
    try:
        publisher.submit(BlockStored((h,), None) for h in PROMPT)
        assert (publisher.buffered_events, publisher.dropped_events) == (4, 6)
        server.start()
        index = PrefixIndex(config)
        await wait_until(lambda: _equals(index.longest_prefix(PROMPT), {"w": 10}), 5.0)
        await index.close()
    finally:
        await publisher.stop()
        server.stop()


async def test_compatibility_check_refuses_mismatched_block_size(redis_url: str) -> None:
    config = make_config(redis_url)
    first = await started(config, spec("a", block_size=16))
    try:
        with pytest.raises(
            IncompatibleWorkerError,
            match="block_size 32 on this worker but 16 in the pool: start every worker with the same --block-size",
        ):
            await IndexPublisher(config, spec("b", block_size=32)).start()
        with pytest.raises(IncompatibleWorkerError, match="kv_cache_dtype float16 on this worker"):
            await IndexPublisher(config, spec("c", kv_cache_dtype="float16")).start()
        same = await started(config, spec("d", block_size=16))
        index = PrefixIndex(config)
        assert sorted(await index.live_workers() or {}) == ["a", "d"]  # refused ones never joined
        await index.close()
        await same.stop()
    finally:
        await first.stop()


async def test_password_protected_redis(make_redis_server) -> None:
    server: RedisServer = make_redis_server(password="s3cret")
    assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
    publisher = await started(make_config(server.url), spec("w"), PROMPT[:3])
    index = PrefixIndex(make_config(server.url))
    assert await index.start()
    assert await index.longest_prefix(PROMPT) == {"w": 3}
    await index.close()
    await publisher.stop()

    wrong = make_config(f"redis://:nope@127.0.0.1:{server.port}/0")
    with pytest.raises(IndexAuthError, match="refused the credentials"):
        await IndexPublisher(wrong, spec("x")).start()
    wrong_index = PrefixIndex(wrong)
    with pytest.raises(IndexAuthError, match="redis://:\\*\\*\\*@127.0.0.1"):  # password redacted
        await wrong_index.start()
    await wrong_index.close()


async def test_256_block_lookup_is_one_round_trip(redis_url: str) -> None:
    config = make_config(redis_url, ttl_s=3.0)
    long_prompt = chain(list(range(256 * BLOCK)))
    index = PrefixIndex(config)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        publishers = [await started(config, spec(f"w{i}"), long_prompt[: 256 - 64 * i]) for i in range(3)]
        assert await index.longest_prefix(long_prompt) == {"w0": 256, "w1": 192, "w2": 128}
        for p in publishers:
            await p.stop(deregister=False)  # records stay live for ttl_s; no background traffic
        before = raw.info("commandstats")
        total_before = raw.info("stats")["total_commands_processed"]
        assert await index.longest_prefix(long_prompt) == {"w0": 256, "w1": 192, "w2": 128}
        total_after = raw.info("stats")["total_commands_processed"]
        after = raw.info("commandstats")
        delta = {k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"] for k in after}
        # Commands counted after they run: the first INFO stats, one EVALSHA and what the script
        # ran inside Redis (registry, 3 records, the first block's holders, one set probe per
        # holder per chunk of 16, 32, 64, 128... blocks up to its first miss); nothing else
        # crossed the wire.
        assert {k: v for k, v in delta.items() if v} == {
            "cmdstat_info": 3,
            "cmdstat_evalsha": 1,
            "cmdstat_hkeys": 1,
            "cmdstat_hmget": 3,
            "cmdstat_hgetall": 1,
            "cmdstat_smismember": 5 + 4 + 4,
        }
        assert total_after - total_before == 2 + (1 + 3 + 1 + 13)
    finally:
        await index.close()
        raw.close()


# ---------------------------------------------------------------- tiers


def wtier(hashes: list[bytes], tier: str) -> dict[str, str]:
    return {h.hex(): tier for h in hashes}


async def test_prefix_matches_count_each_workers_blocks_by_best_tier(redis_url: str) -> None:
    config = make_config(redis_url)
    a = await started(config, spec("a"), PROMPT[:8])
    b = await started(config, spec("b"))
    index = PrefixIndex(config)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        a.submit(
            [
                BlockStored(tuple(PROMPT[:8]), None, medium=HOST),  # host copies of device blocks
                BlockRemoved(tuple(PROMPT[4:8])),  # evicted from device: the host copies answer
                BlockStored(tuple(PROMPT[8:10]), PROMPT[7], medium=DISK),
            ]
        )
        b.submit([BlockStored(tuple(PROMPT[:3]), None, medium=DISK)])
        assert await a.flush() and await b.flush()
        assert await index.prefix_matches(PROMPT) == {"a": PrefixMatch(10, host=4, disk=2), "b": PrefixMatch(3, disk=3)}
        assert await index.longest_prefix(PROMPT) == {"a": 10, "b": 3}  # any tier
        assert await index.prefix_matches(PROMPT[:6]) == {"a": PrefixMatch(6, host=2), "b": PrefixMatch(3, disk=3)}
        assert raw.hgetall(KEYS.wtier("a")) == {
            **wtier(PROMPT[4:8], HOST_TIER),
            **wtier(PROMPT[8:10], DISK_TIER),
        }
        assert raw.hgetall(KEYS.wtier("b")) == wtier(PROMPT[:3], DISK_TIER)

        a.submit([BlockRemoved(tuple(PROMPT[4:8]), medium=HOST)])  # now in no tier: a gap at block 4
        a.submit([BlockStored(tuple(PROMPT[8:10]), PROMPT[7])])  # back on device: no longer in wtier
        b.submit([AllBlocksCleared()])
        assert await a.flush() and await b.flush()
        assert await index.prefix_matches(PROMPT) == {"a": PrefixMatch(4), "b": PrefixMatch(0)}
        assert blk_entries(raw, PROMPT[4]) == {}
        assert raw.smembers(KEYS.wblocks("a")) == {h.hex() for h in PROMPT[:4] + PROMPT[8:10]}
        assert raw.exists(KEYS.wtier("a"), KEYS.wtier("b"), KEYS.wblocks("b")) == 0
        assert a.held_tiers() == {h: "device" for h in PROMPT[:4] + PROMPT[8:10]}
    finally:
        await a.stop()
        await b.stop()
        await index.close()
        raw.close()
    with redis.Redis.from_url(redis_url, decode_responses=True) as raw:
        assert raw.keys(f"{KEYS.prefix}w*:*") == []  # orderly leave drops wblocks and wtier


async def test_tiers_survive_a_redis_restart_and_a_new_start_drops_the_old_ones(make_redis_server) -> None:
    server: RedisServer = make_redis_server()
    config = make_config(server.url, ttl_s=1.0)
    publisher = await started(config, spec("w"), PROMPT[:2])
    publisher.submit([BlockStored(tuple(PROMPT[2:4]), PROMPT[1], medium=HOST)])
    publisher.submit([BlockStored(tuple(PROMPT[4:6]), PROMPT[3], medium=DISK)])
    assert await publisher.flush()
    index = PrefixIndex(config)
    expected = {"w": PrefixMatch(6, host=2, disk=2)}
    try:
        assert await index.prefix_matches(PROMPT) == expected
        server.restart()  # empty: the publisher re-registers and republishes tiers from memory
        await wait_until(lambda: _equals(index.prefix_matches(PROMPT), expected), 5.0)

        await publisher.stop(deregister=False)  # crashed; a new start of the same id takes over
        new = await started(config, spec("w"), PROMPT[:3])
        assert await index.prefix_matches(PROMPT) == {"w": PrefixMatch(3)}
        with redis.Redis.from_url(server.url, decode_responses=True) as raw:
            assert raw.exists(KEYS.wtier("w")) == 0
        await new.stop()
    finally:
        await index.close()


async def test_purging_a_dead_worker_drops_its_tiers(redis_url: str) -> None:
    config = make_config(redis_url, ttl_s=0.6)
    killed = await started(config, spec("k"))
    killed.submit([BlockStored(tuple(PROMPT[:5]), None, medium=DISK), BlockStored(tuple(PROMPT[:2]), None)])
    assert await killed.flush()
    index = PrefixIndex(config)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert raw.hgetall(KEYS.wtier("k")) == wtier(PROMPT[2:5], DISK_TIER)
        await killed.stop(deregister=False)
        await wait_until(lambda: _equals(index.prefix_matches(PROMPT), {}), timeout_s=3.0)
        assert await index.purge_dead_workers() == ["k"]
        assert raw.keys(f"{KEYS.prefix}*") == []
    finally:
        await index.close()
        raw.close()


async def test_prefix_matches_is_one_round_trip(redis_url: str) -> None:
    config = make_config(redis_url, ttl_s=3.0)
    long_prompt = chain(list(range(1100 * BLOCK)))
    index = PrefixIndex(config)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        device = await started(config, spec("device"), long_prompt[:1100])
        tiered = await started(config, spec("tiered"))
        tiered.submit([BlockStored(tuple(long_prompt[:1050]), None, medium=HOST)])
        tiered.submit([BlockStored(tuple(long_prompt[1000:1050]), long_prompt[999], medium=DISK)])
        tiered.submit([BlockRemoved(tuple(long_prompt[1000:1050]), medium=HOST)])
        tiered.submit([BlockStored(tuple(long_prompt[:10]), None)])
        assert await tiered.flush()
        for p in (device, tiered):
            await p.stop(deregister=False)  # records stay live for ttl_s; no background traffic
        before = raw.info("commandstats")
        matches = await index.prefix_matches(long_prompt)
        after = raw.info("commandstats")
        assert matches == {"device": PrefixMatch(1100), "tiered": PrefixMatch(1050, host=990, disk=50)}
        delta = {k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"] for k in after}
        # One EVALSHA; inside it, per holder one EXISTS on its wtier, and for the holder that has
        # one, an HMGET per 1024 matched blocks.
        assert delta["cmdstat_evalsha"] == 1
        assert (delta["cmdstat_exists"], delta["cmdstat_hmget"]) == (2, 2 + 2)  # 2 records, 2 chunks
    finally:
        await index.close()
        raw.close()


class Replica:
    """What the router reads of Serve's RunningReplica (hashed by identity, like Serve's)."""

    def __init__(self, worker_id: str, **routing_stats: object) -> None:
        self.replica_id = SimpleNamespace(unique_id=worker_id)
        self.routing_stats = routing_stats


async def test_the_prefill_router_weighs_tiers_against_queues(redis_url: str) -> None:
    config = make_config(redis_url)
    on_disk = await started(config, spec("on_disk"))
    on_disk.submit([BlockStored(tuple(PROMPT), None, medium=DISK)])
    assert await on_disk.flush()
    on_device = await started(config, spec("on_device"), PROMPT)
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)  # the policy alone, without Serve's machinery
    router.initialize_state(redis_url=redis_url, model_key=MODEL, min_match_blocks=2, imbalance_threshold=8)
    request = SimpleNamespace(args=[SimpleNamespace(block_hashes=PROMPT)])

    try:
        # The device holder waits behind 6 requests (0.3 s); the disk holder loads 10 blocks (10 ms).
        ranks = await router.choose_replicas([Replica("on_device", num_running=6), Replica("on_disk")], request)
        assert [rank[0].replica_id.unique_id for rank in ranks] == ["on_disk", "on_device"]
        # Its disk is slow (it says so): 10 x 50 ms to load is worse than the queue.
        slow = Replica("on_disk", disk_load_block_s=0.05)
        ranks = await router.choose_replicas([Replica("on_device", num_running=6), slow], request)
        assert [rank[0].replica_id.unique_id for rank in ranks] == ["on_device", "on_disk"]
        assert router.decisions == {"prefix": 2, "load": 0}
    finally:
        assert router._index is not None
        await router._index.close()
        await on_disk.stop()
        await on_device.stop()
