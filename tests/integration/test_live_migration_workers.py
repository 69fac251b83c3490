"""Live migration between decode workers wired directly (no Ray): a running stream stops on one
decode worker, whose KV moves over a real gloo pair group to another, which goes on from the
last token sent; the tokens equal an unmoved run's (greedy: transformers'), nothing is
recomputed, and no worker holds a block afterwards. What the ingress does between the two (the
continuation request) is ``deploy.pools.worker_calls.continuation``, used here as it uses it."""

from __future__ import annotations

import asyncio
import re

import pytest

from deploy.pools.worker_calls import continuation
from kvstore.hashing import hash_prompt_blocks
from tests.integration.test_pd_workers import request, run, wait_idle
from tests.unit.engine_helpers import hf_greedy, random_prompts
from workers.decode import DecodeWorker
from workers.engine import LLMEngine
from workers.prefill import PrefillWorker
from workers.protocol import GenerateRequest, PrefillResult
from workers.transfer import TransferConfig


@pytest.fixture
async def pdd(tiny_llama):
    """A prefill worker and two decode workers, each decode one able to send a moved stream."""
    cfg = TransferConfig(transfer_timeout_s=5.0, connect_timeout_s=5.0)
    prefill = PrefillWorker(
        LLMEngine(tiny_llama, num_kv_blocks=128, load_progress=False), "prefill-0", cfg, lease_ttl_s=5.0
    )
    await prefill.start()
    decodes = []
    for i in range(2):
        decode = DecodeWorker(LLMEngine(tiny_llama, num_kv_blocks=128, load_progress=False), f"decode-{i}", cfg)
        await decode.start()
        decodes.append(decode)
    yield prefill, *decodes
    for worker in (prefill, *decodes):
        await wait_idle(worker)
        await worker.loop.call(lambda e: e.block_manager.check_idle())
        await worker.shutdown()


def rehash(ids, salt):
    return tuple(hash_prompt_blocks(ids, 16, "m", salt))


async def until_handoff(chunks, produced: list[int], on_chunk=None) -> PrefillResult | None:
    """Read a stream's chunks into ``produced`` until its hand-off (returned) or its end (None),
    awaiting ``on_chunk(chunk)`` after each other chunk."""
    async for chunk in chunks:
        produced.extend(chunk.token_ids)
        if chunk.handoff is not None:
            return chunk.handoff
        if on_chunk is not None:
            await on_chunk(chunk)
    return None


async def go_on(target: DecodeWorker, req: GenerateRequest, produced: list[int], handoff, kind: str = "v") -> None:
    """What the ingress does with a hand-off: ``target`` continues ``req`` from it (the tokens
    but the last are the continuation's prompt); its tokens join ``produced``."""
    async for chunk in target.generate(continuation(req, produced[:-1], 1, rehash, kind=kind), handoff):
        produced.extend(chunk.token_ids)


async def run_moved(
    prefill: PrefillWorker, source: DecodeWorker, target: DecodeWorker, req: GenerateRequest, move_after: int
) -> tuple[list[int], PrefillResult]:
    """The request's tokens when ``source`` moves it to ``target`` once ``move_after`` tokens
    went out (what the ingress does: the continuation of the tokens but the last, and the
    hand-off), and the hand-off."""
    result = await prefill.prefill(req)
    produced = [result.first_token_id]

    async def move_once_due(chunk) -> None:
        assert chunk.finish_reason is None, "finished before the move"
        if len(produced) >= move_after and not await source.move(req.request_id):
            await asyncio.sleep(0)  # between states (not at a step boundary yet): the next chunk tries again

    handoff = await until_handoff(source.generate(req, result), produced, move_once_due)
    assert handoff is not None and handoff.kv_handle is not None
    assert handoff.first_token_id == produced[-1]
    assert handoff.prompt_token_ids == (*req.prompt_token_ids, *produced[:-1])
    await go_on(target, req, produced, handoff)
    return produced, handoff


