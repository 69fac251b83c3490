"""How the ingress calls the worker pools for one choice, how their failures map to
client-facing errors, and whether the pools can take calls yet (``PoolReadiness``, behind
``/health``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

import ray
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deploy.api.http_errors import is_cancellation
from deploy.api.openai_protocol import RequestError
from deploy.args import Mode
from workers.decode import DecodeRetiring, StreamMoved
from workers.output_channel import END_GRACE_S, OutputChannelError, OutputSink, terminal
from workers.protocol import GenerateRequest, PrefillResult, TokenChunk, TokenLogprobs
from workers.transfer.control import ControlClient
from workers.transfer.errors import KVTransferError

logger = logging.getLogger("pdserve")


def client_error(exc: BaseException) -> BaseException:
    """A worker's ValueError is the request's fault (400); a full pool is 503 with Retry-After;
    anything else stays a server error."""
    if is_cancellation(exc):
        return exc  # the call was cancelled (the client left): not the request's fault, nor ours
    if isinstance(exc, (BackPressureError, DeploymentUnavailableError)):
        return RequestError(
            f"the server is at capacity, retry shortly ({type(exc).__name__})",
            None,
            status=503,
            error_type="server_overloaded",
            code="overloaded",
        )
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ValueError):
        return RequestError(str(cause), "prompt")
    if isinstance(exc, ValueError):
        return RequestError(str(exc), "prompt")
    return exc


CONTROL_TIMEOUT_S = 5.0  # a release or lease extension at a prefill worker's control server
LEASE_EXTENSION_S = 10.0  # each extension while a request waits for room on the decode pool
MAX_DECODE_WAIT_S = 120.0  # then the request fails with the decode pool's 503
SKIP_PREFILL_FRACTION = 0.9  # decode holds this much of the prompt: it computes the rest itself
_CALL_ENDED = object()  # the output channel's consumer: the worker's call returned
# A worker replica's process is gone (killed, its node lost): the call did not fail on its own.
REPLICA_DEATHS = (ray.exceptions.RayActorError,)  # ActorDiedError, ActorUnavailableError


def channel_lost(exc: BaseException) -> bool:
    """The output channel between the decode replica and this ingress broke mid-stream (either
    end saw it): the stream resumes elsewhere as for a lost replica."""
    return any(isinstance(error, OutputChannelError) for error in (exc, getattr(exc, "cause", None)))


def retiring_worker(exc: BaseException) -> str | None:
    """The decode worker that ended the stream early because Serve is stopping it
    (``DecodeRetiring``, as Ray raises it: the error itself or a task error caused by it), or
    None for any other error."""
    for error in (exc, getattr(exc, "cause", None)):
        if isinstance(error, DecodeRetiring):
            return error.worker_id
    return None


class DecodeMigrationError(RuntimeError):
    """A decode stream broke more often than ``max_migrations`` allows."""


def continuation(
    choice: GenerateRequest,
    produced: Sequence[int],
    attempt: int,
    rehash: Callable[[Sequence[int], str | None], tuple[bytes, ...]],
    kind: str = "m",
) -> GenerateRequest:
    """The request that resumes ``choice`` after ``produced`` tokens went to the client: those
    tokens are its forced prefix, it asks for what is left, and its sampling positions continue
    where they stopped, so position-seeded (and greedy) sampling draws the same tokens. Its id
    is ``choice``'s with ``~{kind}{attempt}``: ``m`` a recompute, ``v`` a live move."""
    sampling = dict(choice.sampling)
    sampling["max_tokens"] = sampling.get("max_tokens", 16) - len(produced)
    sampling["output_position_offset"] = sampling.get("output_position_offset", 0) + len(produced)
    prompt = tuple(choice.prompt_token_ids) + tuple(produced)
    return dataclasses.replace(
        choice,
        request_id=f"{choice.request_id}~{kind}{attempt}",
        prompt_token_ids=prompt,
        sampling=sampling,
        block_hashes=rehash(prompt, choice.cache_salt),
    )


