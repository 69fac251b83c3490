"""The OpenAI-compatible ingress: a Serve deployment with a FastAPI app.

Validates (pydantic, 400 with the parameter named), applies the chat template, tokenizes,
hashes the prompt's blocks for routing, and runs each choice through the worker pools:
disaggregated (prefill pool -> first token, streamed at once; decode pool -> the rest) or
colocated (one pool). Text, stop strings and logprobs are assembled here (``deploy.api.output``).
"""

import asyncio
import logging
import time
import uuid
from typing import Any, cast

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from cluster.local import haproxy_enabled
from deploy.api import http_errors
from deploy.api.context_limit import fit_to_context
from deploy.api.conversation import ConversationCache, ConversationTurn
from deploy.api.http_errors import install_error_handlers, is_cancellation
from deploy.api.openai_protocol import ChatCompletionRequest, CompletionRequest, MigrateRequest, RequestError
from deploy.api.output import ChoiceAssembler
from deploy.api.request_stats import RequestStats
from deploy.api.responses import ResponseBuilder
from deploy.api.tools import ToolPlan, chat_template_inputs, choose_parser, new_stream_parser, plan_tools
from deploy.args import Mode, PDServeArgs
from deploy.ops.cluster_status import PoolReader, autoscaling_status, extend_status, index_status, start_history
from deploy.ops.dashboard import install_dashboard
from deploy.ops.metrics import IngressMetrics
from deploy.pools.migration import Mover
from deploy.pools.worker_calls import PoolReadiness, WorkerCalls
from deploy.replica_logging import route_to_serve
from kvstore.hashing import hash_prompt_blocks
from workers.engine.config import EngineConfig
from workers.engine.logits_processors import bad_words_token_ids
from workers.models.config import ModelConfig
from workers.models.gguf import describe_model
from workers.protocol import GenerateRequest
from workers.transfer.control import ControlClient

logger = logging.getLogger("pdserve")


async def _prepend(first: str, rest):
    """Module-level and above the class: Serve pickles the ingress class when it is decorated."""
    yield first
    async for item in rest:
        yield item


app = FastAPI(title="pdserve", description="OpenAI-compatible disaggregated LLM serving")
install_error_handlers(app)
install_dashboard(app)  # before @serve.ingress: Serve freezes a copy of the app there


