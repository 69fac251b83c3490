"""Prefill and decode workers wired directly (no Ray): the decode worker calls the prefill
worker's KV control server at the address in the KVHandle, KV moves over a real gloo pair group,
decoding continues on the decode worker, and the output equals transformers' greedy output."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.hashing import hash_prompt_blocks
from tests.unit.engine_helpers import hf_greedy, random_prompts
from workers.decode import DecodeWorker, worker_params
from workers.engine import LLMEngine
from workers.prefill import PrefillWorker
from workers.protocol import GenerateRequest
from workers.transfer import TransferConfig


def request(rid: str, prompt: list[int], max_tokens: int = 64, **sampling) -> GenerateRequest:
    params = {"max_tokens": max_tokens, "temperature": 0.0, **sampling}
    hashes = tuple(hash_prompt_blocks(prompt, 16, "m"))
    return GenerateRequest(rid, tuple(prompt), params, None, hashes, time.time())


@pytest.fixture
async def pd(tiny_llama):
    cfg = TransferConfig(transfer_timeout_s=5.0, connect_timeout_s=5.0)
    prefill = PrefillWorker(
        LLMEngine(tiny_llama, num_kv_blocks=128, load_progress=False), "prefill-0", cfg, lease_ttl_s=2.0
    )
    await prefill.start()  # its KV control server: the decode worker calls it at the handle's address
    decode = DecodeWorker(LLMEngine(tiny_llama, num_kv_blocks=128, load_progress=False), "decode-0", cfg)
    yield prefill, decode
    for worker in (prefill, decode):
        await worker.loop.call(lambda e: e.block_manager.check_idle())
        await worker.shutdown()


async def run(prefill: PrefillWorker, decode: DecodeWorker, req: GenerateRequest) -> list[int]:
    result = await prefill.prefill(req)
    tokens = [result.first_token_id]
    if result.finish_reason:
        return tokens
    async for chunk in decode.generate(req, result):
        tokens.extend(chunk.token_ids)
    return tokens


async def wait_idle(worker) -> None:
    """Until the worker runs and holds no request (a few seconds at most, else a failure)."""
    for _ in range(250):
        if await worker.loop.call(lambda e: not e.has_unfinished() and e.num_held == 0):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{worker.worker_id} still runs or holds requests")


async def test_disaggregated_output_matches_transformers(pd, tiny_llama):
    prefill, decode = pd
    prompts = random_prompts((3, 40, 130), seed=41)
    results = await asyncio.gather(*(run(prefill, decode, request(f"r{i}", p)) for i, p in enumerate(prompts)))
    for prompt, tokens in zip(prompts, results):
        assert tokens == hf_greedy(tiny_llama, tuple(prompt))
    assert decode.stats.transfers == 3 and decode.stats.transfer_bytes > 0
    assert prefill.stats.transfers == 3
    # the pd autoscaler's inflow counters: what prefill handed over and what decode finished
    max_tokens = request("x", [1]).sampling["max_tokens"]
    assert (prefill.stats.handed_over, prefill.stats.handed_over_max_tokens) == (3, 3 * max_tokens)
    lengths = [len(p) for p in prompts]
    assert prefill.stats.handed_over_prompt_tokens == sum(lengths)
    assert prefill.stats.handed_over_prompt_x_max == sum(lengths) * max_tokens
    assert prefill.stats.handed_over_max_sq == 3 * max_tokens**2
    assert (prefill.stats.received, prefill.stats.received_prompt_tokens) == (3, sum(lengths))
    assert prefill.stats.received_prompt_tokens_sq == sum(n * n for n in lengths)
    assert decode.stats.finished_seqs == 3 and decode.stats.finished_max_tokens == 3 * max_tokens
    assert decode.stats.finished_output_tokens == sum(len(t) for t in results)
    assert decode.stats.finished_resident_s > 0  # the seconds they held decode's KV, summed
    # ... of which the seconds before each one's first decoded token (pull, a step's wait)
    assert 0 < decode.stats.finished_setup_s < decode.stats.finished_resident_s
    await wait_idle(prefill)


async def test_decode_cache_hit_moves_only_missing_blocks(pd, tiny_llama):
    prefill, decode = pd
    prefix = random_prompts((64,), seed=42)[0]
    await run(prefill, decode, request("a", prefix + [1, 2, 3]))
    bytes_before = decode.stats.transfer_bytes
    tokens = await run(prefill, decode, request("b", prefix + list(range(100, 120))))
    assert tokens == hf_greedy(tiny_llama, tuple(prefix + list(range(100, 120))))
    per_block = decode.stats.transfer_bytes - bytes_before
    assert per_block == 2 * (bytes_before // 5)  # 2 of 6 blocks moved the 2nd time, 5 the first
    await wait_idle(prefill)


async def test_failed_transfer_recomputes_same_output(pd, tiny_llama):
    prefill, decode = pd
    prompt = random_prompts((50,), seed=43)[0]
    req = request("x", prompt)
    result = await prefill.prefill(req)
    assert await prefill.release("x")  # blocks gone: the send will be refused
    tokens = [result.first_token_id]
    async for chunk in decode.generate(req, result):
        tokens.extend(chunk.token_ids)
    assert tokens == hf_greedy(tiny_llama, tuple(prompt))
    assert decode.stats.transfer_failures == 1 and decode.stats.recomputed_prefills == 1


async def test_kv_corrupted_in_flight_is_recomputed_to_the_same_output(tiny_llama):
    """A prefill worker whose sends flip a byte after checksumming (the fault hook): decode
    catches every one, counts it, recomputes, and the answers equal transformers'; nothing is
    left held on either side."""
    cfg = TransferConfig(transfer_timeout_s=5.0, connect_timeout_s=5.0)
    corrupting = TransferConfig(transfer_timeout_s=5.0, connect_timeout_s=5.0, fault_corrupt_bytes=1)
    prefill = PrefillWorker(
        LLMEngine(tiny_llama, num_kv_blocks=128, load_progress=False), "prefill-0", corrupting, lease_ttl_s=2.0
    )
    await prefill.start()
    decode = DecodeWorker(LLMEngine(tiny_llama, num_kv_blocks=128, load_progress=False), "decode-0", cfg)
    try:
        prompts = random_prompts((20, 70), seed=46)
        for i, prompt in enumerate(prompts):
            assert await run(prefill, decode, request(f"c{i}", prompt, max_tokens=16)) == hf_greedy(
                tiny_llama, tuple(prompt), 16
            )
        assert decode.stats.transfer_corrupt == decode.stats.transfer_failures == len(prompts)
        assert decode.stats.recomputed_prefills == len(prompts)
        await wait_idle(decode)
    finally:
        for worker in (prefill, decode):
            await worker.loop.call(lambda e: e.block_manager.check_idle())
            await worker.shutdown()


async def test_unclaimed_lease_expires_and_frees(pd):
    prefill, _ = pd
    result = await prefill.prefill(request("y", random_prompts((70,), seed=44)[0]))
    assert result.kv_handle is not None
    held = await prefill.loop.call(lambda e: e.num_held)
    assert held == 1
    for _ in range(100):
        await asyncio.sleep(0.05)
        if await prefill.loop.call(lambda e: e.num_held) == 0:
            break
    assert prefill.stats.leases_expired == 1


async def test_request_that_ends_at_first_token_needs_no_decode(pd):
    prefill, _ = pd
    result = await prefill.prefill(request("z", [5, 6, 7], max_tokens=1))
    assert result.kv_handle is None and result.finish_reason == "length"
    assert prefill.stats.handed_over == 0 and prefill.stats.requests == 1  # nothing for decode
    assert await prefill.loop.call(lambda e: e.num_held) == 0


async def test_a_dead_prefill_workers_control_call_fails_by_its_deadline_and_decode_recomputes(pd, tiny_llama):
    prefill, decode = pd
    prompt = random_prompts((50,), seed=45)[0]
    req = request("dead", prompt)
    result = await prefill.prefill(req)
    await prefill.control.stop(grace_s=0)  # the prefill worker's process is gone, as far as decode can tell
    tokens = [result.first_token_id]
    async for chunk in decode.generate(req, result):  # a hang here fails the test's timeout
        tokens.extend(chunk.token_ids)
    assert tokens == hf_greedy(tiny_llama, tuple(prompt))
    assert decode.stats.transfer_failures == 1 and decode.stats.recomputed_prefills == 1
    assert decode.stats.peer("prefill-0").transfer_failures == 1
    # The prefill side's lease (2 s, shorter than the 5 s deadline) freed the blocks it held.
    await wait_idle(prefill)
    assert await prefill.loop.call(lambda e: e.num_held) == 0 and prefill.stats.leases_expired == 1


async def test_32_concurrent_transfers_between_two_prefill_and_two_decode_workers_reach_their_holders(tiny_llama):
    cfg = TransferConfig(transfer_timeout_s=30.0, connect_timeout_s=30.0)

    def engine() -> LLMEngine:
        return LLMEngine(tiny_llama, num_kv_blocks=256, load_progress=False)

    prefills = [PrefillWorker(engine(), f"prefill-{i}", cfg, lease_ttl_s=60.0) for i in range(2)]
    for p in prefills:
        await p.start()
    decodes = [DecodeWorker(engine(), f"decode-{i}", cfg) for i in range(2)]
    prompts = random_prompts(tuple(20 + 7 * i for i in range(32)), seed=46)  # 2..15 blocks each
    pairs = [(i % 2, (i // 2) % 2) for i in range(32)]  # every (prefill, decode) pair 8 times

    async def one(i: int) -> tuple[list[int], int, int]:
        p, d = prefills[pairs[i][0]], decodes[pairs[i][1]]
        req = request(f"c{i}", prompts[i], max_tokens=6)
        result = await p.prefill(req)
        tokens, moved = [result.first_token_id], None
        async for chunk in d.generate(req, result):
            tokens.extend(chunk.token_ids)
            if chunk.timing:
                moved = int(chunk.timing["transfer_bytes"])
        return tokens, moved, len(result.kv_handle.block_ids) * result.kv_handle.layout.bytes_per_block

    try:
        results = await asyncio.gather(*(one(i) for i in range(32)))
        for i, (tokens, moved, expected_bytes) in enumerate(results):
            assert tokens == hf_greedy(tiny_llama, tuple(prompts[i]), 6), i
            assert moved == expected_bytes, (i, moved, expected_bytes)  # every block, from its holder
        for d, decode in enumerate(decodes):
            assert decode.stats.transfer_failures == 0 and decode.stats.recomputed_prefills == 0
            for p, prefill in enumerate(prefills):
                assert decode.stats.peer(prefill.worker_id).transfers == pairs.count((p, d)) == 8
        for prefill in prefills:
            assert prefill.stats.transfers == 16 and prefill.stats.leases_expired == 0
    finally:
        for worker in (*prefills, *decodes):
            await wait_idle(worker)
            await worker.loop.call(lambda e: e.check_idle())
            await worker.shutdown()


@pytest.fixture
async def small_decode(tiny_llama):
    """A prefill worker with a short lease (0.5 s) and a decode worker with 8 KV blocks, so a
    prompt can find no room on decode and wait past the lease it was handed."""
    cfg = TransferConfig(transfer_timeout_s=5.0, connect_timeout_s=5.0)
    prefill = PrefillWorker(
        LLMEngine(tiny_llama, num_kv_blocks=64, load_progress=False), "prefill-0", cfg, lease_ttl_s=0.5
    )
    await prefill.start()
    decode = DecodeWorker(LLMEngine(tiny_llama, num_kv_blocks=8, load_progress=False), "decode-0", cfg)
    yield prefill, decode
    for worker in (prefill, decode):
        await worker.loop.call(lambda e: e.block_manager.check_idle())
        await worker.shutdown()


async def hog(decode: DecodeWorker, blocks: int) -> None:
    """Take `blocks` of decode's KV for a request whose KV never arrives (until aborted)."""
    prompt = random_prompts((blocks * 16 - 1,), seed=47)[0]
    params = worker_params(request("hog", prompt))
    assert await decode.loop.call(lambda e: e.reserve_remote_kv("hog", prompt, 1, params)) is not None


