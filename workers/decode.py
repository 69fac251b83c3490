"""Decode worker (and the colocated worker it builds on): continuous-batch decoding, with the
prompt's KV pulled from the prefill worker named in the KVHandle.

The prefill worker is reached directly at the control address in the KVHandle
(``workers/transfer/control.py``): Send before the pull, Release when no block is needed.

Block lifetime on this side: ``reserve_remote_kv`` allocates the prompt's blocks (reusing what
this worker's prefix cache holds); the pull fills the missing ones; ``commit_remote_kv`` joins
the batch, or recomputes the prompt when the pull failed. Leaving the stream early (client
gone) aborts the request, which frees its blocks wherever it was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from workers.engine import LLMEngine, RequestOutput, SamplingParams
from workers.engine.engine import HeldSequence, KVReservation
from workers.engine_loop import EngineLoop
from workers.kv_source import KVSource
from workers.protocol import GenerateRequest, KVHandle, PrefillResult, TokenChunk, TokenLogprobs, TransferRequest
from workers.threads import one_torch_thread
from workers.transfer import KVCorruptError, KVTransferClient, KVTransferError, TransferConfig, Transport
from workers.transfer.control import ControlClient
from workers.transfer.tp_transfer import RANK_CALL_TIMEOUT_S, TPPuller, open_config, rank_channel
from workers.worker_stats import WorkerStats

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0  # a release is advisory (the lease frees the blocks anyway)
KV_WAIT_S = 30.0  # a handed-over prompt waits this long for KV room here before it is recomputed
KV_WAIT_POLL_S = 0.02  # first retry of a waiting reservation; doubles up to KV_WAIT_MAX_POLL_S
KV_WAIT_MAX_POLL_S = 0.2
KV_WAIT_LEASE_MARGIN_S = 1.0  # extend the prefill worker's lease this long before it ends
KV_WAIT_LEASE_EXTENSION_S = 10.0


def worker_params(request: GenerateRequest) -> SamplingParams:
    """Workers produce token ids; text and stop strings are the ingress's job."""
    return replace(SamplingParams(**request.sampling), stop=(), detokenize=False)


def to_chunk(
    output: RequestOutput, extra_timing: dict[str, float] | None = None, worker_id: str | None = None
) -> TokenChunk:
    logprobs = None
    if output.logprobs is not None:
        new = output.logprobs[len(output.logprobs) - len(output.new_token_ids) :]
        logprobs = tuple(TokenLogprobs(lp.token_id, lp.logprob, tuple(lp.top)) for lp in new)
    timing = None
    if output.timing is not None:
        timing = {f"decode_{k}": v for k, v in output.timing.items()} | (extra_timing or {})
    return TokenChunk(
        request_id=output.request_id,
        token_ids=tuple(output.new_token_ids),
        logprobs=logprobs,
        finish_reason=output.finish_reason,
        num_cached_tokens=output.num_cached_tokens,
        timing=timing,
        worker_id=worker_id,
    )


class DecodeRetiring(RuntimeError):
    """The decode replica ``worker_id`` is being stopped (a scale-down) and ended this stream
    early: the ingress resumes the request on another decode replica from its prompt and the
    tokens already sent, as it does for a replica that died. The replica ends the stream with a
    ``TokenChunk`` marked ``retiring``; the ingress raises this on it."""

    def __init__(self, message: str, worker_id: str = "") -> None:
        super().__init__(message, worker_id)  # both in args: Ray pickles the error by them
        self.worker_id = worker_id

    def __str__(self) -> str:
        return str(self.args[0])


class StreamMoved(Exception):
    """Put on a request's output stream by a live migration (``DecodeWorker.move``): the stream
    ends here with ``handoff``, what another decode worker continues from."""

    request_kept = True  # the request's blocks are held for the receiver: leaving must not abort it

    def __init__(self, handoff: PrefillResult) -> None:
        super().__init__(handoff.request_id)
        self.handoff = handoff