@serve.deployment(name="ingress", max_ongoing_requests=1024)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, args: dict, prefill=None, decode=None, colocated=None, autoscaler=None) -> None:
        from transformers import AutoTokenizer

        self.args = PDServeArgs.model_validate(args)
        route_to_serve(self.args.log_level)  # pdserve's lines reach the replica's log and the console
        self.tokenizer = AutoTokenizer.from_pretrained(self.args.model)
        self.model_config = ModelConfig.from_dir(self.args.model)
        # build_app set it once for the whole app; derived here only for an ingress built otherwise
        self.model_key = self.args.model_key or EngineConfig(model_dir=self.args.model).resolved_model_key
        self.max_model_len = self.args.max_model_len or self.model_config.max_position_embeddings
        self.model_weights = describe_model(self.args.model)  # "RANDOM weights ..." for test models
        self.tool_parser = choose_parser(self.tokenizer)  # the model family's own tool-call format
        self.index = None
        if self.args.redis_url:
            from kvstore import IndexConfig, PrefixIndex

            self.index = PrefixIndex(IndexConfig(redis_url=self.args.redis_url, model_key=self.model_key))
        self.conversations = self._conversation_cache()
        self.pools = {"prefill": prefill, "decode": decode, "colocated": colocated}
        self.autoscaler = autoscaler  # autoscaling: pd (deploy/pools/autoscaler.py); shown in the status
        self.metrics = IngressMetrics(self.args.model_name)
        # The workers' control servers (KV releases, lease extensions, each replica's figures),
        # found through the application's worker directory (entries in the GCS's KV store).
        app_name = serve.get_replica_context().app_name
        self.control = ControlClient("ingress")
        self.pool_reader = PoolReader(app_name, self.control)
        self.workers = WorkerCalls(
            self.args.mode,
            prefill=prefill,
            decode=decode,
            colocated=colocated,
            index=self.index,
            rehash=self._block_hashes,
            max_migrations=self.args.max_migrations,
            on_migration=self.metrics.migrated,
            on_live_migration=self.metrics.moved_live,
            control=self.control,
            sink_host=ray.util.get_node_ip_address() if self.args.output_channel else None,
        )
        self.mover = Mover(self.control, lambda: self.pool_reader.live_addresses("decode"), decode, self._block_hashes)
        self.stats = RequestStats()
        self.readiness = PoolReadiness(self.pools)  # /health: 503 "starting" until the pools answer
        self._requests: set[asyncio.Task] = set()  # completion requests in flight (drain() waits for them)
        self.history = start_history(self)  # the dashboard's last 10 minutes, sampled every 5 s
        http_errors.SETTINGS.api_keys = frozenset(self.args.api_keys)
        http_errors.SETTINGS.max_request_bytes = self.args.max_request_bytes
        logger.info("ingress ready: model %s (%s mode)", self.args.model_name, self.args.mode.value)

    def _conversation_cache(self) -> ConversationCache | None:
        """Conversation reuse (on unless the args turn it off): turns recorded in the index's
        Redis, shared by every ingress replica, or in this replica's memory without Redis."""
        if not self.args.conversation_reuse:
            return None
        from kvstore.conversation import ConversationStore, LocalConversationStore, RedisConversationStore

        store: ConversationStore
        if self.args.redis_url:
            from kvstore import IndexConfig

            store = RedisConversationStore(IndexConfig(redis_url=self.args.redis_url, model_key=self.model_key))
        else:
            store = LocalConversationStore()
        return ConversationCache(self.tokenizer, self.model_key, store)

    def _block_hashes(self, token_ids, cache_salt: str | None) -> tuple[bytes, ...]:
        return tuple(hash_prompt_blocks(token_ids, self.args.block_size, self.model_key, cache_salt))

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health(self):
        """200 ``{"status": "ok"}`` once every pool has a replica that answers; until then 503
        ``{"status": "starting", "pools": {...}}`` at once (never held: load balancers and
        ``pdserve up`` poll it with short timeouts); 503 ``{"status": "stopping"}`` once
        ``drain`` began."""
        state = self.readiness.status()
        if state["status"] == "ok":
            return state
        return JSONResponse(state, status_code=503, headers={"Retry-After": "1"})

    async def drain(self, timeout_s: float = 10.0) -> dict:
        """The first step of an orderly stop (``pdserve up`` calls it through a handle before
        deleting the application): take no new completion requests (503 ``shutting_down``),
        give the ones in flight ``timeout_s`` to finish, then cut the rest, which aborts them
        on the workers (their KV blocks are freed). Returns how many were in flight and cut."""
        self.readiness.stopping = True
        self.history.stop()  # the status sampler: nothing left to watch
        in_flight = len(self._requests)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = [task for task in self._requests if not task.done()]
        for task in cut:
            task.cancel()
        if cut:
            await asyncio.wait(cut, timeout=5.0)
        await self.workers.stop()  # the output channel: nothing is listening any more
        logger.info("ingress drained: %d requests in flight, %d cut", in_flight, len(cut))
        return {"in_flight": in_flight, "cut": len(cut)}

    @app.get("/v1/cluster/status")
    async def cluster_status(self) -> dict:
        names = [name for name, handle in self.pools.items() if handle is not None]
        pools = await self.pool_reader.read_all(names)
        return extend_status(
            {
                "model": self.args.model_name,
                "model_weights": self.model_weights,
                "mode": self.args.mode.value,
                "time": time.time(),
                "block_size": self.args.block_size,
                "pools": pools,
                "index": await index_status(self.index),
                "requests": self.stats.snapshot(),
                "routing": {
                    "skipped_prefills": self.workers.skipped_prefills,
                    "prefill_retries": self.workers.prefill_retries,
                    "migrations": self.workers.migrations,
                    "failed_migrations": self.workers.failed_migrations,
                    "retired_streams": self.workers.retired_streams,
                    "live_migrations": self.workers.live_migrations,
                    "precopied_blocks": self.mover.precopied_blocks,
                },
                "output_channel": self.workers.sink.stats() if self.workers.sink is not None else None,
                "http_front_end": "haproxy" if haproxy_enabled() else "serve_proxy",
                "conversations": self.conversations.stats() if self.conversations is not None else None,
                "autoscaling": await autoscaling_status(self.autoscaler),
            },
            self,
        )  # + pair table, HTTP outcomes, last-minute rates (deploy/ops/cluster_status.py)

    @app.post("/v1/cluster/migrate")
    async def migrate(self, body: MigrateRequest) -> dict:
        """Move a request's decode streams live to other decode replicas (``pdserve migrate``,
        ``deploy/pools/migration.py``): each stream's KV moves with it, nothing is recomputed,
        and its client sees one stream (``recompute``: the other replica computes prompt and
        tokens so far instead). 400 outside disaggregated mode; 409 with a single decode
        replica; 404 when no decode replica is decoding ``request_id`` now."""
        if self.args.mode is not Mode.DISAGGREGATED:
            raise RequestError("live migration moves decode streams: it needs mode disaggregated", "request_id")
        return {"request_id": body.request_id, "moved": await self.mover.move(body.request_id, body.recompute)}

    @app.get("/v1/cluster/history")
    async def cluster_history(self, since: float | None = None) -> dict:
        """The dashboard's server-side window: samples newer than ``since`` (all without it)."""
        self.history.ensure_running()
        return self.history.export(since)

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.args.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request):
        self._check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        controls = self._controls(body, self._structured(body))
        return await self._serve(
            body, prompt_ids, body.max_tokens, body.logprobs, chat=False, raw=raw, controls=controls
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request):
        self._check_model(body.model)
        plan = plan_tools(body.tools, cast(Any, body.tool_choice), body.parallel_tool_calls)
        structured = self._structured(body)
        if plan is not None and plan.constraint is not None:
            if structured is not None:
                raise RequestError(
                    f"tool_choice {plan.mode!r} constrains the output; it cannot be combined with another "
                    "output constraint (response_format, structured_outputs, guided_*)",
                    "tool_choice",
                )
            structured = plan.constraint
        messages = [
            {
                **m.model_dump(exclude_none=True),
                "role": m.role if m.role != "developer" else "system",
                "content": m.text(),
            }
            for m in body.messages
        ]
        with_tools = plan is not None or any("tool_calls" in m or m["role"] == "tool" for m in messages)
        template_messages, template_tools = chat_template_inputs(self.tokenizer, messages, plan)
        try:
            # tokenize=False: the rendered text (Hugging Face's type names every form it returns)
            text = cast(
                str,
                self.tokenizer.apply_chat_template(
                    template_messages,
                    tools=cast(Any, template_tools),
                    add_generation_prompt=body.add_generation_prompt,
                    tokenize=False,
                ),
            )
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise RequestError(f"messages do not fit the model's chat template: {exc}", "messages") from exc
        stitched, turn = None, None
        if self.conversations is not None and not with_tools:  # tool turns are not text the cache can match
            stitched = await self.conversations.prompt_ids(messages, text, body.cache_salt)
            turn = ConversationTurn(text, body.cache_salt)
        prompt_ids = stitched.token_ids if stitched else self.tokenizer.encode(text, add_special_tokens=False)
        top = body.top_logprobs or 0
        return await self._serve(
            body,
            prompt_ids,
            body.requested_max_tokens,
            top if body.logprobs else None,
            chat=True,
            raw=raw,
            turn=turn,
            controls=self._controls(body, structured),
            tools=plan,
        )

    # --------------------------------------------------------------- internals
    def _check_model(self, model: str) -> None:
        if model != self.args.model_name:
            raise RequestError(
                f"The model `{model}` does not exist. Available: {self.args.model_name}",
                "model",
                status=404,
                code="model_not_found",
            )

    @staticmethod
    def _structured(body) -> tuple[str, str] | None:
        found = body.constraint()  # a RequestError names the parameter of a bad or second one
        return None if found is None else (found[1], found[2])

    def _controls(self, body, structured: tuple[str, str] | None) -> dict[str, Any]:
        """The request's logits controls and constraint as ``SamplingParams`` fields (the same
        for every choice); token ids are checked against the vocabulary here."""
        limit = getattr(body, "requested_max_tokens", body.max_tokens)
        if limit is not None and body.min_tokens > limit:
            raise RequestError(f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({limit})", "min_tokens")
        vocab = self.model_config.vocab_size
        bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
        outside = [t for t in bias if t >= vocab]
        if outside:
            raise RequestError(
                f"logit_bias names token ids outside the vocabulary [0, {vocab}): {outside[:5]}", "logit_bias"
            )
        controls: dict[str, Any] = {
            "min_tokens": body.min_tokens,
            "frequency_penalty": body.frequency_penalty,
            "presence_penalty": body.presence_penalty,
            "repetition_penalty": body.repetition_penalty,
            "logit_bias": tuple(bias.items()),
            "bad_words_ids": bad_words_token_ids(self.tokenizer, body.bad_words) if body.bad_words else (),
            "structured": structured,
        }
        return controls

    def _sampling(self, body, max_tokens: int, logprobs: int | None, choice: int, controls: dict) -> dict[str, Any]:
        seed = None if body.seed is None else body.seed + choice
        return {
            "max_tokens": max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "seed": seed,
            "stop_token_ids": tuple(body.stop_token_ids or ()),
            "ignore_eos": body.ignore_eos,
            "logprobs": logprobs,
            **controls,
        }

    async def _serve(
        self,
        body,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        chat: bool,
        raw: Request,
        turn: ConversationTurn | None = None,
        controls: dict[str, Any] | None = None,
        tools: ToolPlan | None = None,
    ):
        if self.readiness.stopping:
            raise RequestError(
                "the server is shutting down; retry on another replica",
                None,
                status=503,
                error_type="server_unavailable",
                code="shutting_down",
            )
        task = asyncio.current_task()  # this request's task: streaming answers run in it too
        if task is not None:
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)
        max_tokens = fit_to_context(
            prompt_ids, max_tokens, self.model_config.vocab_size, self.max_model_len, body.max_model_len
        )
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        hashes = self._block_hashes(prompt_ids, body.cache_salt)
        arrival = time.time()
        choices = [
            GenerateRequest(
                f"{request_id}-{i}",
                tuple(prompt_ids),
                self._sampling(body, max_tokens, logprobs, i, controls or {}),
                body.cache_salt,
                hashes,
                arrival,
            )
            for i in range(body.n)
        ]
        assemblers = [
            ChoiceAssembler(
                self.tokenizer,
                prompt_ids,
                tuple(body.stop),
                body.include_stop_str_in_output,
                body.skip_special_tokens,
                tools=None if tools is None else new_stream_parser(tools, self.tool_parser),
            )
            for _ in range(body.n)
        ]
        builder = ResponseBuilder(
            request_id, self.args.model_name, self.tokenizer, chat, len(prompt_ids), body.return_timing
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._stream(choices, assemblers, builder, include_usage, turn)
            # Run until the first token (or failure) before answering: an overloaded pool or a
            # prompt a worker refuses becomes an HTTP error, not an error inside a 200 stream.
            first = await anext(events)
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
        await asyncio.gather(*(self._drain(c, a, turn) for c, a in zip(choices, assemblers)))
        return JSONResponse(builder.final(assemblers))

    async def _drain(self, choice: GenerateRequest, assembler: ChoiceAssembler, turn: ConversationTurn | None) -> None:
        async for _ in self._choice_deltas(choice, assembler, turn):
            pass

    async def _choice_deltas(
        self, choice: GenerateRequest, assembler: ChoiceAssembler, turn: ConversationTurn | None = None
    ):
        """Deltas of one choice; stops the workers' stream when a stop string ends it. A chat
        turn is recorded before its last delta goes out: the client's next turn can reuse it.

        Ends as one outcome (``deploy.api.request_stats``): finished; aborted when the client left
        (this generator is cancelled or closed, or a worker call was cancelled); else failed.
        Closing the workers' stream aborts the request there, which frees its KV blocks."""
        stream = self.workers.generate(choice)
        stats = self.stats
        stats.begin(len(choice.prompt_token_ids))
        last = None
        outcome = "failed"
        try:
            async for chunk in stream:
                now = time.time()
                if last is None:
                    stats.ttft.add(now - choice.arrival_time, now)
                    stats.cached_prompt_tokens += chunk.num_cached_tokens
                    self.metrics.first_token(
                        now - choice.arrival_time, len(choice.prompt_token_ids), chunk.num_cached_tokens
                    )
                elif chunk.token_ids:
                    gap = (now - last) / len(chunk.token_ids)
                    stats.itl.add(gap, now)
                    self.metrics.token_gap(gap)
                last = now
                stats.completion_tokens += len(chunk.token_ids)
                delta = assembler.add(chunk.token_ids, chunk.logprobs, chunk.finish_reason)
                assembler.num_cached_tokens = max(assembler.num_cached_tokens, chunk.num_cached_tokens)
                if chunk.timing:
                    assembler.timing.update(chunk.timing)
                if turn is not None and self.conversations is not None and assembler.finish_reason is not None:
                    await self.conversations.remember(turn, choice.prompt_token_ids, assembler)
                yield delta
                if assembler.finish_reason is not None:
                    outcome = "finished"
                    return
        except BaseException as exc:
            if is_cancellation(exc):
                outcome = "aborted"
                logger.debug("request %s aborted: the client left (%s)", choice.request_id, type(exc).__name__)
            raise
        finally:
            e2e = time.time() - choice.arrival_time if outcome == "finished" else None
            stats.end(outcome, e2e)
            self.metrics.finished(e2e, outcome)
            await stream.aclose()

    async def _stream(
        self, choices, assemblers, builder: ResponseBuilder, include_usage: bool, turn: ConversationTurn | None
    ):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for delta in self._choice_deltas(choices[index], assemblers[index], turn):
                    await queue.put((index, delta))
            except Exception as exc:  # noqa: BLE001 - reported in-stream, then the stream ends
                await queue.put((index, exc))
            finally:
                await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(choices))]
        try:
            pending = await queue.get()
            if isinstance(pending[1], RequestError):
                raise pending[1]
            yield builder.sse(builder.first_chunk(len(choices)))
            open_choices = len(choices)
            while open_choices:
                index, item = pending if pending is not None else await queue.get()
                pending = None
                if item is None:
                    open_choices -= 1
                elif isinstance(item, Exception):
                    if is_cancellation(item):  # a worker call was cancelled: the client left
                        logger.debug("request %s choice %d cancelled: %r", builder.request_id, index, item)
                    else:
                        logger.warning("request %s choice %d failed: %s", builder.request_id, index, item)
                    yield builder.sse(builder.error_event(item))
                    return
                elif item.text or item.finish_reason or item.logprobs or item.tool_calls:
                    yield builder.sse(builder.chunk(index, item, assemblers[index]))
            if include_usage:
                yield builder.sse(builder.usage_chunk(assemblers))
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
