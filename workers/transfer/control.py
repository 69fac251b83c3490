"""The KV control path: a decode worker (or the ingress) talks to the prefill worker that holds
a request's KV directly, at the control address its KVHandle advertises, for everything about
one transfer: request the send, release the blocks, extend the lease. Nothing about a transfer
goes through a Serve handle, so no call is pinned to a replica, no control call takes a slot of
a replica's ``max_ongoing_requests`` next to real requests, and a replica Serve has just started
is reachable the moment its first KVHandle exists.

Why gRPC (``grpc.aio``): it is already installed (Ray depends on it), it multiplexes concurrent
calls over one HTTP/2 connection per peer, and a deadline is part of every call rather than
something to build on top (pyzmq's REQ/REP, what vLLM's P2P connector uses, has none and stalls
on a lost reply). The service is generic: unary methods whose payloads are this package's
frozen dataclasses as JSON (``workers.protocol.encode``/``decode``): no generated stubs, no
pickle on the wire.

Deadlines and restarts:
  * every call carries a deadline (``timeout_s``); a dead or unreachable peer fails the call
    with ``ControlError`` by its deadline (gRPC's DEADLINE_EXCEEDED or UNAVAILABLE), never a hang;
  * each server draws a ``generation`` when it starts and puts it in every reply and in the
    ``TransferAddress`` its KVHandles carry. A reply from another generation than the address
    names means the worker restarted behind the same address: the call fails with
    ``PeerRestarted`` and the caller tears its pair group with that worker down (its blocks and
    its end of the group are gone). The prefill side sees a restarted decode worker by its epoch:
    epochs count up from the wall clock, so a new process starts above every epoch it used.

Every worker replica runs one (colocated ones answer only ``Stats`` and ``Hello``; a decode one
also the lease calls for streams it moved live, ``Move`` (an operator's or the ingress's word to
move a stream, see ``DecodeWorker.move``) and ``Retire``: the autoscaler's word that Serve is
stopping it, see ``DecodeWorker.retire``):
the cluster status reads each replica's figures there, at the address the replica registered in
its application's worker directory (``deploy/pools/directory.py``), again without a Serve call.

The send is acknowledged as soon as the prefill side has claimed the lease and started its
send (its send completes only once the decode side receives, so it cannot be waited for):
a decode worker learns within one round trip that a lease is gone or the peer is unreachable,
and recomputes instead of waiting out the transfer deadline.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
from grpc import aio

from workers.protocol import TransferAddress, TransferRequest, decode, encode
from workers.transfer.errors import KVTransferError

logger = logging.getLogger(__name__)
M = TypeVar("M")  # a control message

SERVICE = "pdserve.KVControl"
MAX_MESSAGE_BYTES = 16 << 20  # a TransferRequest names block ids; 16 MiB covers millions


class ControlError(KVTransferError):
    """A control call failed: the peer refused it (``refused``: e.g. no live lease), was not
    reachable, or missed the call's deadline."""

    def __init__(self, message: str, *, peer_id: str, request_id: str = "", refused: bool = False) -> None:
        super().__init__(message, peer_id=peer_id, request_id=request_id)
        self.refused = refused


class PeerRestarted(ControlError):
    """The worker at the address answered with another generation: it restarted."""


# ----------------------------------------------------------------- messages (JSON, see protocol)
@dataclass(frozen=True, slots=True)
class LeaseCall:
    """Release a request's blocks (``ttl_s`` 0) or extend its lease by ``ttl_s`` seconds."""

    request_id: str
    ttl_s: float = 0.0


@dataclass(frozen=True, slots=True)
class MoveCall:
    """Move the decode streams ``request_id`` names to another decode worker: live (their KV
    moves), or with ``recompute`` by ending them for a recompute there."""

    request_id: str
    recompute: bool = False


@dataclass(frozen=True, slots=True)
class ControlReply:
    """Every method's answer: ``ok``, the server's generation, and for ``ok`` False the reason."""

    ok: bool
    generation: int
    worker_id: str
    error: str = ""
    value: float = 0.0  # Release: 1.0 if a lease ended; ExtendLease: seconds the lease has left
    data: dict[str, Any] | None = None  # Stats: the worker's figures


@dataclass(frozen=True, slots=True)
class Hello:
    """An empty call: the server's identity (its reply) and a round trip."""

    sender: str = ""


class Refused(Exception):
    """Raised by a handler: the call is well formed but cannot be done (reply ``ok`` False)."""


