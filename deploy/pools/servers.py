"""The worker pools as Ray Serve deployments: prefill, decode and colocated.

Each replica runs one engine (``workers/``) and, when a Redis URL is configured, publishes its
block events and load to the prefix index. A replica's worker id is its Serve replica id, so
routers map index entries straight onto replicas. Nothing about one transfer goes through
Serve: a decode replica (and the ingress, to release blocks) reaches the prefill replica that
holds a request's KV at the control address in its KVHandle (``workers/transfer/control.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator

import ray
import torch
from ray import serve

from deploy.args import PDServeArgs, PoolArgs
from deploy.ops.metrics import WorkerMetrics
from deploy.pools.directory import NAMESPACE as KV_NAMESPACE
from deploy.pools.directory import Registration
from deploy.pools.rebalance import Rebalancer
from deploy.pools.routers import LINK_FAILURE_WINDOW_S
from deploy.replica_logging import route_to_serve
from kvstore import IndexConfig, IndexPublisher, PrefixIndex, WorkerSpec
from workers.decode import ColocatedWorker, DecodeWorker
from workers.engine import LLMEngine
from workers.engine_loop import EngineLoop
from workers.kv_source import KVSource
from workers.output_channel import OutputSender
from workers.prefill import PrefillWorker
from workers.protocol import GenerateRequest, KVHandle, PrefillResult, TokenChunk, TransferAddress, encode
from workers.transfer import TransferConfig, Transport
from workers.transfer.control import ControlHandlers, ControlServer

logger = logging.getLogger("pdserve")


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def engine_threads(pool: PoolArgs) -> int:
    """Torch threads for each rank of a replica of ``pool`` (one rank unless tensor_parallel_size
    > 1; every rank has its own bundle of ``num_cpus``): ``num_threads`` when given, else what
    ``num_cpus`` grants, ``max(1, floor(num_cpus))``. Set explicitly: Ray sets OMP_NUM_THREADS=1 for an actor
    with num_cpus <= 1, which torch would otherwise follow."""
    if pool.num_threads is not None:
        return pool.num_threads
    return max(1, math.floor(pool.num_cpus))


def set_engine_threads(pool: PoolArgs) -> int:
    """Apply ``engine_threads(pool)`` to this process's torch; returns the count now in force."""
    torch.set_num_threads(engine_threads(pool))
    return torch.get_num_threads()


def transfer_config(args: PDServeArgs) -> TransferConfig:
    return TransferConfig(
        transport=Transport(args.transport),
        host=ray.util.get_node_ip_address(),
        node_id=ray.get_runtime_context().get_node_id(),
        connect_timeout_s=args.transfer_timeout_s,
        transfer_timeout_s=args.transfer_timeout_s,
        checksum=args.kv_checksum,
        fault_corrupt_bytes=int(args.fault_injection.get("kv_corrupt_bytes", 0)),
    )


def step_health_problem(role: str, worker_id: str, stalled_s: float, timeout_s: float) -> str | None:
    """What a replica's health check reports when its engine has been inside one step (a hung
    CUDA kernel, an NCCL collective that never completes, ...) for more than ``timeout_s``
    (``step_timeout_s``; 0 disables the check); None while it is fine."""
    if timeout_s <= 0 or stalled_s <= timeout_s:
        return None
    return (
        f"{role} replica {worker_id}: its engine has been inside one step for {stalled_s:.1f}s, over "
        f"step_timeout_s {timeout_s:g}s (a hung kernel or collective?)"
    )


def step_hang_key(app_name: str) -> bytes:
    """Testing only: the key (Ray's internal KV, namespace ``pdserve``) by which one replica of
    application ``app_name`` claims the injected step hang (fault_injection ``step_hang_s``)."""
    return f"faults::step_hang::{app_name}".encode()


