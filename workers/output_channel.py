"""The output channel: a worker replica's tokens to the ingress replica that asked for them, one
message per engine step for all of that ingress's requests, instead of one Ray streaming item
per request per token.

Why: every Ray streaming item costs CPU at both ends, and on a CPU server that CPU comes out of
the engine's OpenMP threads; a step's tokens for N requests were N items
(docs/decisions/0019-output-channel.md). vLLM's API server gets
one message per step from its engine core; this channel does the same across Ray's processes.

How, per request (``GenerateRequest.output_address`` set by the ingress):
  * the ingress runs an ``OutputSink``, a TCP server on its node's address, and registers the
    request's queue there before calling the worker pool through Serve as before;
  * the worker replica's ``OutputSender`` keeps one connection per sink and writes each of the
    request's chunks to it; the chunks of one step (every request's for that ingress) leave in
    one frame, because the engine loop hands a step's outputs over in one event-loop callback
    and the frame is written by a task that runs after them;
  * the Serve call itself stays open and yields nothing until its generator ends: it still
    carries everything about the request's life. A replica that dies raises there (the ingress
    migrates the stream as before), a retiring replica's chunk is an ordinary chunk, a client
    that leaves cancels the call (the worker aborts the request, freeing its blocks), and a
    worker that cannot reach the sink yields its chunks on the call's stream instead.
  * The call ends once the worker wrote the request's last chunk (finished, or retiring). TCP
    delivers in order, but the two paths race: after the call ends cleanly the ingress waits up to
    ``END_GRACE_S`` for that last chunk, then fails the stream with ``OutputChannelError``.

Frames are a 4-byte big-endian length and ``OutputFrame`` as JSON (``workers.protocol.encode``):
no pickle on the wire, as on the KV control path. A connection that fails ends every request
that was sending on it with ``OutputChannelError`` (the ingress treats it like a lost replica),
and the next request opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

from workers.protocol import TokenChunk, decode, encode

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a step's chunks for one ingress; logprobs of many sequences stay far below
CONNECT_TIMEOUT_S = 5.0
RETRY_CONNECT_S = 30.0  # after a failed connect, requests for that sink stream on their calls this long
END_GRACE_S = 10.0  # the call ended cleanly: its last chunk is in flight on the channel


class OutputChannelError(ConnectionError):
    """The channel between a worker replica and an ingress replica broke while a request was
    using it, or its last chunk never arrived."""


@dataclass(frozen=True, slots=True)
class OutputFrame:
    """One write on the channel: chunks of any of the sink's requests, in the order produced."""

    chunks: tuple[TokenChunk, ...]


def terminal(chunk: TokenChunk) -> bool:
    """A request's last chunk from a replica: finished, or handed over (retiring, or moved)."""
    return chunk.finish_reason is not None or chunk.retiring or chunk.handoff is not None


