"""An idle EngineLoop sleeps: no wake-ups between commands beyond one observer pass after the
last activity (the old loop woke every 50 ms and ran the observer each time)."""

from __future__ import annotations

import threading
import time

from workers.engine import LLMEngine, SamplingParams
from workers.engine_loop import _IDLE_OBSERVE_S, EngineLoop


def test_idle_loop_observes_once_then_sleeps_until_a_command(tiny_llama):
    observed = threading.Semaphore(0)
    calls: list[float] = []

    def on_step(engine) -> None:
        calls.append(time.monotonic())
        observed.release()

    loop = EngineLoop(LLMEngine(tiny_llama, num_kv_blocks=32, load_progress=False), on_step=on_step)
    try:
        assert observed.acquire(timeout=30)  # the first idle look
        time.sleep(6 * _IDLE_OBSERVE_S)  # ten polling periods of the old loop: no calls
        assert len(calls) == 1
        future = loop.call_future(lambda e: e.add_request("r", [5] * 8, SamplingParams(max_tokens=3)))
        future.result(timeout=30)
        while loop.call_future(lambda e: e.has_unfinished()).result(timeout=30):
            time.sleep(0.05)
        after_request = len(calls)
        assert after_request >= 3  # one per step at least
        time.sleep(6 * _IDLE_OBSERVE_S)
        # Then at most: one pass after the command batch that polled has_unfinished, and the
        # idle look after it.
        assert len(calls) <= after_request + 2
    finally:
        loop.shutdown()
    assert not loop.alive  # shutdown wakes the sleeping thread