class _WorkerServer:
    """What every pool's replica shares: engine construction, index publishing, stats."""

    role = "worker"
    worker: PrefillWorker | ColocatedWorker  # each pool's server sets its own

    def _setup(self, args: dict) -> EngineLoop:
        self.args = PDServeArgs.model_validate(args)
        route_to_serve(self.args.log_level)  # pdserve's and the engine's lines reach the replica's log
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        self.node_ip = ray.util.get_node_ip_address()  # what status shows and the KVHandle advertises
        self.device = resolve_device(self.args.device)
        pool = getattr(self.args, self.role)
        # The GPUs Ray gave this replica (it sets CUDA_VISIBLE_DEVICES to them): a CUDA engine
        # without one would share another replica's device, so it does not start.
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        if self.device == "cuda" and not self.gpu_ids:
            raise RuntimeError(
                f"{self.role} replica {self.worker_id}: a CUDA engine, but Ray gave this replica no GPU: "
                f"set {self.role}.num_gpus (pdserve up --gpus-per-replica)"
            )
        self.torch_threads = set_engine_threads(pool)
        self.prefill_threads = pool.prefill_threads if self.device == "cpu" else None
        self.small_batch_threads = pool.small_batch_threads if self.device == "cpu" else None
        logger.info(
            "%s replica %s: engine runs torch with %d thread(s) per rank on %d rank(s)%s%s "
            "(num_threads %s, num_cpus %g)",
            self.role,
            self.worker_id,
            self.torch_threads,
            pool.tensor_parallel_size,
            f", {self.prefill_threads} in steps that compute prompts" if self.prefill_threads else "",
            f", {self.small_batch_threads} in decode steps of up to {pool.small_batch_max_seqs} sequences"
            if self.small_batch_threads
            else "",
            pool.num_threads,
            pool.num_cpus,
        )
        self.publisher: IndexPublisher | None = None
        self.outputs = OutputSender(self.worker_id)  # to the ingress replicas' output sinks
        self.metrics = WorkerMetrics(self.worker_id, self.role, self.args.model_name)
        self._stall_reported = False  # the health check has logged the current hung step
        self._step_hang_tried = False  # fault injection step_hang_s: this process tried its claim
        # tensor_parallel_size > 1: ranks 1..N-1 are Ray actors in this replica's placement group
        # (Serve's placement_group_bundles, deploy/builder.py), each with the same torch threads.
        # The engine is built on the thread that will step it: one OpenMP pool per process
        # (workers/engine_loop.py).
        self.loop = EngineLoop(
            lambda: LLMEngine(
                self.args.model,
                load_progress=True,
                tp_launcher="ray",
                **self.args.engine_kwargs(self.device, self.role),
            ),
            on_step=self._on_step,
        )
        engine = self.engine = self.loop.engine
        self._load: dict[str, float] = {
            "free_blocks": engine.num_kv_blocks,
            "total_blocks": engine.num_kv_blocks,
            "num_running": 0,
            "num_waiting": 0,
        }
        logger.info(
            "%s replica %s ready: %d KV blocks on %s%s%s",
            self.role,
            self.worker_id,
            engine.num_kv_blocks,
            self.device,
            f" (GPU {','.join(self.gpu_ids)})" if self.gpu_ids else "",
            f", {summary}" if (summary := engine.backend.linears_summary()) else "",
        )
        return self.loop

    async def _start_control(self, source: PrefillWorker | KVSource | None = None) -> ControlServer:
        """Open this replica's control server (a worker that sends KV brings its own, with the
        lease calls) and register it in the application's worker directory, where the cluster
        status finds it. Returns the control server."""
        if source is None:
            control = ControlServer(self.worker_id, self.node_ip, ControlHandlers())
            await control.start()
            self._own_control = control
            address = control.address_of(
                TransferAddress(self.node_ip, 0, self.worker_id, ray.get_runtime_context().get_node_id())
            )
        else:
            control, address = source.control, source.address
        control.handlers.stats = self.stats
        context = serve.get_replica_context()
        self.registration = Registration(context.app_name, context.deployment, address)
        self.registration.start()
        return control

    async def _start_publisher(self, engine: LLMEngine, address: str) -> None:
        if not self.args.redis_url:
            return
        config = IndexConfig(redis_url=self.args.redis_url, model_key=engine.model_key)
        spec = WorkerSpec(
            worker_id=self.worker_id,
            role=self.role,
            address=address,
            total_blocks=engine.num_kv_blocks,
            block_size=engine.config.block_size,
            kv_cache_dtype=engine.config.kv_cache_dtype.value,
            kv_storage_dtype=engine.kv_layout.dtype,
        )
        self.publisher = IndexPublisher(config, spec)
        await self.publisher.start()  # raises IncompatibleWorkerError for a mismatched pool

    def _on_step(self, engine: LLMEngine) -> None:
        """Engine thread, after each step and on idle ticks: events out, load refreshed."""
        state = engine.stats()
        if state.num_running and (delay := self.args.fault_injection.get("step_delay_s")):
            time.sleep(delay)  # testing only: a slow engine, so a test can act while sequences run
        if state.num_running and (hang := self.args.fault_injection.get("step_hang_s")) and self._claim_step_hang():
            logger.warning("%s replica %s: fault injection: this step hangs for %gs", self.role, self.worker_id, hang)
            time.sleep(hang)  # testing only: a step that does not return (a hung kernel or collective)
        self._load = {
            "free_blocks": state.num_free_blocks,
            "total_blocks": state.num_blocks,
            "num_running": state.num_running,
            "num_waiting": state.num_waiting,
        }
        self._load.update(_tier_costs(state, engine.config.block_size, self.role))
        # Kept in the engine until the publisher exists: a restarted replica's disk tier
        # announces its blocks before the first step.
        events = engine.take_events() if self.publisher is not None or not self.args.redis_url else []
        worker = getattr(self, "worker", None)  # idle ticks can start before the worker is assigned
        if worker is not None:  # a decode worker's prompts waiting for KV room wait here too
            self._load["num_waiting"] += worker.stats.kv_waiting
        if worker is not None and self.metrics.due():
            self.metrics.refresh(worker.stats.snapshot(engine))
        if self.publisher is not None:
            if events:
                self.publisher.submit(events)
            self.publisher.set_load(state.num_free_blocks, state.num_running, int(self._load["num_waiting"]))
        if (rebalancer := getattr(self, "rebalancer", None)) is not None:
            rebalancer.on_step(state.num_free_blocks, state.num_running)

    def _claim_step_hang(self) -> bool:
        """Testing only (fault_injection ``step_hang_s``): whether this step is the one that hangs.
        A replica that decodes (decode or colocated; never prefill, so a request's prefill runs,
        a migrated stream's too) asks once, at its first step that runs sequences; the first
        replica of the application to ask claims the hang in Ray's internal KV, and the others
        run normally: the decode replica a hung replica's streams move to, and the replica Serve
        starts in its place, do not hang in turn. Once per application for the life of the Ray
        cluster: a test deletes ``step_hang_key(app)`` before it deploys."""
        if self.role == "prefill" or self._step_hang_tried:
            return False
        self._step_hang_tried = True
        from ray.experimental.internal_kv import _internal_kv_put

        key = step_hang_key(serve.get_replica_context().app_name)
        try:
            existed = _internal_kv_put(key, self.worker_id.encode(), overwrite=False, namespace=KV_NAMESPACE)
        except Exception:  # noqa: BLE001 - a fault that cannot be injected is no failure
            logger.warning("%s replica %s: step_hang_s not claimed", self.role, self.worker_id, exc_info=True)
            return False
        return not existed  # it existed: another replica has the hang

    async def record_routing_stats(self) -> dict:  # async: Serve runs a sync one on a new thread each second
        return dict(self._load)

    async def stats(self) -> dict:
        worker = self.worker
        snapshot = await worker.loop.call(lambda e: worker.stats.snapshot(e))
        index = None
        if self.publisher is not None:
            index = {
                "registered": self.publisher.registered,
                "buffered_events": self.publisher.buffered_events,
                "dropped_events": self.publisher.dropped_events,
            }
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "device": self.device,
            "gpu_ids": self.gpu_ids,
            "node_ip": self.node_ip,
            "torch_threads": self.torch_threads,
            "prefill_threads": self.prefill_threads,
            "small_batch_threads": self.small_batch_threads,
            "small_batch_max_seqs": getattr(self.args, self.role).small_batch_max_seqs,
            "index": index,
            "output_channel": self.outputs.stats(),
            "recent_transfer_failures": worker.stats.recent_failures(LINK_FAILURE_WINDOW_S),
            **snapshot,
        }

    def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; a raise (three in a row) makes it
        replace the replica, and the ingress resumes the decode streams that were on it on
        another decode replica, as for a replica that died (deploy/pools/worker_calls.py)."""
        loop = self.worker.loop
        if not loop.alive:
            raise RuntimeError(f"{self.role} replica {self.worker_id}: engine loop is dead")
        if self.engine.tensor_parallel is not None:
            self.engine.tensor_parallel.check()  # a dead rank fails the replica: Serve replaces it
        # A step that does not return (a hung kernel or collective) leaves the thread alive and
        # every request here waiting: it fails the replica once it has run step_timeout_s.
        problem = step_health_problem(self.role, self.worker_id, loop.stalled_for(), self.args.step_timeout_s)
        if problem is None:
            self._stall_reported = False
            return
        if not self._stall_reported:  # one line per hung step, not one per health check
            self._stall_reported = True
            logger.warning("%s: reporting unhealthy, Serve will replace the replica", problem)
        raise RuntimeError(problem)

    async def __del__(self) -> None:
        """Serve's graceful stop, after the replica stopped taking calls and its in-flight ones
        drained (or their time ran out): end what still runs (aborting frees its KV blocks),
        then leave the prefix index while its Redis is still up (``pdserve up`` stops Redis
        only after the application is gone). Safe to call twice and after a failed start."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        registration = getattr(self, "registration", None)
        if registration is not None:
            await registration.stop()  # the status stops asking this replica
        if (control := getattr(self, "_own_control", None)) is not None:
            await control.stop()
        if (rebalancer := getattr(self, "rebalancer", None)) is not None:
            await rebalancer.stop()
        if (outputs := getattr(self, "outputs", None)) is not None:
            await outputs.close()
        worker, publisher = getattr(self, "worker", None), getattr(self, "publisher", None)
        if worker is not None:
            try:
                await worker.shutdown()
            except Exception:  # noqa: BLE001 - the index must still be left
                logger.warning("%s replica %s: worker shutdown failed", self.role, self.worker_id, exc_info=True)
        elif (loop := getattr(self, "loop", None)) is not None:
            await asyncio.to_thread(loop.shutdown)  # the engine was built, its worker never was
        engine = getattr(self, "engine", None)
        # Only once the engine thread has stopped (a step still running would race the ranks'
        # shutdown); else Ray ends the rank actors with this replica, their owner.
        if engine is not None and not self.loop.alive:
            try:
                await asyncio.to_thread(engine.close)  # tensor-parallel rank actors stopped and gone
            except Exception:  # noqa: BLE001 - the index must still be left
                logger.warning("%s replica %s: engine close failed", self.role, self.worker_id, exc_info=True)
        if publisher is not None:
            await publisher.stop()
        logger.info("%s replica %s stopped", self.role, getattr(self, "worker_id", "?"))


