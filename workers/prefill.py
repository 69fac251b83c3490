"""Prefill worker: runs prompts to their first token, keeps the KV blocks under a lease, and
sends them to the decode worker that claims them (``workers/kv_source.py``: the lease, the
control server and the send, shared with a decode worker's live migration).

Block lifetime on this side: a finished prefill holds its blocks (``hold_kv``) and gets a lease.
Exactly one of these frees them: the send after a decode worker's Send call (claimed),
``release`` (the decode side already had every block, or the request ended), or the lease
expiring (no decode worker came). Cached full blocks stay in the prefix cache after being freed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from workers.engine import LLMEngine, SamplingParams
from workers.engine_loop import EngineDeadError, EngineLoop
from workers.kv_source import KVSource
from workers.protocol import GenerateRequest, PrefillResult, TransferRequest
from workers.transfer import SendResult, TransferConfig
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
        self.source = KVSource(self.loop, worker_id, self.transfer_config, self.stats, lease_ttl_s, before_send)
        self.control = self.source.control

    @property
    def address(self):
        """Where decode workers reach this worker: its rendezvous store and control server."""
        return self.source.address

    async def start(self) -> None:
        """Open the control server (in the event loop that runs this worker)."""
        await self.source.start()

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
        handle = self.source.hold(rid, block_ids, len(request.prompt_token_ids))
        return replace(result, kv_handle=handle)

    async def send_kv(self, request: TransferRequest) -> SendResult:
        """Send the requested blocks to the decode worker that asked, then free them."""
        return await self.source.send_kv(request)

    async def _release_now(self, request_id: str) -> bool:
        return await self.source.release_now(request_id)

    async def release(self, request_id: str) -> bool:
        """The decode side needs none of the blocks (it had them all): free them now."""
        return await self.source.release(request_id)

    async def shutdown(self) -> None:
        await self.source.shutdown()
        self.loop.shutdown()
