"""Prefill worker: runs prompts to their first token, keeps the KV blocks under a lease, and
sends them to the decode worker that claims them.

Block lifetime on this side: a finished prefill holds its blocks (``hold_kv``) and gets a lease.
Exactly one of these frees them: the send after a decode worker's Send call (claimed),
``release`` (the decode side already had every block, or the request ended), or the lease
expiring (no decode worker came). Cached full blocks stay in the prefix cache after being freed.

Decode workers and the ingress reach this worker directly, through its KV control server
(``workers/transfer/control.py``) at the address every KVHandle carries: ``start()`` opens it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from workers.engine import LLMEngine, SamplingParams
from workers.engine_loop import EngineDeadError, EngineLoop
from workers.protocol import GenerateRequest, KVHandle, KVLayout, PrefillResult, TransferAddress, TransferRequest
from workers.threads import one_torch_thread
from workers.transfer import KVTransferError, KVTransferServer, LeaseTable, SendResult, TransferConfig
from workers.transfer.control import ControlHandlers, ControlServer, Refused
from workers.transfer.tp_transfer import TPSender, open_config, rank_channel, rank_worker_id
from workers.worker_stats import WorkerStats

logger = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(
        self,
        engine: LLMEngine | EngineLoop,
        worker_id: str,
        transfer_config: TransferConfig | None = None,
        lease_ttl_s: float = 30.0,
        on_step=None,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``engine``: the engine, or the loop already driving it (a server builds the engine on
        the loop's thread: workers/engine_loop.py says why)."""
        self.worker_id = worker_id
        self.loop = engine if isinstance(engine, EngineLoop) else EngineLoop(engine, on_step)
        if on_step is not None:
            self.loop.on_step = on_step
        self.engine = engine = self.loop.engine
        self.stats = WorkerStats("prefill")
        self.transfer_config = transfer_config or TransferConfig()
        self.server = KVTransferServer(worker_id, self.transfer_config, device=engine.device)
        self.layout: KVLayout = engine.model_kv_layout  # every KV head: what the decode side compares
        # Tensor parallel (either side): one message per rank pair, sent by every rank that holds heads.
        self.rank_addresses: tuple[TransferAddress, ...] = ()
        tp = engine.tensor_parallel
        self._tp_sender = TPSender(
            self.server,
            engine.tensor_parallel_size,
            *rank_channel(self.loop.call_future, tp),
        )
        self.lease_ttl_s = lease_ttl_s
        self.leases = LeaseTable()
        self.leases.start(interval_s=min(1.0, lease_ttl_s / 4))
        # Sends block until the decode side receives: a pool, so they never block the event loop.
        self._senders = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-send", initializer=one_torch_thread)
        self._sending: set[asyncio.Task] = set()
        self._before_send = before_send  # fault injection (a stalled sender), tests only
        self.control = ControlServer(
            worker_id,
            self.transfer_config.host,
            ControlHandlers(send=self._on_send_call, release=self._on_release_call, extend=self._on_extend_call),
        )
        self.address = self.server.address  # with the control port once started

    async def start(self) -> None:
        """Open the control server (in the event loop that runs this worker)."""
        await self.control.start()
        self.address = self.control.address_of(self.server.address)
        if self.engine.tensor_parallel is not None:
            op = open_config("prefill", self.worker_id, self.transfer_config, self.address.generation)
            reports = await self.loop.call(lambda e: e.open_rank_transfers(op))
            own = replace(self.address, worker_id=rank_worker_id(self.worker_id, 0))
            self.rank_addresses = (own, *(r.address for r in reports if r.address is not None))
            logger.info(
                "prefill %s: %d tensor-parallel ranks send KV (%s)",
                self.worker_id,
                len(self.rank_addresses),
                ", ".join(f"{a.host}:{a.port}" for a in self.rank_addresses),
            )

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Compute the prompt's KV and first token; return where to pull the KV from."""
        params = SamplingParams(**request.sampling)
        needs_decode = params.max_tokens > 1
        first_only = replace(params, max_tokens=1, stop=(), detokenize=False)
        rid = request.request_id
        await self.loop.compile_grammar(params)
        self.stats.received += 1
        self.stats.received_prompt_tokens += len(request.prompt_token_ids)
        self.stats.received_prompt_tokens_sq += len(request.prompt_token_ids) ** 2
        final = None
        async for output in self.loop.generate(
            rid,
            lambda e: e.add_request(
                rid, list(request.prompt_token_ids), first_only, request.cache_salt, hold_kv=needs_decode
            ),
        ):
            final = output
        if final is None or final.timing is None:  # the engine's final output carries the timing
            raise RuntimeError(f"prefill of {rid}: the engine ended it without a final output")
        first = final.token_ids[0]
        finish = final.finish_reason if final.finish_reason == "stop" or not needs_decode else None
        if finish is None and len(request.prompt_token_ids) + 1 >= self.engine.max_model_len:
            finish = "length"
        lp = final.logprobs[0] if final.logprobs else None
        self.stats.requests += 1
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        self.stats.cached_prompt_tokens += final.num_cached_tokens
        if finish is None:
            self.stats.handed_over += 1
            self.stats.handed_over_max_tokens += params.max_tokens
            self.stats.handed_over_prompt_tokens += len(request.prompt_token_ids)
            self.stats.handed_over_prompt_x_max += len(request.prompt_token_ids) * params.max_tokens
            self.stats.handed_over_max_sq += params.max_tokens**2
        result = PrefillResult(
            request_id=rid,
            first_token_id=first,
            prompt_token_ids=tuple(request.prompt_token_ids),
            kv_handle=None,
            num_cached_tokens=final.num_cached_tokens,
            finish_reason=finish,
            first_token_logprob=lp.logprob if lp else None,
            first_token_top_logprobs=tuple(lp.top) if lp else (),
            timing={"prefill_queue_s": final.timing["queue_s"], "prefill_s": final.timing["prefill_s"]},
        )
        if not needs_decode:
            return result
        if finish is not None:
            await self._release_now(rid)
            return result
        try:
            block_ids = await self.loop.call(lambda e: e.held_block_ids(rid))
        except BaseException:
            # Cancelled (the client left) before a lease covers the held blocks: nobody would
            # ever free them. Released on the engine thread even though we are cancelled.
            with contextlib.suppress(EngineDeadError):
                self.loop.call_future(lambda e: e.release_kv(rid))
            raise
        if block_ids is None:
            raise RuntimeError(f"prefill of {rid}: the engine no longer holds its KV for decode")
        self.leases.grant(rid, self.lease_ttl_s, self._on_lease_end)
        handle = KVHandle(
            request_id=rid,
            prefill_worker_id=self.worker_id,
            address=self.address,
            block_ids=tuple(block_ids),
            num_tokens=len(request.prompt_token_ids),
            layout=self.layout,
            lease_expires_at=time.time() + self.lease_ttl_s,
            tensor_parallel_size=self.engine.tensor_parallel_size,
            rank_addresses=self.rank_addresses,
        )
        return replace(result, kv_handle=handle)

    def _claim(self, request: TransferRequest) -> None:
        rid = request.request_id
        if not self.leases.claim(rid):
            raise KVTransferError(
                f"no live lease for {rid} on {self.worker_id} (expired or already sent)",
                peer_id=request.decode_worker_id,
                request_id=rid,
            )

    async def send_kv(self, request: TransferRequest) -> SendResult:
        """Send the requested blocks to the decode worker that asked, then free them (claims
        the lease and waits for the send: an in-process caller's entry point)."""
        self._claim(request)
        return await self._send_claimed(request)

    async def _send_claimed(self, request: TransferRequest) -> SendResult:
        rid = request.request_id
        loop = asyncio.get_running_loop()
        try:
            if request.pairs:  # tensor parallel on either side: every rank sends its heads
                self.layout.check_matches(request.layout, ours="prefill", theirs="decode")
                send = self._tp_sender.send
            else:
                send = self.server.send
            result = await loop.run_in_executor(
                self._senders, send, request, self.engine.kv_caches, self.transfer_config.transfer_timeout_s
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
        """A decode worker's Send: claim the lease and start the send, then answer (the send
        completes only once the decode side receives, so the answer cannot wait for it)."""
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
                # Retrieved: the send counts and logs its own failure; the decode side sees it as its own.
                t.exception()

        task.add_done_callback(forget)

    async def _on_release_call(self, request_id: str) -> bool:
        return await self.release(request_id)

    async def _on_extend_call(self, request_id: str, ttl_s: float) -> float:
        left = self.leases.extend(request_id, ttl_s)
        if left is None:
            raise Refused(f"no live lease for {request_id} on {self.worker_id} (expired or already sent)")
        return left

    async def _release_now(self, request_id: str) -> bool:
        """Free held blocks; the release runs even if this call is cancelled meanwhile (awaiting
        the engine's future directly would cancel it before it ran)."""
        return await asyncio.shield(asyncio.wrap_future(self.loop.call_future(lambda e: e.release_kv(request_id))))

    async def release(self, request_id: str) -> bool:
        """The decode side needs none of the blocks (it had them all): free them now."""
        if not self.leases.release(request_id):
            return False
        return await self._release_now(request_id)

    def _on_lease_end(self, request_id: str, reason: str) -> None:
        if reason == "expired":
            self.stats.leases_expired += 1
            logger.warning("lease on %s expired on %s: freeing its blocks", request_id, self.worker_id)
            self.loop.call_future(lambda e: e.release_kv(request_id))
        # "claimed": send_kv frees after sending; "released": release() frees.

    async def shutdown(self) -> None:
        await self.control.stop()
        self.leases.close()
        self._senders.shutdown(wait=False, cancel_futures=True)
        self.server.close()
        self.loop.shutdown()