@serve.deployment(name="prefill")
class PrefillServer(_WorkerServer):
    role = "prefill"
    worker: PrefillWorker

    async def __init__(self, args: dict) -> None:  # type: ignore[misc]  # Serve awaits an async constructor
        loop = self._setup(args)
        self._delayed_prefills = 0  # requests in the injected prefill_delay_s (fault_injection)
        stall = self.args.fault_injection.get("send_stall_s")
        self.worker = PrefillWorker(
            loop,
            self.worker_id,
            transfer_config(self.args),
            self.args.lease_ttl_s,
            on_step=self._on_step,
            before_send=(lambda: asyncio.sleep(stall)) if stall else None,
        )
        await self.worker.start()
        await self._start_control(self.worker)
        address = f"{self.worker.address.host}:{self.worker.address.port}"
        await self._start_publisher(loop.engine, address)

    async def record_routing_stats(self) -> dict:
        # Link-aware routing: the prefill router tries a replica whose sends failed lately last.
        return {**self._load, "recent_transfer_failures": self.worker.stats.recent_failures(LINK_FAILURE_WINDOW_S)}

    async def stats(self) -> dict:
        out = await super().stats()
        if self.args.fault_injection.get("prefill_delay_s"):
            out["delayed_prefills"] = self._delayed_prefills
        return out

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        if delay := self.args.fault_injection.get("prefill_delay_s"):
            self._delayed_prefills += 1  # shown in stats: a fault test sees where requests wait
            try:
                await asyncio.sleep(delay)
            finally:
                self._delayed_prefills -= 1
        result = await self.worker.prefill(request)
        self.metrics.request_timing(result.timing)
        return result