# ------------------------------------------------------------------------------ worker side
class _Link:
    """One connection to a sink and the chunks waiting for the next frame."""

    def __init__(self, address: str, writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.writer = writer
        self.pending: list[tuple[TokenChunk, asyncio.Future]] = []
        self.flushing: asyncio.Task | None = None
        self.error: OutputChannelError | None = None
        self.frames = 0
        self.watch: asyncio.Future | None = None  # the read that returns when the sink closes

    def send(self, chunk: TokenChunk) -> asyncio.Future:
        if self.error is not None:
            raise self.error
        done = asyncio.get_running_loop().create_future()
        self.pending.append((chunk, done))
        if self.flushing is None or self.flushing.done():
            # A task, not a direct write: it runs after the other requests' tasks that this
            # step's outputs woke in the same loop iteration, so they share one frame.
            self.flushing = asyncio.get_running_loop().create_task(self._flush())
        return done

    async def _flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, []
            try:
                body = encode(OutputFrame(tuple(chunk for chunk, _ in batch)))
                self.writer.write(_LENGTH.pack(len(body)) + body)
                await self.writer.drain()
            except (OSError, RuntimeError) as exc:  # reset, closed transport
                self.pending = batch + self.pending  # fail() fails them with the rest
                self.fail(OutputChannelError(f"output channel to {self.address} broke: {exc!r}"))
                return
            self.frames += 1
            for _, done in batch:
                if not done.done():
                    done.set_result(None)

    def fail(self, error: OutputChannelError) -> None:
        if self.error is None:
            self.error = error
        for _, done in self.pending:
            if not done.done():
                done.set_exception(error)
        self.pending = []
        self.writer.close()


class OutputSender:
    """A worker replica's connections to the sinks of the ingress replicas it serves."""

    def __init__(self, worker_id: str, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.worker_id = worker_id
        self.connect_timeout_s = connect_timeout_s
        self._links: dict[str, _Link] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._unreachable: dict[str, tuple[float, OutputChannelError]] = {}  # address -> (until, why)
        self.fallbacks = 0  # requests whose sink could not be reached: chunks went on the call's stream

    async def link(self, address: str) -> _Link:
        """The open connection to ``address``; OutputChannelError when it cannot be opened."""
        link = self._links.get(address)
        if link is not None and link.error is None:
            return link
        loop = asyncio.get_running_loop()
        failed = self._unreachable.get(address)
        if failed is not None and loop.time() < failed[0]:
            raise failed[1]  # not every request should wait out a connect that just failed
        pending = self._connecting.get(address)
        if pending is None:  # one connect per sink however many requests wait for it
            pending = asyncio.ensure_future(self._connect(address))
            self._connecting[address] = pending
            pending.add_done_callback(lambda _: self._connecting.pop(address, None))
        return await asyncio.shield(pending)

    async def _connect(self, address: str) -> _Link:
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError, ValueError) as exc:
            error = OutputChannelError(f"output sink {address} unreachable: {exc!r}")
            self._unreachable[address] = (asyncio.get_running_loop().time() + RETRY_CONNECT_S, error)
            raise error from exc
        self._unreachable.pop(address, None)
        link = self._links[address] = _Link(address, writer)
        # The sink never writes: a read that returns means it closed (or the link broke).
        task = asyncio.ensure_future(reader.read(1))

        def closed(done: asyncio.Future) -> None:
            if not done.cancelled():
                done.exception()  # retrieved: a reset says the same as a close
            link.fail(OutputChannelError(f"output sink {address} closed the channel"))
            if self._links.get(address) is link:
                del self._links[address]

        task.add_done_callback(closed)
        link.watch = task
        logger.info("worker %s: output channel to ingress %s open", self.worker_id, address)
        return link

    async def stream(self, address: str | None, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
        """Drive ``chunks`` (one request's) to the sink at ``address``; yields nothing unless the
        sink cannot be reached, in which case every chunk is yielded instead (the caller yields
        it on the Serve call's stream). Returns once the last chunk is written."""
        link = None
        if address is not None:
            try:
                link = await self.link(address)
            except OutputChannelError as exc:
                self.fallbacks += 1
                if self.fallbacks == 1 or self.fallbacks % 1000 == 0:  # not one line per request
                    logger.warning(
                        "worker %s: %s; streaming over the call instead (%d request(s) so far)",
                        self.worker_id,
                        exc,
                        self.fallbacks,
                    )
        async with contextlib.aclosing(chunks) as source:  # type: ignore[type-var]
            async for chunk in source:
                if link is None:
                    yield chunk
                else:
                    await link.send(chunk)

    def stats(self) -> dict:
        return {
            "links": len(self._links),
            "frames": sum(link.frames for link in self._links.values()),
            "fallbacks": self.fallbacks,
        }

    async def close(self) -> None:
        for link in list(self._links.values()):
            link.fail(OutputChannelError("the worker replica is stopping"))
        self._links.clear()


# ------------------------------------------------------------------------------ ingress side
class OutputSink:
    """An ingress replica's end: a TCP server the worker replicas connect to, and the queue of
    every request in flight through it."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue] = {}
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self.address: str | None = None
        self.frames = 0
        self.chunks = 0
        self.dropped = 0  # chunks of requests no longer listened for (cancelled, migrated)

    async def start(self, host: str) -> str:
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{host}:{port}"
        return self.address

    def open(self, request_id: str) -> asyncio.Queue:
        """Listen for ``request_id``'s chunks (register before the worker can send them)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def stats(self) -> dict:
        """What ``/v1/cluster/status`` shows: the channel's figures since the replica started."""
        return {
            "address": self.address,
            "connections": len(self._connections),
            "frames": self.frames,
            "chunks": self.chunks,
            "dropped_chunks": self.dropped,
            "listening": len(self._queues),
        }

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        self._connections.add(writer)
        try:
            while True:
                try:
                    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                    if length > MAX_FRAME_BYTES:
                        raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
                    frame = decode(OutputFrame, await reader.readexactly(length))
                except asyncio.IncompleteReadError:
                    return  # the worker closed it (stopping) or its process is gone
                self.frames += 1
                for chunk in frame.chunks:
                    queue = self._queues.get(chunk.request_id)
                    if queue is None:
                        self.dropped += 1
                    else:
                        self.chunks += 1
                        queue.put_nowait(chunk)
        except (OSError, ValueError) as exc:
            logger.warning("output channel from %s closed: %s", peer, exc)
        finally:
            self._connections.discard(writer)
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
