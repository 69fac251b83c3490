"""What a streamed token costs in Ray: an actor's async generator yields small token dicts to an
async consumer, one token per item (how a pdserve worker streams a request today) and several
tokens per item (one item per engine step carrying a batch's tokens), side by side in one run.

    python bench/ray_stream.py                       # 4000 tokens, 8 per batched item, 2 rounds
    python bench/ray_stream.py --tokens 2000 --per-item 4 --rounds 3

Each line gives the wall time and the CPU time (user + system, ``getrusage``) of the producer
actor's process and of this process (the consumer, Ray's own driver threads included) per token.
docs/design.md ("What a streamed token costs") uses these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import sys
import time
from typing import Any

import ray


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@ray.remote(num_cpus=0)
class Producer:
    async def per_token(self, n: int):
        for i in range(n):
            yield {"request_id": "r0", "token_ids": [i], "text": "x"}

    async def batched(self, n: int, per_item: int):
        for i in range(n // per_item):
            yield [{"request_id": f"r{j}", "token_ids": [i], "text": "x"} for j in range(per_item)]

    def cpu_s(self) -> float:
        return _cpu_s()


async def _consume(stream: Any) -> int:
    items = 0
    async for ref in stream:
        await ref
        items += 1
    return items


def measure(producer: Any, kind: str, tokens: int, per_item: int) -> dict[str, float]:
    produced0, consumed0, start = ray.get(producer.cpu_s.remote()), _cpu_s(), time.perf_counter()
    if kind == "per-token":
        stream = producer.per_token.options(num_returns="streaming").remote(tokens)
    else:
        stream = producer.batched.options(num_returns="streaming").remote(tokens, per_item)
    items = asyncio.run(_consume(stream))
    wall = time.perf_counter() - start
    produced, consumed = ray.get(producer.cpu_s.remote()) - produced0, _cpu_s() - consumed0
    return {
        "items": items,
        "wall_ms_per_token": 1000 * wall / tokens,
        "producer_cpu_ms_per_token": 1000 * produced / tokens,
        "consumer_cpu_ms_per_token": 1000 * consumed / tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--per-item", type=int, default=8, help="tokens per item of the batched stream")
    p.add_argument("--rounds", type=int, default=2)
    opts = p.parse_args(argv)
    if opts.tokens % opts.per_item:
        p.error("--tokens must be a multiple of --per-item")
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
    try:
        producer = Producer.remote()
        ray.get(producer.cpu_s.remote())
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
        print(f"# {machine}, Ray {ray.__version__}, Python {platform.python_version()}")
        print(f"# {opts.tokens} tokens a stream; batched: {opts.per_item} tokens an item")
        print(f"{'round':>5} {'stream':>10} {'items':>6} {'wall ms/tok':>12} {'producer cpu':>13} {'consumer cpu':>13}")
        for round_ in range(1, opts.rounds + 1):
            for kind in ("per-token", "batched"):
                r = measure(producer, kind, opts.tokens, opts.per_item)
                print(
                    f"{round_:>5} {kind:>10} {r['items']:>6.0f} {r['wall_ms_per_token']:>12.3f} "
                    f"{r['producer_cpu_ms_per_token']:>13.3f} {r['consumer_cpu_ms_per_token']:>13.3f}"
                )
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