@serve.deployment(name="decode")
class DecodeServer(_WorkerServer):
    role = "decode"
    worker: DecodeWorker

    async def __init__(self, args: dict) -> None:  # type: ignore[misc]  # Serve awaits an async constructor
        loop = self._setup(args)
        self.worker = DecodeWorker(loop, self.worker_id, transfer_config(self.args), lease_ttl_s=self.args.lease_ttl_s)
        await self.worker.start()
        control = await self._start_control(self.worker.source)
        control.handlers.retire = self.retire
        control.handlers.move = self.move
        control.handlers.precopy = self.precopy
        await self._start_publisher(loop.engine, self.worker_id)
        self.rebalancer: Rebalancer | None = None
        if self.args.kv_rebalance and self.args.redis_url and self.worker.source is not None:
            index = PrefixIndex(IndexConfig(redis_url=self.args.redis_url, model_key=loop.engine.model_key))
            self.rebalancer = Rebalancer(self.worker, index, self.worker_id)
            self.rebalancer.start()

    async def retire(self) -> int:
        """The autoscaler's word that Serve is stopping this replica (``Retire`` on its control
        server): hand every stream over now instead of holding the replica (and its budget slot)
        until they finish or the drain time cuts them."""
        ended = await self.worker.retire()
        logger.info("decode replica %s retiring: %d stream(s) handed to other decode replicas", self.worker_id, ended)
        return ended

    async def move(self, request_id: str, recompute: bool) -> list[str]:
        """``Move`` on its control server: move the streams ``request_id`` names."""
        moved = await self.worker.move(request_id, recompute)
        if moved:
            how = "by recompute" if recompute or self.worker.source is None else "live"
            logger.info(
                "decode replica %s: moving %s %s to another decode replica", self.worker_id, ", ".join(moved), how
            )
        return moved

    async def precopy(self, request_id: str) -> dict:
        """``PreCopy`` on its control server: a live move's first phase (``DecodeWorker.precopy``)."""
        copies = await self.worker.precopy(request_id)
        return {
            "copies": [
                {
                    "request_id": rid,
                    "handle": encode(handle).decode(),
                    "token_ids": held.token_ids,
                    "cache_salt": held.cache_salt,
                }
                for rid, handle, held in copies
            ]
        }

    async def prefetch(self, request: GenerateRequest, handle: KVHandle) -> dict:
        """A live move's first phase, receiving side (``DecodeWorker.prefetch``), then the index
        hears of the blocks at once: the move's decode call is routed by them."""
        blocks = await self.worker.prefetch(request, handle)
        if self.publisher is not None:
            await self.publisher.flush()
        return {"worker_id": self.worker_id, "blocks": blocks}

    async def generate(self, request: GenerateRequest, prefill: PrefillResult) -> AsyncIterator[TokenChunk]:
        async for chunk in self.outputs.stream(request.output_address, self._timed(request, prefill)):
            yield chunk

    async def _timed(self, request: GenerateRequest, prefill: PrefillResult) -> AsyncIterator[TokenChunk]:
        async for chunk in self.worker.generate(request, prefill):
            if chunk.timing:
                self.metrics.request_timing(chunk.timing)
            yield chunk

    async def generate_local(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        async for chunk in self.outputs.stream(request.output_address, self.worker.generate_local(request)):
            yield chunk


@serve.deployment(name="colocated")
class ColocatedServer(_WorkerServer):
    role = "colocated"
    worker: ColocatedWorker

    async def __init__(self, args: dict) -> None:  # type: ignore[misc]  # Serve awaits an async constructor
        loop = self._setup(args)
        self.worker = ColocatedWorker(loop, self.worker_id)
        await self._start_control()
        await self._start_publisher(loop.engine, self.worker_id)

    async def generate_local(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        async for chunk in self.outputs.stream(request.output_address, self.worker.generate_local(request)):
            yield chunk


def _tier_costs(state, block_size: int, role: str) -> dict[str, float]:
    """Per-block seconds this replica measured, for the prefill router's cost model
    (``TierCosts.from_routing_stats``): loading a block from each KV tier, and (a prefill replica,
    whose busy time is prompts) computing one. Absent until measured."""
    costs = {}
    if state.host_hits:
        costs["host_load_block_s"] = state.host_load_s / state.host_hits
    if state.disk_hits:
        costs["disk_load_block_s"] = state.disk_load_s / state.disk_hits
    if role == "prefill" and state.prefill_tokens_computed:
        costs["prefill_block_s"] = state.busy_s / state.prefill_tokens_computed * block_size
    return costs