async def collect(decode: DecodeWorker, req: GenerateRequest, result) -> list[int]:
    tokens = [result.first_token_id]
    async for chunk in decode.generate(req, result):
        tokens.extend(chunk.token_ids)
    return tokens


async def test_a_prompt_with_no_room_on_decode_waits_for_it_keeping_the_prefill_lease(small_decode, tiny_llama):
    prefill, decode = small_decode
    await hog(decode, 6)  # 2 of 8 blocks left; the prompt below needs 4
    prompt = random_prompts((50,), seed=48)[0]
    req = request("w", prompt, max_tokens=8)
    result = await prefill.prefill(req)
    task = asyncio.create_task(collect(decode, req, result))
    for _ in range(200):
        if decode.stats.kv_waiting:
            break
        await asyncio.sleep(0.01)
    assert decode.stats.kv_waiting == 1
    snapshot = await decode.loop.call(lambda e: decode.stats.snapshot(e))
    assert snapshot["num_waiting"] == 1  # the router and the autoscaler see it waiting
    await asyncio.sleep(1.5)  # three times the prefill lease: decode must have extended it
    assert not task.done() and prefill.stats.leases_expired == 0
    assert await decode.loop.call(lambda e: e.abort("hog"))
    tokens = await asyncio.wait_for(task, 30)
    assert tokens == hf_greedy(tiny_llama, tuple(prompt), max_new_tokens=8)
    assert decode.stats.kv_waits == 1 and decode.stats.kv_waiting == 0
    assert decode.stats.transfers == 1 and decode.stats.recomputed_prefills == 0
    await wait_idle(prefill)
    await wait_idle(decode)