@dataclass
class ControlHandlers:
    """What a worker does for each call: a prefill worker has the three lease calls, every
    worker ``stats`` (the cluster status reads each replica's figures here). A missing handler,
    or one raising ``Refused``, answers no; anything else a handler raises is a bug, logged here
    and answered as a refusal naming it."""

    send: Callable[[TransferRequest], Awaitable[None]] | None = None
    release: Callable[[str], Awaitable[bool]] | None = None
    extend: Callable[[str, float], Awaitable[float]] | None = None
    stats: Callable[[], Awaitable[dict[str, Any]]] | None = None
    # a decode worker that Serve is stopping: hand every stream over (returns how many)
    retire: Callable[[], Awaitable[int]] | None = None
    # a decode worker: move the streams a request id names live to another decode worker
    # (returns the ids moved)
    move: Callable[[str, bool], Awaitable[list[str]]] | None = None
    # a decode worker: a live move's first phase (``DecodeWorker.precopy``): each stream's
    # full blocks held for another worker while it goes on ({"copies": [...]})
    precopy: Callable[[str], Awaitable[dict[str, Any]]] | None = None


class ControlServer:
    """Serves a prefill worker's control calls on ``host`` (the node's address), any free port.

    Start it inside the event loop that runs the worker (``await start()``); ``address_of``
    stamps the port and this process's generation onto the worker's ``TransferAddress``.
    """

    def __init__(self, worker_id: str, host: str, handlers: ControlHandlers) -> None:
        self.worker_id = worker_id
        self.host = host
        self.handlers = handlers
        self.generation = secrets.randbits(62) or 1
        self.port = 0
        self._server: aio.Server | None = None

    async def start(self) -> int:
        server = aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ]
        )
        methods = {
            "Send": self._method(TransferRequest, self._send),
            "Release": self._method(LeaseCall, self._release),
            "ExtendLease": self._method(LeaseCall, self._extend),
            "Hello": self._method(Hello, self._hello),
            "Stats": self._method(Hello, self._stats),
            "Retire": self._method(Hello, self._retire),
            "Move": self._method(MoveCall, self._move),
            "PreCopy": self._method(MoveCall, self._precopy),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
        self.port = server.add_insecure_port(f"{self.host}:0")
        if not self.port:
            raise OSError(f"KV control server of {self.worker_id} could not bind {self.host}")
        await server.start()
        self._server = server
        logger.info(
            "KV control server %s listening on %s:%d (generation %x)",
            self.worker_id,
            self.host,
            self.port,
            self.generation,
        )
        return self.port

    def address_of(self, address: TransferAddress) -> TransferAddress:
        return replace(address, control_port=self.port, generation=self.generation)

    def _method(self, message_type: type[M], handler: Callable[[M], Awaitable[ControlReply]]):
        async def call(payload: bytes, context: aio.ServicerContext) -> bytes:
            try:
                message = decode(message_type, payload)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad {message_type.__name__}: {exc}")
            try:
                reply = await handler(message)
            except Refused as exc:
                reply = self._reply(False, str(exc))
            except Exception as exc:  # noqa: BLE001 - answered as a refusal; the caller recomputes
                logger.exception("KV control call %s on %s failed", message_type.__name__, self.worker_id)
                reply = self._reply(False, f"{type(exc).__name__}: {exc}")
            return encode(reply)

        return grpc.unary_unary_rpc_method_handler(call)

    def _reply(self, ok: bool, error: str = "", value: float = 0.0, data: dict[str, Any] | None = None) -> ControlReply:
        return ControlReply(ok, self.generation, self.worker_id, error, value, data)

    def _handler(self, name: str) -> Callable:
        handler = getattr(self.handlers, name)
        if handler is None:
            raise Refused(f"{self.worker_id} holds no KV for other workers (it takes no {name} calls)")
        return handler

    async def _send(self, request: TransferRequest) -> ControlReply:
        await self._handler("send")(request)
        return self._reply(True)

    async def _release(self, call: LeaseCall) -> ControlReply:
        released = await self._handler("release")(call.request_id)
        return self._reply(True, value=float(released))

    async def _extend(self, call: LeaseCall) -> ControlReply:
        if call.ttl_s <= 0:
            raise Refused(f"ttl_s must be positive to extend a lease, got {call.ttl_s}")
        return self._reply(True, value=await self._handler("extend")(call.request_id, call.ttl_s))

    async def _hello(self, _: Hello) -> ControlReply:
        return self._reply(True)

    async def _stats(self, _: Hello) -> ControlReply:
        return self._reply(True, data=await self._handler("stats")())

    async def _retire(self, _: Hello) -> ControlReply:
        return self._reply(True, value=float(await self._handler("retire")()))

    async def _move(self, call: MoveCall) -> ControlReply:
        moved = await self._handler("move")(call.request_id, call.recompute)
        return self._reply(True, value=float(len(moved)), data={"moved": moved})

    async def _precopy(self, call: MoveCall) -> ControlReply:
        return self._reply(True, data=await self._handler("precopy")(call.request_id))

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace_s)


