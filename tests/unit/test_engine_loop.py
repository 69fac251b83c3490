"""EngineLoop: concurrent asyncio streams over one engine thread; leaving a stream aborts it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.unit.engine_helpers import hf_greedy, random_prompts
from workers.engine import LLMEngine, RequestFailed, SamplingParams
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


async def test_a_request_whose_sampling_fails_fails_alone(loop_engine, tiny_llama, monkeypatch):
    """One request's sampling raises (seed 13 stands for whatever breaks it): that request's
    stream ends with RequestFailed, its blocks are freed, and the others in the same batches
    finish with the reference output; the engine loop stays up."""
    import workers.engine.sampler as sampler

    real = sampler._sample_rows

    def breaks_on_seed_13(logits, params, generators):
        if any(p.seed == 13 for p in params):
            raise RuntimeError("invalid multinomial distribution")
        return real(logits, params, generators)

    monkeypatch.setattr(sampler, "_sample_rows", breaks_on_seed_13)
    loop = loop_engine
    prompts = random_prompts((9, 17, 25), seed=61)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    broken = SamplingParams(max_tokens=12, temperature=0.8, seed=13)
    results = await asyncio.gather(
        collect(loop, "a", prompts[0], greedy),
        collect(loop, "bad", prompts[1], broken),
        collect(loop, "c", prompts[2], greedy),
        return_exceptions=True,
    )
    assert isinstance(results[1], RequestFailed) and results[1].request_id == "bad"
    assert "invalid multinomial distribution" in str(results[1])
    assert results[0] == hf_greedy(tiny_llama, tuple(prompts[0]), 12)
    assert results[2] == hf_greedy(tiny_llama, tuple(prompts[2]), 12)
    assert loop.alive
    await loop.call(lambda e: e.check_idle())  # the failed request's blocks are back
    assert await collect(loop, "after", prompts[1], greedy) == hf_greedy(tiny_llama, tuple(prompts[1]), 12)


def test_offline_generate_raises_the_failed_request_and_leaves_nothing_running(tiny_llama, monkeypatch):
    import workers.engine.sampler as sampler

    def always_breaks(logits, params, generators):
        raise RuntimeError("invalid multinomial distribution")

    monkeypatch.setattr(sampler, "_sample_rows", always_breaks)
    engine = LLMEngine(tiny_llama, num_kv_blocks=64, load_progress=False)
    prompts = random_prompts((9, 17), seed=62)
    with pytest.raises(RequestFailed, match="invalid multinomial"):
        engine.generate(prompts, [SamplingParams(max_tokens=4, temperature=0.0), SamplingParams(max_tokens=4, seed=1)])
    engine.check_idle()
    assert engine.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids == hf_greedy(
        tiny_llama, tuple(prompts[0]), 4
    )


async def test_an_engine_built_by_the_loop_is_built_on_its_thread(tiny_llama):
    # A server hands the loop a factory: loading, warm-ups and every step then run on one OS
    # thread, so libgomp keeps one worker pool (workers/engine_loop.py)
    built_on: list[threading.Thread] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread())
        return LLMEngine(tiny_llama, num_kv_blocks=64, load_progress=False)

    loop = EngineLoop(build)
    try:
        assert built_on == [loop._thread] and loop.engine.num_kv_blocks == 64
        step_threads = await loop.call(lambda e: threading.current_thread())
        assert step_threads is loop._thread
        prompt = random_prompts((20,), seed=3)[0]
        tokens = await collect(loop, "r", prompt, SamplingParams(max_tokens=8, temperature=0.0))
        assert tokens == hf_greedy(tiny_llama, tuple(prompt), 8)
    finally:
        loop.shutdown()


def test_a_factory_that_fails_fails_the_constructor():
    def build() -> LLMEngine:
        raise FileNotFoundError("no model here")

    with pytest.raises(FileNotFoundError, match="no model here"):
        EngineLoop(build)


async def test_a_steps_outputs_wake_the_event_loop_once(loop_engine, tiny_llama):
    """Four streams decoding together: each step's outputs reach this event loop in one
    callback from the engine thread, not one per request, and every stream still gets the
    reference tokens."""
    loop = asyncio.get_running_loop()
    engine_thread_calls = 0
    real = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        nonlocal engine_thread_calls
        if threading.current_thread().name == "engine-loop":
            engine_thread_calls += 1
        return real(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        prompts = random_prompts((6, 11, 17, 23), seed=41)
        params = SamplingParams(max_tokens=16, temperature=0.0)
        results = await asyncio.gather(*(collect(loop_engine, f"w{i}", p, params) for i, p in enumerate(prompts)))
    finally:
        del loop.call_soon_threadsafe
    for prompt, tokens in zip(prompts, results):
        assert tokens == hf_greedy(tiny_llama, tuple(prompt), 16)
    delivered = sum(len(t) for t in results)
    assert delivered >= 16  # enough tokens that one wake-up each would show
    # one wake-up a step (about 16 here) and one per command's reply (4 starts), where one a
    # token was at least `delivered` + 4
    assert engine_thread_calls < delivered, (engine_thread_calls, delivered)