async def test_a_prompt_still_without_room_when_its_wait_ends_is_recomputed(small_decode, tiny_llama):
    prefill, decode = small_decode
    decode.kv_wait_s = 0.3
    await hog(decode, 5)  # 3 of 8 blocks left; the prompt below needs 4
    prompt = random_prompts((50,), seed=49)[0]
    req = request("r", prompt, max_tokens=8)
    task = asyncio.create_task(collect(decode, req, await prefill.prefill(req)))
    await asyncio.sleep(1.0)  # the wait is over: the prompt was queued here as a recompute
    assert decode.stats.recomputed_prefills == 1 and decode.stats.kv_waiting == 0
    assert await decode.loop.call(lambda e: e.abort("hog"))  # its blocks let the recompute run
    tokens = await asyncio.wait_for(task, 30)
    assert tokens == hf_greedy(tiny_llama, tuple(prompt), max_new_tokens=8)
    assert decode.stats.transfers == 0
    await wait_idle(prefill)
    await wait_idle(decode)


async def test_a_client_gone_while_its_prompt_waits_for_room_releases_the_prefill_copy(tiny_llama):
    cfg = TransferConfig(transfer_timeout_s=5.0, connect_timeout_s=5.0)
    prefill = PrefillWorker(
        LLMEngine(tiny_llama, num_kv_blocks=64, load_progress=False), "prefill-0", cfg, lease_ttl_s=60.0
    )
    await prefill.start()
    decode = DecodeWorker(LLMEngine(tiny_llama, num_kv_blocks=8, load_progress=False), "decode-0", cfg)
    try:
        await hog(decode, 6)
        req = request("gone", random_prompts((50,), seed=50)[0], max_tokens=8)
        task = asyncio.create_task(collect(decode, req, await prefill.prefill(req)))
        for _ in range(200):
            if decode.stats.kv_waiting:
                break
            await asyncio.sleep(0.01)
        assert decode.stats.kv_waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(prefill)  # released at once: its 60 s lease would not have freed it yet
        assert decode.stats.kv_waiting == 0 and prefill.stats.leases_expired == 0
        assert await decode.loop.call(lambda e: e.abort("hog"))
        await wait_idle(decode)
    finally:
        for worker in (prefill, decode):
            await worker.loop.call(lambda e: e.block_manager.check_idle())
            await worker.shutdown()
