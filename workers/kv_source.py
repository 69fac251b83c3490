"""The sending half of a KV hand-over, shared by the prefill worker (a prompt's KV after its
first token) and the decode worker (a running stream's KV, moved live to another decode worker).

A request's blocks stay held in the engine (HELD_FOR_DECODE) under a lease. Exactly one of
these frees them: the send after the receiver's Send call (claimed), ``release`` (the receiver
already had every block, or the request ended), or the lease expiring (nobody came). Receivers
and the ingress reach the holder directly through its KV control server
(``workers/transfer/control.py``) at the address every KVHandle carries: ``start()`` opens it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from workers.engine_loop import EngineLoop
from workers.protocol import KVHandle, KVLayout, TransferAddress, TransferRequest
from workers.threads import one_torch_thread
from workers.transfer import KVTransferError, KVTransferServer, LeaseTable, SendResult, TransferConfig
from workers.transfer.control import ControlHandlers, ControlServer, Refused
from workers.transfer.tp_transfer import TPSender, open_config, rank_channel, rank_worker_id
from workers.worker_stats import WorkerStats

logger = logging.getLogger(__name__)


class KVSource:
    def __init__(
        self,
        loop: EngineLoop,
        worker_id: str,
        transfer_config: TransferConfig,
        stats: WorkerStats,
        lease_ttl_s: float = 30.0,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.loop = loop
        self.worker_id = worker_id
        self.transfer_config = transfer_config
        self.stats = stats
        engine = loop.engine
        self.server = KVTransferServer(worker_id, transfer_config, device=engine.device)
        self.layout: KVLayout = engine.model_kv_layout  # every KV head: what the receiver compares
        # Tensor parallel (either side): one message per rank pair, sent by every rank that holds heads.
        self.rank_addresses: tuple[TransferAddress, ...] = ()
        self._tp_sender = TPSender(
            self.server, engine.tensor_parallel_size, *rank_channel(loop.call_future, engine.tensor_parallel)
        )
        self.lease_ttl_s = lease_ttl_s
        self.leases = LeaseTable()
        self.leases.start(interval_s=min(1.0, lease_ttl_s / 4))
        # Sends block until the receiver has the blocks: a pool, so they never block the event loop.
        self._senders = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-send", initializer=one_torch_thread)
        self._sending: set[asyncio.Task] = set()
        self._before_send = before_send  # fault injection (a stalled sender), tests only
        self.control = ControlServer(
            worker_id,
            transfer_config.host,
            ControlHandlers(send=self._on_send_call, release=self._on_release_call, extend=self._on_extend_call),
        )
        self.address = self.server.address  # with the control port once started

    async def start(self) -> None:
        """Open the control server (in the event loop that runs the worker)."""
        await self.control.start()
        self.address = self.control.address_of(self.server.address)
        if self.loop.engine.tensor_parallel is not None:
            op = open_config("prefill", self.worker_id, self.transfer_config, self.address.generation)
            reports = await self.loop.call(lambda e: e.open_rank_transfers(op))
            own = replace(self.address, worker_id=rank_worker_id(self.worker_id, 0))
            self.rank_addresses = (own, *(r.address for r in reports if r.address is not None))
            logger.info(
                "%s: %d tensor-parallel ranks send KV (%s)",
                self.worker_id,
                len(self.rank_addresses),
                ", ".join(f"{a.host}:{a.port}" for a in self.rank_addresses),
            )

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        """Put the engine's held blocks of ``request_id`` under a lease; the handle a receiver
        pulls them by."""
        self.leases.grant(request_id, self.lease_ttl_s, self._on_lease_end)
        engine = self.loop.engine
        return KVHandle(
            request_id=request_id,
            prefill_worker_id=self.worker_id,
            address=self.address,
            block_ids=tuple(block_ids),
            num_tokens=num_tokens,
            layout=self.layout,
            lease_expires_at=time.time() + self.lease_ttl_s,
            tensor_parallel_size=engine.tensor_parallel_size,
            rank_addresses=self.rank_addresses,
        )

    @property
    def num_leases(self) -> int:
        return len(self.leases)

    def _claim(self, request: TransferRequest) -> None:
        rid = request.request_id
        if not self.leases.claim(rid):
            raise KVTransferError(
                f"no live lease for {rid} on {self.worker_id} (expired or already sent)",
                peer_id=request.decode_worker_id,
                request_id=rid,
            )

    async def send_kv(self, request: TransferRequest) -> SendResult:
        """Send the requested blocks to the worker that asked, then free them (claims the lease
        and waits for the send: an in-process caller's entry point)."""
        self._claim(request)
        return await self._send_claimed(request)

    async def _send_claimed(self, request: TransferRequest) -> SendResult:
        rid = request.request_id
        loop = asyncio.get_running_loop()
        try:
            if request.pairs:  # tensor parallel on either side: every rank sends its heads
                self.layout.check_matches(request.layout, ours="sender", theirs="receiver")
                send = self._tp_sender.send
            else:
                send = self.server.send
            result = await loop.run_in_executor(
                self._senders, send, request, self.loop.engine.kv_caches, self.transfer_config.transfer_timeout_s
            )
            if result.stats.rank_bytes:
                self.stats.add_rank_bytes(result.stats.rank_bytes)
            self.stats.transfers += 1
            self.stats.transfer_bytes += result.stats.num_bytes
            self.stats.transfer_seconds += result.stats.seconds
            return result
        except Exception:
            self.stats.transfer_failed()
            raise
        finally:
            # The object store holds its own copy; a pair group has delivered or failed.
            self.loop.call_future(lambda e: e.release_kv(rid))

    # ------------------------------------------------------------ the control server's calls
    async def _on_send_call(self, request: TransferRequest) -> None:
        """A receiver's Send: claim the lease and start the send, then answer (the send
        completes only once the receiver has the blocks, so the answer cannot wait for it)."""
        if self._before_send is not None:
            await self._before_send()
        try:
            self._claim(request)
        except KVTransferError as exc:
            raise Refused(str(exc)) from exc
        task = asyncio.get_running_loop().create_task(self._send_claimed(request))
        self._sending.add(task)  # the loop keeps only a weak reference

        def forget(t: asyncio.Task) -> None:
            self._sending.discard(t)
            if not t.cancelled():
                # Retrieved: the send counts and logs its own failure; the receiver sees it as its own.
                t.exception()

        task.add_done_callback(forget)

    async def _on_release_call(self, request_id: str) -> bool:
        return await self.release(request_id)

    async def _on_extend_call(self, request_id: str, ttl_s: float) -> float:
        left = self.leases.extend(request_id, ttl_s)
        if left is None:
            raise Refused(f"no live lease for {request_id} on {self.worker_id} (expired or already sent)")
        return left

    async def release_now(self, request_id: str) -> bool:
        """Free held blocks; the release runs even if this call is cancelled meanwhile (awaiting
        the engine's future directly would cancel it before it ran)."""
        return await asyncio.shield(asyncio.wrap_future(self.loop.call_future(lambda e: e.release_kv(request_id))))

    async def release(self, request_id: str) -> bool:
        """The receiver needs none of the blocks (it had them all): free them now."""
        if not self.leases.release(request_id):
            return False
        return await self.release_now(request_id)

    def _on_lease_end(self, request_id: str, reason: str) -> None:
        if reason == "expired":
            self.stats.leases_expired += 1
            logger.warning("lease on %s expired on %s: freeing its blocks", request_id, self.worker_id)
            self.loop.call_future(lambda e: e.release_kv(request_id))
        # "claimed": the send frees after sending; "released": release() frees.

    async def wait_sent(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every lease to end and every send to finish (a stopping
        decode worker whose streams were moved); returns how many are still open."""
        deadline = time.monotonic() + timeout_s
        while (self.num_leases or self._sending) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.num_leases + len(self._sending)

    async def shutdown(self) -> None:
        await self.control.stop()
        self.leases.close()
        self._senders.shutdown(wait=False, cancel_futures=True)
        self.server.close()
