"""A hung step is seen from outside the engine thread: ``EngineLoop.stalled_for`` grows while
the thread is inside a step (or the observer after it) and is 0 otherwise; a worker replica's
health check fails once it passes ``step_timeout_s`` (``step_health_problem``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from deploy.pools.servers import step_health_problem
from workers.engine_loop import EngineLoop


class BlockingEngine:
    """Stands in for an ``LLMEngine`` (the loop uses these four methods): a request added with
    ``add`` makes the next step wait for ``release``."""

    def __init__(self) -> None:
        self.pending = False
        self.in_step = threading.Event()
        self.release = threading.Event()

    def add(self) -> None:
        self.pending = True

    def has_unfinished(self) -> bool:
        return self.pending

    def step(self) -> list:
        self.in_step.set()
        assert self.release.wait(30), "the test never released the step"
        self.pending = False
        return []

    def take_failures(self) -> list:
        return []


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def engine() -> BlockingEngine:
    return BlockingEngine()


@pytest.fixture
def make_loop(engine: BlockingEngine) -> Iterator[Callable[..., EngineLoop]]:
    loops: list[EngineLoop] = []

    def make(on_step=None) -> EngineLoop:
        loop = EngineLoop(lambda: engine, on_step)  # type: ignore[arg-type,return-value]  # a stand-in
        loops.append(loop)
        return loop

    yield make
    engine.release.set()
    for loop in loops:
        loop.shutdown()


def test_stalled_for_grows_while_a_step_blocks_and_is_zero_otherwise(engine, make_loop):
    loop = make_loop()
    time.sleep(0.05)
    assert loop.stalled_for() == 0.0  # idle: waiting on the command queue
    loop.call_future(lambda e: e.add()).result(5)
    assert engine.in_step.wait(5)
    time.sleep(0.2)
    first = loop.stalled_for()
    assert first >= 0.2
    time.sleep(0.1)
    assert loop.stalled_for() >= first + 0.1
    assert loop.alive  # the thread lives on: only stalled_for tells
    engine.release.set()
    wait_until(lambda: loop.stalled_for() == 0.0)
    assert loop.call_future(lambda e: e.has_unfinished()).result(5) is False
    assert loop.stalled_for() == 0.0


def test_the_observer_after_a_step_counts_but_not_an_idle_one(engine, make_loop):
    in_observer, leave_observer = threading.Event(), threading.Event()
    block_observer = threading.Event()  # set: the next observer call blocks

    def on_step(_engine) -> None:
        if block_observer.is_set():
            in_observer.set()
            assert leave_observer.wait(30)

    loop = make_loop(on_step)
    engine.release.set()  # steps return at once; this time the observer after the step hangs
    block_observer.set()
    loop.call_future(lambda e: e.add()).result(5)
    assert in_observer.wait(5)
    time.sleep(0.2)
    assert loop.stalled_for() >= 0.2
    leave_observer.set()
    wait_until(lambda: loop.stalled_for() == 0.0)

    # Idle, the observer runs after commands: not a step, so not a stall.
    in_observer.clear()
    leave_observer.clear()
    loop.call_future(lambda e: None).result(5)
    assert in_observer.wait(5)
    time.sleep(0.1)
    assert loop.stalled_for() == 0.0
    leave_observer.set()


def test_a_step_over_the_bound_is_a_health_problem():
    problem = step_health_problem("decode", "abc123", 12.5, 10.0)
    assert problem is not None
    assert "decode replica abc123" in problem
    assert "12.5s" in problem and "step_timeout_s 10s" in problem


@pytest.mark.parametrize("stalled_s", [0.0, 3.0, 10.0])
def test_a_step_within_the_bound_is_fine(stalled_s):
    assert step_health_problem("prefill", "w", stalled_s, 10.0) is None


def test_timeout_zero_never_reports():
    assert step_health_problem("colocated", "w", 1e9, 0.0) is None