@pytest.mark.parametrize("length", [7, 40, 70])
async def test_a_moved_stream_equals_transformers_and_recomputes_nothing(pdd, tiny_llama, length):
    prefill, source, target = pdd
    prompt = random_prompts((length,), seed=60 + length)[0]
    expected = hf_greedy(tiny_llama, tuple(prompt))
    assert len(expected) >= 8  # long enough to move halfway (random weights may stop early)
    tokens, handoff = await run_moved(prefill, source, target, request("x", prompt), move_after=len(expected) // 2)
    assert tokens == expected
    # every block of prompt + tokens but the last moved, none recomputed
    assert len(handoff.kv_handle.block_ids) == -(-handoff.kv_handle.num_tokens // 16)
    assert target.stats.transfers == 1 and target.stats.recomputed_prefills == 0
    assert source.stats.moved_out == 1 and source.stats.transfers == 2  # the prompt's in, the stream's out


async def test_a_moved_seeded_stream_draws_the_same_tokens(pdd):
    prefill, source, target = pdd
    prompt = random_prompts((33,), seed=7)[0]
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    unmoved = await run(prefill, source, request("a", prompt, **sampling))
    moved, _ = await run_moved(prefill, source, target, request("b", prompt, **sampling), move_after=11)
    assert moved == unmoved


async def test_a_stream_moves_twice_and_back(pdd, tiny_llama):
    """source -> target -> source: each hop pulls only what the receiver lacks (its prefix cache
    still holds the blocks it once had)."""
    prefill, a, b = pdd
    prompt = random_prompts((50,), seed=9)[0]
    req = request("y", prompt, max_tokens=80)
    result = await prefill.prefill(req)
    produced = [result.first_token_id]
    hops = [(a, b), (b, a)]
    current, stream_result, worker = req, result, a
    while True:

        async def move_when_due(_, worker=worker) -> None:
            if hops and len(produced) >= 15 * (3 - len(hops)):
                await worker.move(req.request_id)

        handoff = await until_handoff(worker.generate(current, stream_result), produced, move_when_due)
        if handoff is None:
            break
        source, worker = hops.pop(0)
        assert source.stats.moved_out >= 1
        current = continuation(req, produced[:-1], 2 - len(hops), rehash, kind="v")
        stream_result = handoff
    assert not hops
    assert produced == hf_greedy(tiny_llama, tuple(prompt), max_new_tokens=80)
    assert a.stats.recomputed_prefills == b.stats.recomputed_prefills == 0


async def test_a_stream_moved_back_to_its_source_goes_on_there(pdd, tiny_llama):
    """No other replica took it (the router ranks the source last, but may still pick it): the
    source frees its held blocks and computes the rest from its prefix cache; same tokens."""
    prefill, source, _ = pdd
    prompt = random_prompts((45,), seed=5)[0]
    expected = hf_greedy(tiny_llama, tuple(prompt))
    tokens, _ = await run_moved(prefill, source, source, request("s", prompt), move_after=len(expected) // 2)
    assert tokens == expected
    assert source.stats.recomputed_prefills == 1


async def test_a_hand_off_nobody_takes_is_freed_by_its_lease(tiny_llama):
    cfg = TransferConfig(transfer_timeout_s=5.0, connect_timeout_s=5.0)
    prefill = PrefillWorker(LLMEngine(tiny_llama, num_kv_blocks=64, load_progress=False), "p", cfg, lease_ttl_s=5.0)
    await prefill.start()
    source = DecodeWorker(LLMEngine(tiny_llama, num_kv_blocks=64, load_progress=False), "d", cfg, lease_ttl_s=0.5)
    await source.start()
    try:
        req = request("z", random_prompts((20,), seed=3)[0])
        result = await prefill.prefill(req)
        async for chunk in source.generate(req, result):
            if chunk.handoff is not None:
                break
            await source.move("z")
        assert await source.loop.call(lambda e: e.num_held) == 1  # held for a receiver
        await wait_idle(source)  # the lease ends and frees the blocks
        assert source.stats.leases_expired == 1
    finally:
        for worker in (prefill, source):
            await worker.loop.call(lambda e: e.block_manager.check_idle())
            await worker.shutdown()


async def test_retire_moves_running_streams_live(pdd, tiny_llama):
    """A retiring decode worker moves its running streams (the autoscaler's scale-down) instead
    of ending them for a recompute."""
    prefill, source, target = pdd
    prompt = random_prompts((30,), seed=12)[0]
    req = request("r", prompt)
    result = await prefill.prefill(req)
    produced = [result.first_token_id]

    async def retire_when_due(chunk) -> None:
        assert not chunk.retiring
        if len(produced) >= 10 and not source.retiring:
            assert await source.retire() == 1

    handoff = await until_handoff(source.generate(req, result), produced, retire_when_due)
    assert handoff is not None and source.stats.retired_streams == source.stats.moved_out == 1
    await go_on(target, req, produced, handoff, kind="m")
    assert produced == hf_greedy(tiny_llama, tuple(prompt))


async def test_a_pre_copied_stream_moves_only_what_it_wrote_since(pdd, tiny_llama):
    """The two-phase move: the source's full blocks go to the target's prefix cache while the
    stream keeps decoding on the source (``precopy`` / ``prefetch``); the move then pulls only
    the blocks written since, and the tokens are still transformers'."""
    prefill, source, target = pdd
    prompt = random_prompts((70,), seed=61)[0]
    expected = hf_greedy(tiny_llama, tuple(prompt))
    req = request("p", prompt)
    result = await prefill.prefill(req)
    produced = [result.first_token_id]
    precopied = 0

    async def precopy_then_move(_) -> None:
        nonlocal precopied
        if len(produced) == 6:  # phase 1: the stream goes on here meanwhile
            ((rid, handle, held),) = await source.precopy("p")
            assert rid == "p" and len(handle.block_ids) == len(held.token_ids) // 16 == (70 + 6 - 1) // 16
            copy = GenerateRequest(handle.request_id, tuple(held.token_ids), {}, held.cache_salt)
            precopied = await target.prefetch(copy, handle)
            assert precopied == len(handle.block_ids)
        if len(produced) >= len(expected) // 2 and precopied:
            await source.move("p")

    handoff = await until_handoff(source.generate(req, result), produced, precopy_then_move)
    assert handoff is not None
    before = target.stats.transfer_bytes
    await go_on(target, req, produced, handoff)
    assert produced == expected
    per_block = before // precopied
    moved_after = -(-handoff.kv_handle.num_tokens // 16) - precopied
    assert target.stats.transfer_bytes - before == moved_after * per_block  # only the blocks written since
    assert target.stats.recomputed_prefills == 0


async def test_a_stream_the_decode_worker_computed_itself_moves_too(pdd, tiny_llama):
    """A stream whose prompt the decode worker computed itself (the ingress skipped prefill: the
    worker held the conversation; ``generate_local``) moves like a handed-over one."""
    _, source, target = pdd
    prompt = random_prompts((52,), seed=13)[0]
    expected = hf_greedy(tiny_llama, tuple(prompt))
    req = request("l", prompt)
    produced: list[int] = []

    async def move_when_due(_) -> None:
        if len(produced) >= len(expected) // 2:
            await source.move("l")

    handoff = await until_handoff(source.generate_local(req), produced, move_when_due)
    assert handoff is not None
    await go_on(target, req, produced, handoff)
    assert produced == expected
    assert target.stats.recomputed_prefills == 0


async def test_a_moved_constrained_stream_keeps_its_grammar(pdd):
    """The receiver rebuilds the grammar's state from the tokens so far: a moved constrained
    stream is the unmoved one, and what it says still matches the grammar."""
    prefill, source, target = pdd
    prompt = random_prompts((25,), seed=14)[0]
    digits = {"structured": ("regex", "[0-9]{30}")}
    unmoved = await run(prefill, source, request("g0", prompt, **digits))
    assert len(unmoved) >= 8
    moved, _ = await run_moved(prefill, source, target, request("g1", prompt, **digits), move_after=len(unmoved) // 2)
    assert moved == unmoved
    text = target.engine.tokenizer.decode(moved, skip_special_tokens=True)
    assert re.fullmatch("[0-9]{30}", text), text