class ControlClient:
    """Calls prefill workers' control servers; one HTTP/2 channel per peer address, reused.

    Use it from one event loop (the worker's or the ingress's): channels belong to the loop that
    made them. ``close()`` ends them.
    """

    def __init__(self, caller_id: str = "") -> None:
        self.caller_id = caller_id
        self._channels: dict[tuple[str, int], aio.Channel] = {}

    def _channel(self, address: TransferAddress) -> aio.Channel:
        key = (address.host, address.control_port)
        channel = self._channels.get(key)
        if channel is None:
            channel = aio.insecure_channel(
                f"{address.host}:{address.control_port}",
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    # A peer that restarted at the same address is reconnected at once.
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
            self._channels[key] = channel
        return channel

    async def _call(
        self, address: TransferAddress, method: str, message: object, timeout_s: float, request_id: str = ""
    ) -> ControlReply:
        peer = address.worker_id
        if not address.control_port:
            raise ControlError(f"worker {peer} advertises no control port", peer_id=peer, request_id=request_id)
        stub = self._channel(address).unary_unary(f"/{SERVICE}/{method}")
        try:
            # wait_for_ready: a connection still being made (or remade) counts against the
            # deadline instead of failing the call at once.
            payload = await stub(encode(message), timeout=timeout_s, wait_for_ready=True)
        except aio.AioRpcError as exc:
            code = exc.code()
            what = "missed its deadline" if code is grpc.StatusCode.DEADLINE_EXCEEDED else f"failed ({code.name})"
            raise ControlError(
                f"{method} to {peer} at {address.host}:{address.control_port} {what} "
                f"after up to {timeout_s:g}s: {exc.details()}",
                peer_id=peer,
                request_id=request_id,
            ) from exc
        reply = decode(ControlReply, payload)
        if address.generation and reply.generation != address.generation:
            raise PeerRestarted(
                f"{peer} at {address.host}:{address.control_port} restarted (generation "
                f"{reply.generation:x}, the KVHandle names {address.generation:x}): its blocks are gone",
                peer_id=peer,
                request_id=request_id,
            )
        if not reply.ok:
            raise ControlError(
                f"{method} refused by {peer}: {reply.error}", peer_id=peer, request_id=request_id, refused=True
            )
        return reply

    async def send(self, address: TransferAddress, request: TransferRequest, timeout_s: float) -> None:
        """Ask the prefill worker at ``address`` to send ``request``'s blocks; returns once it has
        claimed the lease and started (its send then waits for our receive)."""
        await self._call(address, "Send", request, timeout_s, request.request_id)

    async def release(self, address: TransferAddress, request_id: str, timeout_s: float) -> bool:
        """Free ``request_id``'s blocks there now (decode needs none of them); False when the
        lease had already ended."""
        reply = await self._call(address, "Release", LeaseCall(request_id), timeout_s, request_id)
        return bool(reply.value)

    async def extend(self, address: TransferAddress, request_id: str, ttl_s: float, timeout_s: float) -> float:
        """Extend ``request_id``'s lease by ``ttl_s`` from now; returns the seconds it has left."""
        reply = await self._call(address, "ExtendLease", LeaseCall(request_id, ttl_s), timeout_s, request_id)
        return reply.value

    async def hello(self, address: TransferAddress, timeout_s: float) -> ControlReply:
        return await self._call(address, "Hello", Hello(self.caller_id), timeout_s)

    async def stats(self, address: TransferAddress, timeout_s: float) -> dict[str, Any]:
        """The worker's figures (what its replica's ``stats()`` returns)."""
        reply = await self._call(address, "Stats", Hello(self.caller_id), timeout_s)
        return reply.data or {}

    async def retire(self, address: TransferAddress, timeout_s: float) -> int:
        """Tell the decode worker at ``address``, which Serve is stopping, to hand its streams
        over (each resumes on another decode replica); returns how many it handed over."""
        reply = await self._call(address, "Retire", Hello(self.caller_id), timeout_s)
        return int(reply.value)

    async def move(
        self, address: TransferAddress, request_id: str, timeout_s: float, recompute: bool = False
    ) -> list[str]:
        """Ask the decode worker at ``address`` to move the streams ``request_id`` names to
        another decode worker (live, or with ``recompute`` by recomputing them there); returns
        the ids of those it moved."""
        reply = await self._call(address, "Move", MoveCall(request_id, recompute), timeout_s, request_id)
        return list((reply.data or {}).get("moved", []))

    async def precopy(self, address: TransferAddress, request_id: str, timeout_s: float) -> list[dict[str, Any]]:
        """Ask the decode worker at ``address`` to hold the full blocks of the streams
        ``request_id`` names for another worker (a live move's first phase); per stream: its
        ``request_id``, the copy's ``handle`` (a KVHandle), ``token_ids`` and ``cache_salt``."""
        reply = await self._call(address, "PreCopy", MoveCall(request_id), timeout_s, request_id)
        return list((reply.data or {}).get("copies", []))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
