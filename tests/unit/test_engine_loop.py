"""EngineLoop: concurrent asyncio streams over one engine thread; leaving a stream aborts it."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.engine_helpers import hf_greedy, random_prompts
from workers.engine import LLMEngine, SamplingParams
from workers.engine_loop import EngineLoop


@pytest.fixture
def loop_engine(tiny_llama):
    loop = EngineLoop(LLMEngine(tiny_llama, num_kv_blocks=128, load_progress=False))
    yield loop
    loop.shutdown()


async def collect(loop: EngineLoop, rid: str, prompt, params) -> list[int]:
    tokens: list[int] = []
    async for out in loop.generate(rid, lambda e: e.add_request(rid, prompt, params)):
        tokens.extend(out.new_token_ids)
    return tokens


async def test_concurrent_streams_match_reference(loop_engine, tiny_llama):
    prompts = random_prompts((5, 50, 120), seed=31)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    results = await asyncio.gather(*(collect(loop_engine, f"r{i}", p, params) for i, p in enumerate(prompts)))
    for prompt, tokens in zip(prompts, results):
        assert tokens == hf_greedy(tiny_llama, tuple(prompt), 24)
    assert await loop_engine.call(lambda e: e.stats().num_free_blocks) == 128


async def test_leaving_a_stream_aborts_and_frees(loop_engine):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    stream = loop_engine.generate("long", lambda e: e.add_request("long", [7] * 30, params))
    got = 0
    async for _ in stream:
        got += 1
        if got == 3:
            break
    await stream.aclose()
    for _ in range(100):
        idle = await loop_engine.call(lambda e: not e.has_unfinished())
        if idle:
            break
        await asyncio.sleep(0.01)
    assert idle
    await loop_engine.call(lambda e: e.check_idle())


async def test_errors_from_the_engine_reach_the_caller(loop_engine):
    with pytest.raises(ValueError, match="empty"):
        await collect(loop_engine, "bad", [], SamplingParams())
