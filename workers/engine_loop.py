"""Drives an ``LLMEngine`` from one dedicated thread and exposes it to asyncio.

The engine is not thread-safe; every call into it runs on the engine thread, between steps:
``call`` runs a function there and awaits its result, ``generate`` streams a request's outputs.
The event loop never blocks on the engine: outputs cross back by ``call_soon_threadsafe``.

The engine can be built on that thread too (``EngineLoop(factory)``), and a server should build
it there: torch's CPU ops parallelise with OpenMP, and libgomp keeps a pool of worker threads per
OS thread that runs a parallel region. An engine loaded on one thread (the replica's
constructor) and stepped on another leaves two pools; once it manages more threads than the
process may use CPUs, libgomp stops spinning between parallel regions and its workers sleep and
wake on each of a step's few hundred ops, switching context on every one
(docs/decisions/0012-one-openmp-pool-per-engine.md). Helper threads that touch tensors (the KV
senders and receivers) start with ``workers.threads.one_torch_thread`` for the same reason.

A step that never returns (a hung CUDA kernel or NCCL collective) is seen from outside the thread:
``stalled_for`` says how long the engine thread has been inside the current step (with the
observer that follows it), and the replica's health check reports a step over its bound
(``step_timeout_s``, deploy/pools/servers.py) so that Serve replaces the replica.

Lifetime: a request's stream ends when it finishes or is aborted; a consumer that stops
iterating (client disconnect, cancellation) aborts the request in the engine, which frees its
blocks. ``shutdown`` stops the thread; streams still open end with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any, TypeVar

from workers.engine.engine import LLMEngine, RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Idle, the thread sleeps on the command queue. The observer runs after every step and after
# every batch of commands; once the engine goes idle it runs once more after this long (the
# metrics refresh at most every 0.5 s and may have skipped the last steps), then the thread
# waits with no timeout until the next command: an idle replica wakes for nothing.
_IDLE_OBSERVE_S = 0.6


class EngineDeadError(RuntimeError):
    pass


class EngineLoop:
    """``engine``: the engine, or a function that builds it, which then runs on the engine thread
    (see the module's docstring); the constructor waits for it and raises what it raised."""

    def __init__(
        self, engine: LLMEngine | Callable[[], LLMEngine], on_step: Callable[[LLMEngine], None] | None = None
    ) -> None:
        self.on_step = on_step  # runs on the engine thread after each step (events, metrics)
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        # time.monotonic() when the engine thread entered the current step; None between steps.
        # Written by the engine thread only, read by any (a reference store is atomic in CPython).
        self._step_started: float | None = None
        built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(engine, built), name="engine-loop", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()

    # ------------------------------------------------------------ asyncio API
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.call_future(fn))

    async def compile_grammar(self, params) -> None:
        """Compile a constrained request's grammar on a helper thread (the step loop goes on),
        before the request is added; a spec that is no grammar raises GrammarError here."""
        if params.structured is not None:
            await asyncio.to_thread(self.engine.compile_grammar, params)

    def call_future(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future:
        if self._error is not None or self._stopped.is_set():
            raise EngineDeadError(f"engine loop is stopped: {self._error!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((lambda: fn(self.engine), future))
        return future

    async def generate(self, request_id: str, start: Callable[[LLMEngine], Any]) -> AsyncIterator[RequestOutput]:
        """Register a stream for ``request_id``, run ``start(engine)`` (which adds the request),
        and yield the request's outputs until it finishes. Leaving early aborts it."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        finished = False
        try:
            await self.call(start)
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = getattr(item, "request_kept", False)  # e.g. a stream moved elsewhere
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def attach(self, request_id: str) -> asyncio.Queue:
        """Register a stream for a request that another call will add (e.g. after a transfer)."""
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        return outputs

    def detach(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def streams(self) -> list[str]:
        """The request ids with an open stream."""
        return list(self._streams)

    def deliver(self, request_id: str, item: Any) -> None:
        """Engine thread (inside a ``call``): put ``item`` on the request's stream, after every
        output already delivered to it."""
        self._deliver([(request_id, item)])

    def end_streams(self, error: Callable[[str], BaseException], keep: Collection[str] = ()) -> list[str]:
        """End every open stream but ``keep`` with ``error(request_id)``: each consumer raises it
        and, having not finished, aborts its request (which frees its blocks). Returns their
        request ids."""
        ids = [request_id for request_id in self._streams if request_id not in keep]
        self._deliver([(request_id, error(request_id)) for request_id in ids])
        return ids

    def abort(self, request_id: str) -> concurrent.futures.Future | None:
        """Abort a request on the engine thread (frees its blocks wherever it is), without
        waiting: it runs even when the caller is being cancelled. A no-op once stopped."""
        try:
            return self.call_future(lambda engine: engine.abort(request_id))
        except EngineDeadError:
            return None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine thread; streams still open end with ``EngineDeadError``."""
        self._stopped.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))  # wake an idle thread
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def stalled_for(self) -> float:
        """Seconds the engine thread has been inside the current step: ``engine.step()``, the
        delivery of its outputs and the observer after it. 0.0 while idle, between steps and
        while it runs commands. Any thread may ask (the health check does)."""
        started = self._step_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    # ----------------------------------------------------------- engine thread
    def _main(self, engine: LLMEngine | Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        if not isinstance(engine, LLMEngine):
            try:
                engine = engine()
            except BaseException as exc:  # noqa: BLE001 - the constructor raises it
                self._stopped.set()
                built.set_exception(exc)
                return
        self.engine = engine
        built.set_result(engine)
        self._run()

    def _run(self) -> None:
        engine = self.engine
        idle_observed = False  # a first look once the engine is up and idle
        try:
            while not self._stopped.is_set():
                if engine.has_unfinished():
                    self._drain_commands(block=False)
                else:
                    ran = self._drain_commands(block=True, timeout=None if idle_observed else _IDLE_OBSERVE_S)
                    if not self._stopped.is_set() and not engine.has_unfinished():
                        self._observe()  # after commands (events, load) or the last idle look
                        idle_observed = not ran
                    continue
                self._step_started = time.monotonic()
                try:
                    items: list[tuple[str, RequestOutput | BaseException]] = [(o.request_id, o) for o in engine.step()]
                    # a request that failed (the loop goes on) gets its failure after any output
                    items += [(failure.request_id, failure) for failure in engine.take_failures()]
                    self._deliver(items)
                    self._observe()
                finally:
                    self._step_started = None
                idle_observed = False
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            logger.exception("engine loop died")
            self._error = exc
            failed = f"engine failed: {exc!r}"
            self._deliver([(request_id, EngineDeadError(failed)) for request_id in list(self._streams)])
        finally:
            self._stopped.set()
            self._fail_pending_commands()
            if self._error is None:  # stopped by shutdown(): nothing will reach open streams again
                stopped = "engine loop stopped (the replica is shutting down)"
                self._deliver([(request_id, EngineDeadError(stopped)) for request_id in list(self._streams)])

    def _drain_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Run every queued command; with ``block``, first wait up to ``timeout`` (None: for
        ever) for one. Returns whether any ran."""
        try:
            fn, future = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - delivered to the caller
                    future.set_exception(exc)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _observe(self) -> None:
        """Run the step observer; its failure is logged, never fatal to the engine."""
        if self.on_step is None:
            return
        try:
            self.on_step(self.engine)
        except Exception:  # noqa: BLE001 - metrics/index publishing must not stop generation
            logger.exception("engine step observer failed")

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand each item to its request's stream, in the order given, with one wake-up per
        consumer event loop (a step's outputs for a batch of 8 once woke the loop 8 times).
        Items of requests with no open stream are dropped."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the consumers' loop is closed: nobody is listening
                pass

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("engine loop stopped"))


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for outputs, item in puts:
        outputs.put_nowait(item)
