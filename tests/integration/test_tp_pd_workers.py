"""Prefill and decode workers of different tensor-parallel sizes wired directly (no Ray): every
rank runs in its own process (the local launcher), the decode worker's ranks pull exactly their
KV heads from the prefill ranks that hold them, one gloo pair group per rank pair, and decoding
continues over the decode ranks. Output equals transformers' greedy output token for token, and
each decode rank received exactly its heads' share of the blocks that moved."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import pytest

from kvstore.hashing import hash_prompt_blocks
from tests.integration.test_pd_workers import run, wait_idle
from tests.unit.engine_helpers import hf_greedy, random_prompts
from workers.decode import DecodeWorker
from workers.engine import LLMEngine
from workers.prefill import PrefillWorker
from workers.protocol import GenerateRequest
from workers.transfer import TransferConfig
from workers.transfer.tp_plan import heads_of_rank, plan_tp_transfer

pytestmark = pytest.mark.timeout(300)
BLOCK = 16


def request(rid: str, prompt: list[int], max_tokens: int = 24) -> GenerateRequest:
    hashes = tuple(hash_prompt_blocks(prompt, BLOCK, "m"))
    return GenerateRequest(
        rid, tuple(prompt), {"max_tokens": max_tokens, "temperature": 0.0}, None, hashes, time.time()
    )


@contextlib.asynccontextmanager
async def make_pools(model_dir: str, prefill_tp: int, decode_tp: int, device: str = "cpu", timeout_s: float = 20.0):
    """A prefill and a decode worker of those sizes; on the way out every block must be free."""
    cfg = TransferConfig(transfer_timeout_s=timeout_s, connect_timeout_s=timeout_s)

    def engine(tp: int) -> LLMEngine:
        return LLMEngine(
            model_dir,
            num_kv_blocks=96,
            block_size=BLOCK,
            tensor_parallel_size=tp,
            device=device,
            dtype="float32",
            load_progress=False,
            attention_backend="sdpa",  # auto's paged kernel would compile in each worker process
        )

    prefill = PrefillWorker(engine(prefill_tp), "prefill-0", cfg, lease_ttl_s=20.0)
    await prefill.start()
    decode = DecodeWorker(engine(decode_tp), "decode-0", cfg)
    yield prefill, decode
    try:
        for worker in (prefill, decode):
            await worker.loop.call(lambda e: e.block_manager.check_idle())  # free == total blocks
    finally:
        for worker in (prefill, decode):
            await worker.shutdown()
            worker.engine.close()


@pytest.fixture
async def pools(request, tiny_llama):
    async with make_pools(tiny_llama, *request.param) as workers:
        yield workers


# The tiny llama has 4 query and 2 KV heads: at TP 4 each KV head lives on two ranks.
SIZES = [(1, 2), (2, 1), (2, 2), (4, 2), (2, 4)]


@pytest.mark.parametrize("pools", SIZES, indirect=True, ids=[f"p{p}-d{d}" for p, d in SIZES])
async def test_mixed_tensor_parallel_pools_equal_transformers_and_move_each_ranks_heads(pools, tiny_llama):
    await check_exact_and_per_rank_bytes(*pools, tiny_llama)


async def check_exact_and_per_rank_bytes(prefill: PrefillWorker, decode: DecodeWorker, model_dir: str) -> None:
    tiny_llama = model_dir
    prompts = random_prompts((5, 37, 70, 129), seed=77)
    results = await asyncio.gather(*(run(prefill, decode, request(f"r{i}", p)) for i, p in enumerate(prompts)))
    for prompt, tokens in zip(prompts, results):
        assert tokens == hf_greedy(tiny_llama, tuple(prompt), 24)
    await wait_idle(prefill)
    await wait_idle(decode)

    # Every block of every prompt moved (the prompts share no block), and each decode rank got
    # exactly its KV heads of each: bytes = blocks x its heads' share of a block.
    moved = sum(math.ceil(len(p) / BLOCK) for p in prompts)
    model = decode.engine.model_kv_layout
    per_head = model.bytes_per_block // model.num_kv_heads
    p, d = prefill.engine.tensor_parallel_size, decode.engine.tensor_parallel_size
    expected = [moved * per_head * len(heads_of_rank(model.num_kv_heads, d, j)) for j in range(d)]
    assert decode.stats.transfer_rank_bytes == expected
    assert decode.stats.transfer_bytes == sum(expected) == prefill.stats.transfer_bytes
    assert decode.stats.transfers == len(prompts) and decode.stats.recomputed_prefills == 0
    # Each prefill rank sent the heads the plan gives it (a replicated head from one holder only).
    plan = plan_tp_transfer(model.num_kv_heads, p, d)
    sent = [moved * per_head * sum(len(s.heads) for s in plan.sends(i)) for i in range(p)]
    assert prefill.stats.transfer_rank_bytes == sent


async def test_a_broken_rank_pair_recomputes_exactly_and_the_next_transfer_uses_a_new_group(tiny_llama):
    """p2-d1: decode rank 0 pulls from both prefill ranks. Its end of the pair with prefill rank 1
    goes away (as a link failure leaves it): the next transfer fails on that pair only, within
    the deadline, and the prompt is recomputed (same output); the one after makes a new group
    under a new epoch and moves every rank's heads again."""
    async with make_pools(tiny_llama, 2, 1, timeout_s=4.0) as (prefill, decode):
        prompts = random_prompts((40, 52, 61), seed=78)
        assert await run(prefill, decode, request("a", prompts[0])) == hf_greedy(tiny_llama, tuple(prompts[0]), 24)
        decode.tp_puller.client.close_pair("prefill-0/r1")
        assert await run(prefill, decode, request("b", prompts[1])) == hf_greedy(tiny_llama, tuple(prompts[1]), 24)
        assert decode.stats.transfer_failures == 1 and decode.stats.recomputed_prefills == 1
        before = list(decode.stats.transfer_rank_bytes)
        assert await run(prefill, decode, request("c", prompts[2])) == hf_greedy(tiny_llama, tuple(prompts[2]), 24)
        assert decode.stats.transfers == 2 and decode.stats.recomputed_prefills == 1
        per_block = decode.engine.model_kv_layout.bytes_per_block
        assert decode.stats.transfer_rank_bytes[0] - before[0] == math.ceil(61 / BLOCK) * per_block
        await wait_idle(prefill)
        await wait_idle(decode)