def matches(request_id: str, asked: str) -> bool:
    """``asked`` names ``request_id``: the same, or a completion's id naming its choices and
    their continuations (``cmpl-x`` names ``cmpl-x-0`` and ``cmpl-x-0~m1``)."""
    return request_id == asked or request_id.startswith((f"{asked}-", f"{asked}~"))


class ColocatedWorker:
    """One engine doing prefill and decode: the baseline, and the fast path for a decode worker
    that already holds nearly all of a prompt."""

    def __init__(self, engine: LLMEngine | EngineLoop, worker_id: str, role: str = "colocated", on_step=None) -> None:
        """``engine``: the engine, or the loop already driving it (a server builds the engine on
        the loop's thread: workers/engine_loop.py says why)."""
        self.loop = engine if isinstance(engine, EngineLoop) else EngineLoop(engine, on_step)
        if on_step is not None:
            self.loop.on_step = on_step
        self.engine = self.loop.engine
        self.worker_id = worker_id
        self.stats = WorkerStats(role)

    async def generate_local(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        rid = request.request_id
        params = worker_params(request)
        await self.loop.compile_grammar(params)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        async for output in self.loop.generate(
            rid, lambda e: e.add_request(rid, list(request.prompt_token_ids), params, request.cache_salt)
        ):
            self.stats.generated_tokens += len(output.new_token_ids)
            if output.finished:
                self.stats.cached_prompt_tokens += output.num_cached_tokens
            yield to_chunk(output, worker_id=self.worker_id)

    async def shutdown(self) -> None:
        self.loop.shutdown()


class DecodeWorker(ColocatedWorker):
    def __init__(
        self,
        engine: LLMEngine | EngineLoop,
        worker_id: str,
        transfer_config: TransferConfig | None = None,
        on_step=None,
        control: ControlClient | None = None,
        kv_wait_s: float | None = None,
        lease_ttl_s: float = 30.0,
    ) -> None:
        super().__init__(engine, worker_id, role="decode", on_step=on_step)
        engine = self.engine
        self.transfer_config = transfer_config or TransferConfig()
        if self.transfer_config.transport is Transport.OBJECT_STORE:
            raise ValueError(
                "transport 'object_store' needs a Ray call between the workers to pass the "
                "buffer's ref; pdserve's KV control path is direct: use 'auto' or 'gloo'"
            )
        self.client = KVTransferClient(worker_id, self.transfer_config, device=engine.device)
        self.control = control or ControlClient(worker_id)
        # Tensor parallel on either side: one message per rank pair (workers/transfer/tp_transfer.py).
        tp = engine.tensor_parallel
        self.tp_puller = TPPuller(
            worker_id,
            self.transfer_config,
            engine.device,
            engine.model_config.num_kv_heads,
            engine.tensor_parallel_size,
            *rank_channel(self.loop.call_future, tp),
        )
        if tp is not None:
            op = open_config("decode", worker_id, self.transfer_config)
            reports = self.loop.call_future(lambda e: e.open_rank_transfers(op)).result(RANK_CALL_TIMEOUT_S)
            self.tp_puller.identities += [r.address for r in reports if r.address is not None]
            logger.info("decode %s: %d tensor-parallel ranks receive KV", worker_id, len(self.tp_puller.identities))
        self._background: set[asyncio.Task] = set()
        self.kv_wait_s = KV_WAIT_S if kv_wait_s is None else kv_wait_s
        self._kv_waiters = asyncio.Lock()  # FIFO: prompts waiting for KV room take it in order
        self._receivers = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-recv", initializer=one_torch_thread)
        self.retiring = False
        # Live migration: this worker holds a moved stream's blocks under a lease for the worker
        # that goes on with it (the prefill worker's sending half). Tensor-parallel decode
        # replicas hand streams over by recompute.
        self.source = (
            KVSource(self.loop, worker_id, self.transfer_config, self.stats, lease_ttl_s) if tp is None else None
        )
        self._source_started = False
        self._copies = 0  # pre-copies made here: each copy's request id is unique

    async def start(self) -> None:
        """Open the control server through which other decode workers pull moved streams' KV."""
        if self.source is not None:
            await self.source.start()
            self._source_started = True

    async def move(self, request_id: str | None, recompute: bool = False) -> list[str]:
        """Live migration: stop decoding every stream ``request_id`` names (``matches``; None:
        every stream) at the next step boundary, hold its blocks under a lease and end its
        stream with a hand-off; the ingress continues it on another decode worker, which pulls
        the blocks, with no token recomputed. Returns the ids of the streams moved; a stream
        between states (its prompt still computing, waiting for room) is not moved.

        With ``recompute`` (and on a tensor-parallel replica, which sends no KV) the streams end
        as a retiring replica's do instead: another decode worker computes prompt and tokens so
        far itself."""
        if self.retiring:
            return []
        ids = [rid for rid in self.loop.streams() if request_id is None or matches(rid, request_id)]
        if recompute or self.source is None:
            self.loop.end_streams(self._retiring, keep=set(self.loop.streams()) - set(ids))
            return ids
        if not self._source_started:
            return []
        moved = await self.loop.call(lambda e: [rid for rid in ids if self._hold(e, rid)])
        self.stats.moved_out += len(moved)
        return moved

    async def precopy(self, request_id: str) -> list[tuple[str, KVHandle, HeldSequence]]:
        """A live migration's first phase: hold another reference to the full blocks of every
        stream ``request_id`` names, under a lease, while the streams go on decoding here (no
        step writes a full block again). Another decode worker pulls them into its prefix cache
        (``prefetch``); the move that follows (``move``) then sends only what was written since.
        Returns, per stream, its id, the copy's handle and tokens."""
        if self.source is None or not self._source_started or self.retiring:
            return []
        self._copies += 1
        copies = {rid: f"{rid}#pre{self._copies}" for rid in self.loop.streams() if matches(rid, request_id)}
        held = await self.loop.call(lambda e: [(rid, e.hold_prefix_copy(rid, copies[rid])) for rid in copies])
        source = self.source
        return [(rid, source.hold(copies[rid], h.block_ids, len(h.token_ids)), h) for rid, h in held if h is not None]

    async def prefetch(self, request: GenerateRequest, handle: KVHandle) -> int:
        """A live migration's first phase, receiving side: pull the blocks of ``request``'s
        tokens (another decode worker's ``precopy``) that this worker's prefix cache lacks, and
        leave them there for the moved stream. Returns how many blocks moved (0: all were here,
        no room, or the pull failed; the move then pulls what is missing)."""
        rid, tokens = request.request_id, list(request.prompt_token_ids)
        params = SamplingParams(max_tokens=1, detokenize=False)
        reservation = await self.loop.call(lambda e: e.reserve_remote_kv(rid, tokens, 0, params, request.cache_salt))
        if reservation is None or not reservation.missing_block_ids:
            self._release_remote(handle)
            if reservation is not None:
                await self.loop.call(lambda e: e.cache_remote_kv(rid))
            return 0
        pull = asyncio.ensure_future(self._pull(handle, reservation))
        try:
            await asyncio.shield(pull)
        except (KVTransferError, ValueError) as exc:
            logger.info("pre-copy of %s from %s failed (the move pulls it all): %s", rid, handle.prefill_worker_id, exc)
            self.loop.abort(rid)
            return 0
        except asyncio.CancelledError:
            self._abort_after(pull, rid)
            raise
        await self.loop.call(lambda e: e.cache_remote_kv(rid))
        return len(reservation.missing_block_ids)

    def _hold(self, engine: LLMEngine, request_id: str) -> bool:
        """Engine thread: stop ``request_id`` and end its stream with the hand-off (after every
        output already delivered to it, so the ingress has each token before the hand-off)."""
        held = engine.hold_running(request_id)
        if held is None:
            return False
        assert self.source is not None
        num_computed = len(held.token_ids) - 1
        handle = self.source.hold(request_id, held.block_ids, num_computed)
        handoff = PrefillResult(
            request_id=request_id,
            first_token_id=held.token_ids[-1],
            prompt_token_ids=tuple(held.token_ids[:-1]),
            kv_handle=handle,
            num_cached_tokens=0,
        )
        self.loop.deliver(request_id, StreamMoved(handoff))
        return True

    def _moved_chunk(self, moved: StreamMoved) -> TokenChunk:
        return TokenChunk(moved.handoff.request_id, (), worker_id=self.worker_id, handoff=moved.handoff)

    def _retiring(self, request_id: str) -> DecodeRetiring:
        return DecodeRetiring(
            f"decode replica {self.worker_id} is retiring; request {request_id} resumes elsewhere", self.worker_id
        )

    async def retire(self) -> int:
        """Serve is stopping this replica: move every running stream to another decode replica
        live (``move``: its blocks are pulled, nothing recomputed), end the rest with
        ``DecodeRetiring`` (each aborts, which frees its blocks, and the ingress resumes it on
        another decode replica from its prompt and tokens), and refuse new ones alike. Returns
        how many streams it handed over. Waiting the streams out would
        hold the replica's budget slot for up to the pools' drain time (15 s) while a replica of
        the other pool waits for it, so the pool that needs replicas at a load shift would get
        them late."""
        moved = await self.move(None) if self.loop.streams() else []
        self.retiring = True
        ended = self.loop.end_streams(self._retiring, keep=set(moved))
        self.stats.retired_streams += len(ended) + len(moved)
        return len(ended) + len(moved)

    def _retired_chunk(self, request_id: str) -> TokenChunk:
        return TokenChunk(request_id, (), worker_id=self.worker_id, retiring=True)

    async def generate_local(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        if self.retiring:
            yield self._retired_chunk(request.request_id)
            return
        try:
            async for chunk in super().generate_local(request):
                yield chunk
        except DecodeRetiring:
            yield self._retired_chunk(request.request_id)
        except StreamMoved as moved:
            yield self._moved_chunk(moved)

    async def generate(self, request: GenerateRequest, prefill: PrefillResult) -> AsyncIterator[TokenChunk]:
        """Continue a prefilled request: pull its KV (or recompute), then stream its tokens."""
        rid, handle = request.request_id, prefill.kv_handle
        if handle is None:
            raise ValueError(f"request {rid} finished at its first token: there is no KV to decode from")
        if self.retiring:  # Serve routed it here just before it began stopping this replica
            self._release_remote(handle)
            yield self._retired_chunk(rid)
            return
        prompt = list(request.prompt_token_ids)
        params = worker_params(request)
        try:
            await self.loop.compile_grammar(params)
        except BaseException:
            self._release_remote(handle)
            raise
        outputs = self.loop.attach(rid)
        finished = False
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt)
        extra: dict[str, float] = {}
        pull: asyncio.Future | None = None
        produced = 0
        first_at: float | None = None  # when its first decoded token came
        try:
            if handle.prefill_worker_id == self.worker_id and self.source is not None:
                # A stream moved back to the replica holding it (no other took it): its blocks
                # go back to the prefix cache and the queued request finds them there.
                await self.source.release(handle.request_id)
                reservation = None
            else:
                reservation, handle = await self._reserve(
                    handle,
                    lambda e: e.reserve_remote_kv(rid, prompt, prefill.first_token_id, params, request.cache_salt),
                )
            held_since = time.monotonic()  # this worker holds the prompt's blocks (or queues it) from here
            if reservation is None:
                # No room for the prompt within the wait (or never: it is larger than this
                # worker's KV): queue it here as a recompute; blocks free up as other sequences
                # finish. The prefill worker's copy is not needed.
                self._release_remote(handle)
                self.stats.recomputed_prefills += 1
                self.stats.peer(handle.prefill_worker_id).recomputed_prefills += 1  # per-pair figures
                await self.loop.call(
                    lambda e: e.add_request(
                        rid, prompt, params, request.cache_salt, first_token_id=prefill.first_token_id
                    )
                )
            else:
                self.stats.cached_prompt_tokens += reservation.num_cached_tokens
                recompute = False
                if reservation.missing_block_ids:
                    try:
                        # Shielded: the pull thread writes into the reserved blocks whatever we do,
                        # so a cancelled request frees them only once it is done (see finally).
                        pull = asyncio.ensure_future(self._pull(handle, reservation))
                        stats = await asyncio.shield(pull)
                        extra = {"transfer_s": stats.seconds, "transfer_bytes": float(stats.num_bytes)}
                    except (KVTransferError, ValueError) as exc:
                        if isinstance(exc, KVCorruptError):
                            self.stats.transfer_corrupt += 1
                            logger.warning(
                                "KV blocks of %s from %s to %s arrived corrupt, recomputing here: %s",
                                rid,
                                handle.prefill_worker_id,
                                self.worker_id,
                                exc,
                            )
                        else:
                            logger.warning(
                                "KV pull of %s from %s failed, recomputing here: %s", rid, handle.prefill_worker_id, exc
                            )
                        self.stats.transfer_failures += 1
                        self.stats.recomputed_prefills += 1
                        self.stats.peer(handle.prefill_worker_id).failed(recomputed=True)
                        recompute = True
                else:
                    self._release_remote(handle)  # we hold every block
                await self.loop.call(lambda e: e.commit_remote_kv(rid, recompute=recompute))
            while True:
                item = await outputs.get()
                if isinstance(item, DecodeRetiring):
                    yield self._retired_chunk(rid)  # not finished: the finally below aborts it
                    return
                if isinstance(item, StreamMoved):
                    finished = True  # its blocks are the lease's now, not this stream's to abort
                    yield self._moved_chunk(item)
                    return
                if isinstance(item, BaseException):
                    raise item
                self.stats.generated_tokens += len(item.new_token_ids)
                produced += len(item.new_token_ids)
                finished = item.finished
                if first_at is None:
                    first_at = time.monotonic()
                if finished:
                    self.stats.finished_seqs += 1
                    self.stats.finished_output_tokens += produced + 1  # and prefill's first token
                    self.stats.finished_max_tokens += params.max_tokens
                    self.stats.finished_resident_s += time.monotonic() - held_since
                    self.stats.finished_setup_s += first_at - held_since
                yield to_chunk(item, extra, self.worker_id)
                if finished:
                    return
        finally:
            self.loop.detach(rid)
            if not finished:  # client gone (or a failure): abort, which frees the blocks
                if pull is not None and not pull.done():
                    self._abort_after(pull, rid)
                else:
                    self.loop.abort(rid)

    def _abort_after(self, pull: asyncio.Future, request_id: str) -> None:
        """Abort the request once ``pull`` is done: its thread writes into the reserved blocks
        until then, so they are freed only after."""

        def abort(done: asyncio.Future) -> None:
            if not done.cancelled():
                done.exception()  # retrieved: its failure no longer matters
            self.loop.abort(request_id)

        pull.add_done_callback(abort)

    async def _reserve(self, handle: KVHandle, reserve) -> tuple[KVReservation | None, KVHandle]:
        """The prompt's blocks, reserved (``reserve`` on the engine thread), and the handle with
        its lease as extended. With no room now the request waits for room here, in arrival
        order, up to ``kv_wait_s``, extending the prefill worker's lease on the prompt's blocks
        while it waits: sequences finish and free blocks within seconds, while recomputing the
        prompt here costs this worker a prefill, which stalls every sequence it decodes (a long
        prompt's step lasts many times a decode step). None: no room by then, the lease could
        not be kept, or the prompt can never fit (more blocks than this worker has); the caller
        recomputes."""
        if not self._kv_waiters.locked():  # nobody waits: no queue to join
            reservation = await self.loop.call(reserve)
            if reservation is not None or self.kv_wait_s <= 0:
                return reservation, handle
        blocks = len(handle.block_ids)
        if blocks > await self.loop.call(lambda e: e.block_manager.num_blocks):
            return None, handle
        give_up = time.monotonic() + self.kv_wait_s
        poll = KV_WAIT_POLL_S
        self.stats.kv_waits += 1
        self.stats.kv_waiting += 1
        try:
            async with self._kv_waiters:
                while True:
                    reservation = await self.loop.call(reserve)
                    if reservation is not None or time.monotonic() + poll > give_up:
                        return reservation, handle
                    if time.time() + poll + KV_WAIT_LEASE_MARGIN_S > handle.lease_expires_at:
                        extended = await self._extend_lease(handle)
                        if extended is None:
                            return None, handle
                        handle = extended
                    await asyncio.sleep(poll)
                    poll = min(poll * 2, KV_WAIT_MAX_POLL_S)
        except asyncio.CancelledError:
            self._release_remote(handle)  # the client left while waiting: the prefill copy can go
            raise
        finally:
            self.stats.kv_waiting -= 1

    async def _extend_lease(self, handle: KVHandle) -> KVHandle | None:
        """``handle`` with the prefill worker's lease on its blocks extended, or None when that
        worker cannot be asked (unreachable, or the lease already ended)."""
        try:
            left = await self.control.extend(
                handle.address, handle.request_id, KV_WAIT_LEASE_EXTENSION_S, RELEASE_TIMEOUT_S
            )
        except KVTransferError as exc:
            logger.info(
                "request %s: lease on %s not extended while waiting for KV room: %s",
                handle.request_id,
                handle.prefill_worker_id,
                exc,
            )
            return None
        return replace(handle, lease_expires_at=time.time() + left)

    async def _pull(self, handle: KVHandle, reservation):
        loop = asyncio.get_running_loop()
        src = [handle.block_ids[i] for i in reservation.missing_positions]
        timeout_s = self.transfer_config.transfer_timeout_s

        def request_send(transfer: TransferRequest) -> None:
            # Runs on the pull thread: the Send call goes out on the event loop, and the pull
            # waits for its acknowledgement (a refused or unreachable peer fails it here, within
            # the call's deadline, before any receive is posted).
            future = asyncio.run_coroutine_threadsafe(self.control.send(handle.address, transfer, timeout_s), loop)
            future.result(timeout_s + 1.0)

        tensor_parallel = handle.tensor_parallel_size > 1 or self.engine.tensor_parallel is not None
        pull = self.tp_puller.pull if tensor_parallel else self.client.pull
        stats = await loop.run_in_executor(
            self._receivers,
            lambda: pull(
                handle,
                self.engine.kv_caches,
                reservation.missing_block_ids,
                request_send,
                src_block_ids=src,
                timeout_s=timeout_s,
            ),
        )
        if stats.rank_bytes:
            self.stats.add_rank_bytes(stats.rank_bytes)
        self.stats.transfers += 1
        self.stats.transfer_bytes += stats.num_bytes
        self.stats.transfer_seconds += stats.seconds
        self.stats.peer(handle.prefill_worker_id).transferred(stats.num_bytes, stats.seconds, stats.created_pair)
        return stats

    def _release_remote(self, handle: KVHandle) -> None:
        """Tell the prefill worker it can free the request's blocks now (advisory: its lease
        frees them anyway)."""
        task = asyncio.get_running_loop().create_task(
            self.control.release(handle.address, handle.request_id, RELEASE_TIMEOUT_S)
        )
        self._background.add(task)

        def forget(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: nobody awaits an advisory release

        task.add_done_callback(forget)

    async def shutdown(self, send_wait_s: float = 10.0) -> None:
        if self.source is not None:
            # Streams moved away are pulled from here: let their receivers have the blocks first.
            if left := await self.source.wait_sent(send_wait_s):
                logger.warning("decode %s stops with %d moved stream(s) not yet pulled", self.worker_id, left)
            await self.source.shutdown()
        self._receivers.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        self.tp_puller.close()
        await self.control.close()
        await super().shutdown()
