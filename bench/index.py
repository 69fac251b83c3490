"""Lookup latency of the Redis prefix index: ``python bench/index.py [--lookups N]``.

Starts its own redis-server on a free port, loads 8 workers holding ~100k blocks in total
(chains that share system-prompt prefixes, published through the real IndexPublisher), then
times ``PrefixIndex.longest_prefix`` for 256-block prompts, one call at a time, end to end
(hashing the prompt is not included: the ingress does that once anyway).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import redis.asyncio as aioredis  # noqa: E402

from kvstore.config import IndexConfig, WorkerSpec  # noqa: E402
from kvstore.events import BlockStored  # noqa: E402
from kvstore.hashing import hash_prompt_blocks  # noqa: E402
from kvstore.index import PrefixIndex  # noqa: E402
from kvstore.publisher import IndexPublisher  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

MODEL = "bench-model"
BLOCK_SIZE = 16
NUM_WORKERS = 8
PROMPT_BLOCKS = 256
PREFIX_BLOCKS = 128  # a shared system prompt
NUM_PREFIXES = 16
PREFIXES_PER_WORKER = 4
CHAINS_PER_WORKER = 91  # each: one of its prefixes + 128 blocks of its own


def tokens(rng: random.Random, n_blocks: int) -> list[int]:
    return [rng.randrange(32000) for _ in range(n_blocks * BLOCK_SIZE)]


def build_workload(rng: random.Random):
    prefixes = [tokens(rng, PREFIX_BLOCKS) for _ in range(NUM_PREFIXES)]
    hot = tokens(rng, PROMPT_BLOCKS)  # one prompt every worker holds in full: the costliest hit
    held: list[list[list[int]]] = []  # per worker, the token lists of the chains it holds
    for w in range(NUM_WORKERS):
        mine = [prefixes[(2 * w + i) % NUM_PREFIXES] for i in range(PREFIXES_PER_WORKER)]
        chains = [rng.choice(mine) + tokens(rng, PROMPT_BLOCKS - PREFIX_BLOCKS) for _ in range(CHAINS_PER_WORKER)]
        held.append([hot, *chains])
    return held


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def time_lookups(
    index: PrefixIndex, admin: aioredis.Redis, prompts: list[list[bytes]], n: int
) -> tuple[list[float], list[float]]:
    """End-to-end milliseconds per lookup, and Redis's own script time (SLOWLOG) in ms."""
    for prompt in prompts[:50]:  # warm up: script cache, connection
        await index.longest_prefix(prompt)
    await admin.slowlog_reset()
    samples = []
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        t0 = time.perf_counter()
        result = await index.longest_prefix(prompt)
        samples.append((time.perf_counter() - t0) * 1000)
        assert result is not None and len(result) == NUM_WORKERS
    server = [e["duration"] / 1000 for e in await admin.slowlog_get(n + 1000) if e["command"].startswith(b"EVALSHA")]
    return samples, server


async def main(num_lookups: int) -> None:
    rng = random.Random(0)
    held = build_workload(rng)
    with RedisServer() as server:
        config = IndexConfig(
            redis_url=server.url, model_key=MODEL, max_batch_events=16, write_timeout_s=10.0, lookup_timeout_s=1.0
        )
        publishers = []
        total_blocks = 0
        t0 = time.perf_counter()
        chains: list[list[bytes]] = []
        for w, token_lists in enumerate(held):
            publisher = IndexPublisher(
                config,
                WorkerSpec(
                    worker_id=f"prefill-{w}",
                    role="prefill",
                    address=f"10.0.0.{w}:9000",
                    total_blocks=20_000,
                    block_size=BLOCK_SIZE,
                    kv_cache_dtype="bfloat16",
                ),
            )
            await publisher.start()
            for toks in token_lists:
                chain = hash_prompt_blocks(toks, BLOCK_SIZE, MODEL)
                chains.append(chain)
                publisher.submit([BlockStored(tuple(chain), None)])
            assert await publisher.flush()
            total_blocks += len(publisher.held_blocks())
            publishers.append(publisher)
        load_s = time.perf_counter() - t0

        index = PrefixIndex(config)
        admin = aioredis.Redis.from_url(server.url)
        await admin.config_set("slowlog-log-slower-than", 0)  # log every command with its time
        await admin.config_set("slowlog-max-len", num_lookups + 1000)
        hits = chains[1:]  # one worker holds all 256 blocks, the workers sharing its prefix 128
        hot = [chains[0]]  # all 8 workers hold all 256 blocks: 8 x 256 entries checked
        misses = [hash_prompt_blocks(tokens(rng, PROMPT_BLOCKS), BLOCK_SIZE, MODEL) for _ in range(50)]
        rng.shuffle(hits)
        print(
            f"redis-server {server.port}: {NUM_WORKERS} workers, {total_blocks} blocks held in "
            f"total (loaded in {load_s:.1f}s); {num_lookups} lookups of {PROMPT_BLOCKS}-block "
            "prompts, one at a time"
        )
        print(
            "command: EVALSHA <sha1 of kvstore.lua.LONGEST_PREFIX> 1 <registry key> "
            f"<worker key prefix> <role> <blk key prefix> <{PROMPT_BLOCKS} hashes as one "
            f"{PROMPT_BLOCKS * 32}-char hex string>  (one round trip)"
        )
        print(
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
            "(end to end includes the client; 'in Redis' is the script's own run time)"
        )
        for name, prompts in (("typical hit", hits), ("all 8 hold all 256", hot), ("miss", misses)):
            samples, in_redis = await time_lookups(index, admin, prompts, num_lookups)
            print(
                f"  {name:<20} end to end p50 {statistics.median(samples):.3f} ms  "
                f"p99 {percentile(samples, 0.99):.3f} ms   in Redis p50 "
                f"{statistics.median(in_redis):.3f} ms  p99 {percentile(in_redis, 0.99):.3f} ms"
            )
        await admin.aclose()
        await index.close()
        for publisher in publishers:
            await publisher.stop(deregister=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=2000)
    asyncio.run(main(parser.parse_args().lookups))