class WorkerCalls:
    def __init__(
        self,
        mode: Mode,
        prefill=None,
        decode=None,
        colocated=None,
        index=None,
        rehash: Callable[[Sequence[int], str | None], tuple[bytes, ...]] | None = None,
        max_migrations: int = 0,
        on_migration: Callable[[], None] | None = None,
        on_live_migration: Callable[[], None] | None = None,
        control: ControlClient | None = None,
        sink_host: str | None = None,
    ) -> None:
        """``sink_host``: this ingress's address for the output channel
        (``workers/output_channel.py``): the worker replicas send each step's tokens there in
        one message; None: every request's tokens come on its own Serve stream."""
        self.mode = mode
        self.control = control  # the prefill workers' KV control servers (release, lease extension)
        self.prefill, self.decode, self.colocated = prefill, decode, colocated
        self.index = index  # PrefixIndex or None
        self.rehash = rehash or (lambda ids, salt: ())  # a continuation's block hashes, for routing
        self.max_migrations = max_migrations
        self.on_migration = on_migration or (lambda: None)  # the ingress's Prometheus counters
        self.on_live_migration = on_live_migration or (lambda: None)
        self.skipped_prefills = 0
        self.prefill_retries = 0  # prefills re-sent to another replica after theirs died
        self.migrations = 0  # decode streams resumed on another replica
        self.failed_migrations = 0  # streams that broke once more than max_migrations allows
        self.retired_streams = 0  # of the migrations: streams a retiring decode replica handed over
        self.live_migrations = 0  # decode streams moved with their KV (no recompute), any cause
        self._background: set[asyncio.Task] = set()
        self.sink_host = sink_host
        self.sink: OutputSink | None = None
        self._sink_start: asyncio.Task | None = None

    async def _output_address(self) -> str | None:
        """This ingress's sink address, started on first use (it needs the replica's event loop);
        None when the channel is off or could not start (then the Serve streams carry tokens)."""
        if self.sink_host is None:
            return None
        if self._sink_start is None:
            sink = OutputSink()

            async def start() -> OutputSink | None:
                try:
                    address = await sink.start(self.sink_host or "")
                except OSError as exc:
                    logger.warning("output channel not started (%s): tokens stream per request", exc)
                    return None
                logger.info("ingress output channel listening at %s", address)
                self.sink = sink
                return sink

            self._sink_start = asyncio.get_running_loop().create_task(start())
        sink = await asyncio.shield(self._sink_start)
        return sink.address if sink is not None else None

    async def stop(self) -> None:
        if self.sink is not None:
            await self.sink.stop()

    async def generate(self, choice: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """One choice's tokens. In disaggregated mode a decode stream whose replica dies resumes
        on another decode replica (at most ``max_migrations`` times) from the prompt plus the
        tokens already yielded: the caller sees one uninterrupted stream."""
        address = await self._output_address()
        if address is not None:
            choice = dataclasses.replace(choice, output_address=address)
        if self.mode is Mode.COLOCATED:
            stream = self.colocated.options(stream=True).generate_local.remote(choice)
            async for chunk in self._relay(stream, choice):
                yield chunk
            return
        produced: list[int] = []
        attempt, current, to_decode = 0, choice, False
        avoid: tuple[str, ...] = ()
        handoff: PrefillResult | None = None  # a stream moved live: its KV, where it goes on from
        moves = 0
        while True:
            serving: str | None = None  # this attempt's decode replica, once its chunks name it
            try:
                once = self._generate_once(
                    current, allow_skip=attempt == 0 and not moves, to_decode=to_decode, handoff=handoff
                )
                handoff = None
                async with contextlib.aclosing(once) as chunks:
                    async for chunk in chunks:
                        if chunk.retiring:
                            worker = chunk.worker_id or ""
                            raise DecodeRetiring(f"decode replica {worker} is retiring", worker)
                        if chunk.handoff is not None:
                            raise StreamMoved(chunk.handoff)
                        if chunk.worker_id is not None:
                            serving = chunk.worker_id
                        if attempt or moves:  # the continuation's cache hits cover tokens the client already has
                            chunk = dataclasses.replace(chunk, num_cached_tokens=0)
                        produced.extend(chunk.token_ids)
                        yield chunk
                return
            except StreamMoved as moved:
                moves += 1
                source = moved.handoff.kv_handle.prefill_worker_id if moved.handoff.kv_handle else ""
                avoid += (source,)
                current, handoff = self._moved(choice, produced, moved.handoff, moves)
                to_decode = handoff is None  # a hand-off that does not fit: recompute on another replica
                current = dataclasses.replace(current, avoid_workers=avoid)
                continue
            except Exception as exc:
                retired_from = retiring_worker(exc)
                retiring = retired_from is not None
                if not retiring and not isinstance(exc, REPLICA_DEATHS) and not channel_lost(exc):
                    raise
                if not produced and not retiring:
                    raise  # nothing went out yet: the prefill stage retries on its own
                if attempt >= self.max_migrations or not await self._another_decode_replica(serving or retired_from):
                    self.failed_migrations += 1
                    raise DecodeMigrationError(
                        f"decode replica {'retiring' if retiring else 'lost'} after {len(produced)} tokens and "
                        f"{attempt} migration(s) "
                        f"(max_migrations {self.max_migrations}; another decode replica: "
                        f"{'none' if attempt < self.max_migrations else 'not tried'}): {type(exc).__name__}"
                    ) from exc
                attempt += 1
                self.migrations += 1
                self.on_migration()
                if retiring:
                    # a planned stop (a scale-down), not a failure: the rest goes straight to
                    # another decode replica, which computes prompt + tokens so far itself,
                    # rather than through a prefill pool that a scale-down is often growing for
                    self.retired_streams += 1
                    logger.info(
                        "request %s: its decode replica is retiring after %d tokens; resuming on "
                        "another decode replica (migration %d of at most %d)",
                        choice.request_id,
                        len(produced),
                        attempt,
                        self.max_migrations,
                    )
                else:
                    logger.warning(
                        "request %s: decode replica lost after %d tokens (%s); resuming on another "
                        "replica (migration %d of at most %d)",
                        choice.request_id,
                        len(produced),
                        type(exc).__name__,
                        attempt,
                        self.max_migrations,
                    )
                current = continuation(choice, produced, attempt, self.rehash) if produced else choice
                to_decode = retiring
                if retired_from:  # Serve stops routing to it; until the router hears, rank it last
                    avoid += (retired_from,)
                current = dataclasses.replace(current, avoid_workers=avoid)

    def _moved(
        self, choice: GenerateRequest, produced: list[int], handoff: PrefillResult, moves: int
    ) -> tuple[GenerateRequest, PrefillResult | None]:
        """The continuation of a stream its decode replica moved live, and the hand-off another
        decode replica pulls its KV by: the KV covers every token sent but the last, which is the
        hand-off's first token. A hand-off naming other tokens than the client has (a bug, never
        expected) is released and the stream recomputed from what the client has."""
        expected = (*choice.prompt_token_ids, *produced[:-1])
        if produced and handoff.first_token_id == produced[-1] and handoff.prompt_token_ids == expected:
            self.live_migrations += 1
            self.on_live_migration()
            logger.info(
                "request %s: moved live from decode replica %s after %d tokens",
                choice.request_id,
                handoff.kv_handle.prefill_worker_id if handoff.kv_handle else "?",
                len(produced),
            )
            return continuation(choice, produced[:-1], moves, self.rehash, kind="v"), handoff
        logger.warning(
            "request %s: a moved stream's hand-off does not match its tokens; recomputing", choice.request_id
        )
        self._release_prefill(handoff)
        return continuation(choice, produced, moves, self.rehash, kind="v"), None

    async def _another_decode_replica(self, lost: str | None) -> bool:
        """Whether a decode replica besides ``lost`` may take the rest: the index lists a live
        decode worker other than it. The lost one's record lives until its heartbeat expires,
        which may be before or after Ray reports the replica dead (a lost host takes Ray
        seconds to notice), so it is excluded by name; unnamed, two live records are needed.
        Without the index we cannot tell, and let Serve route the continuation."""
        if self.index is None:
            return True
        workers = await self.index.live_workers(role="decode")
        if workers is None:
            return True
        if lost is None:
            return len(workers) >= 2
        return any(worker_id != lost for worker_id in workers)

    async def _generate_once(
        self, choice: GenerateRequest, allow_skip: bool, to_decode: bool = False, handoff: PrefillResult | None = None
    ) -> AsyncGenerator[TokenChunk, None]:
        if handoff is not None:  # a stream moved live: decode goes on from its KV
            started = False
            try:
                async for chunk in self._decode(choice, handoff):
                    started = True
                    yield chunk
            finally:
                if not started:  # no decode replica took it (or the client left): free the source's copy
                    self._release_prefill(handoff)
            return
        holder = await self._decode_holding_prompt(choice) if allow_skip and not to_decode else None
        if to_decode or holder is not None:
            if holder is not None:
                self.skipped_prefills += 1
            # The decode router ranks the replica holding the prefix first (it looks the same
            # blocks up); if it has no room now, another computes the whole prompt itself.
            stream = self.decode.options(stream=True).generate_local.remote(choice)
            async for chunk in self._relay(stream, choice):
                yield chunk
            return
        result = await self._prefill(choice)
        handed_off = False
        try:
            yield first_chunk(result)
            if result.finish_reason is not None:
                return
            handed_off = True
            async for chunk in self._decode(choice, result):
                yield chunk
        finally:
            if not handed_off:
                # Left after the first token (client gone, or a stop string in it): the prefill
                # replica holds the prompt's blocks for a decode call that will not come.
                self._release_prefill(result)

    async def _decode(self, choice: GenerateRequest, result: PrefillResult) -> AsyncIterator[TokenChunk]:
        """The decode stage. The first token is already out, so a full decode queue is waited
        out (with backoff) rather than refused: while the wait lasts, the prefill worker's lease
        on the prompt's blocks is extended (at its control address), up to ``MAX_DECODE_WAIT_S``."""
        deadline = result.kv_handle.lease_expires_at - 1.0 if result.kv_handle else time.time()
        give_up = time.time() + MAX_DECODE_WAIT_S
        backoff = 0.05
        while True:
            stream = self.decode.options(stream=True).generate.remote(choice, result)
            started = False
            try:
                async for chunk in self._relay(stream, choice):
                    started = True
                    yield chunk
                return
            except RequestError as exc:
                if started or exc.status != 503:
                    raise
                if time.time() + backoff > deadline:
                    extended = await self._extend_lease(result, give_up)
                    if extended is None or extended.kv_handle is None:
                        raise
                    result, deadline = extended, extended.kv_handle.lease_expires_at - 1.0
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _extend_lease(self, result: PrefillResult, give_up: float) -> PrefillResult | None:
        """``result`` with its lease extended by ``LEASE_EXTENSION_S``, or None when the wait is
        over or the prefill worker cannot extend it (the caller then fails the request)."""
        handle = result.kv_handle
        if handle is None or self.control is None or time.time() + LEASE_EXTENSION_S / 2 > give_up:
            return None
        try:
            left = await self.control.extend(handle.address, handle.request_id, LEASE_EXTENSION_S, CONTROL_TIMEOUT_S)
        except KVTransferError as exc:
            logger.warning(
                "request %s: could not extend its KV lease on %s while waiting for decode room: %s",
                handle.request_id,
                handle.prefill_worker_id,
                exc,
            )
            return None
        return dataclasses.replace(result, kv_handle=dataclasses.replace(handle, lease_expires_at=time.time() + left))

    async def _decode_holding_prompt(self, choice: GenerateRequest) -> str | None:
        """A decode replica whose cache holds nearly all of the prompt (e.g. the previous turn
        of a conversation it generated), or None."""
        if self.index is None or len(choice.block_hashes) < 2:
            return None
        matches = await self.index.longest_prefix(list(choice.block_hashes), role="decode")
        if not matches:
            return None
        replica, blocks = max(matches.items(), key=lambda kv: kv[1])
        return replica if blocks >= SKIP_PREFILL_FRACTION * len(choice.block_hashes) else None

    async def _prefill(self, choice: GenerateRequest) -> PrefillResult:
        """Prefill on the routed replica; if that replica dies first, once more on another."""
        for attempt in (1, 2):
            try:
                return await self.prefill.prefill.remote(choice)
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError) as exc:
                if attempt == 2:
                    raise
                self.prefill_retries += 1
                logger.warning("prefill replica died during %s, retrying elsewhere: %s", choice.request_id, exc)
            except (ray.exceptions.RayTaskError, BackPressureError, DeploymentUnavailableError) as exc:
                raise client_error(exc) from exc
        raise AssertionError("unreachable")

    def _release_prefill(self, result: PrefillResult) -> None:
        """Free the blocks a prefill replica holds for ``result`` now, not when its lease ends.
        Fire and forget (it runs while this request is being cancelled); the lease covers a
        call that does not arrive."""
        handle, control = result.kv_handle, self.control
        if handle is None or control is None:
            return

        async def release() -> None:
            with contextlib.suppress(Exception):
                await control.release(handle.address, result.request_id, CONTROL_TIMEOUT_S)

        with contextlib.suppress(RuntimeError):  # no running loop (finalized at exit): the lease frees
            task = asyncio.get_running_loop().create_task(release())
            self._background.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(self._background.discard)

    async def _relay(self, stream, choice: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """The chunks of one worker call: from the output channel when ``choice`` names this
        ingress's sink, else (or when the worker could not reach it) from the call's stream."""
        sink = self.sink
        if choice.output_address is None or sink is None:
            async for chunk in self._relay_stream(stream):
                yield chunk
            return
        # Registered before this task first awaits: the sink reads on this event loop, so no chunk
        # of the call can arrive before it.
        queue = sink.open(choice.request_id)

        async def watch() -> None:  # the call: what it yields (a worker's fallback), how it ends
            try:
                async for chunk in self._relay_stream(stream):
                    queue.put_nowait(chunk)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, cancellation too
                queue.put_nowait(exc)
                if is_cancellation(exc):
                    raise
            else:
                queue.put_nowait(_CALL_ENDED)

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            grace: float | None = None  # once the call ended cleanly: how long its last chunk may take
            while True:
                try:  # (wait_for without a timeout is a plain await: nothing added per token)
                    item = await asyncio.wait_for(queue.get(), grace)
                except asyncio.TimeoutError:
                    raise OutputChannelError(
                        f"request {choice.request_id}: the worker finished but its last tokens did not "
                        f"arrive on the output channel within {END_GRACE_S:g} s"
                    ) from None
                if item is _CALL_ENDED:  # the last chunk is still on the channel
                    grace = END_GRACE_S
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
                if terminal(item):
                    return
        finally:
            sink.close(choice.request_id)
            if not watcher.done():
                watcher.cancel()  # its stream's finally cancels the call: the worker aborts

    @staticmethod
    async def _relay_stream(stream) -> AsyncIterator[TokenChunk]:
        try:
            async for chunk in stream:
                yield chunk
        except (ray.exceptions.RayTaskError, BackPressureError, DeploymentUnavailableError) as exc:
            raise client_error(exc) from exc
        finally:
            # No-op when it finished; aborts the worker's request otherwise. Ray re-raises a
            # routing error stored in the response here: the one above already counts.
            with contextlib.suppress(Exception):
                stream.cancel()


def first_chunk(result: PrefillResult) -> TokenChunk:
    logprobs = None
    if result.first_token_logprob is not None:
        logprobs = (
            TokenLogprobs(result.first_token_id, result.first_token_logprob, tuple(result.first_token_top_logprobs)),
        )
    return TokenChunk(
        request_id=result.request_id,
        token_ids=(result.first_token_id,),
        logprobs=logprobs,
        finish_reason=result.finish_reason,
        num_cached_tokens=result.num_cached_tokens,
        timing=result.timing,
    )


class PoolReadiness:
    """``/health``'s state: "starting" until every pool has answered one call (each has a
    running replica its handle can reach), then "ok" — until ``stopping`` is set (the ingress
    drains before a stop), which is final.

    ``status()`` never waits: it starts the probe in the background on first use and reports
    what is known. A probe is a cheap call (``stats``) through the pool's handle: with no
    replica running yet it waits in the router, and it returns as soon as one runs.
    """

    def __init__(self, pools: dict[str, object | None], probe_timeout_s: float = 10.0, retry_s: float = 0.5) -> None:
        self.pools = {name: handle for name, handle in pools.items() if handle is not None}
        self.ready: set[str] = set()
        self.probe_timeout_s = probe_timeout_s
        self.retry_s = retry_s
        self.stopping = False
        self._task: asyncio.Task | None = None

    @property
    def is_ready(self) -> bool:
        return len(self.ready) == len(self.pools)

    def status(self) -> dict:
        if self.stopping:
            return {"status": "stopping"}
        if self.is_ready:
            return {"status": "ok"}
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._probe_all())
        return {
            "status": "starting",
            "pools": {name: "ready" if name in self.ready else "starting" for name in self.pools},
        }

    async def _probe_all(self) -> None:
        await asyncio.gather(*(self._probe(name) for name in self.pools if name not in self.ready))

    async def _probe(self, name: str) -> None:
        while name not in self.ready:
            try:
                await asyncio.wait_for(self._call(self.pools[name]), self.probe_timeout_s)
            except Exception as exc:  # noqa: BLE001 - not up yet: try again
                logger.debug("pool %s not ready yet: %s: %s", name, type(exc).__name__, exc)
                await asyncio.sleep(self.retry_s)
                continue
            self.ready.add(name)
            logger.info("pool %s: a replica answers", name)

    @staticmethod
    async def _call(handle) -> object:
        return await handle.stats.remote()
