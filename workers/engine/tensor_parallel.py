"""Tensor-parallel ranks of one engine: rank 0 is the engine process, ranks 1..N-1 run its steps.

Rank 0 owns the scheduler, the block manager and sampling. Each step it broadcasts the step's
inputs as int64s (``encode_step``: per scheduled item its new token ids, start position, token
count, the block-table entries it reads or writes, whether it completes, its prompt-logprob
targets) in one broadcast of ``MESSAGE_INTS`` (a second only for a step too long for it), and
then every rank runs the same ``ModelRunner.execute``; the model's own collectives (an
all-reduce after the embedding, o_proj and down_proj, one all-gather of the logits) join the
shards. Worker ranks rebuild light scheduled items from the message (``decode_step``): nothing
is pickled per step, and their logits are dropped.

Every rank's paged KV cache has the same blocks (rank 0 chooses the block ids) and holds its own
KV heads of each. Nothing changes cache contents outside a step: the prefix cache, preemption and
remote-KV reservations are rank 0's block bookkeeping alone. So the only other messages are INIT
(the sliding window rank 0 settled on, once) and SHUTDOWN.

Two process groups, two timeouts. The control group (gloo, CPU tensors, also on CUDA) carries the
messages: a worker waits there for the next step as long as rank 0 lives (an idle engine sends
nothing; rank 0's death closes the sockets and ends the wait at once). The model group (NCCL on
CUDA, gloo on CPU) carries the model's collectives, which fail after ``COLLECTIVE_TIMEOUT`` (a
stuck rank). Rank 0 checks its workers' processes before every step; a dead worker, or any
failure inside a step (the ranks are then out of step), raises ``TensorParallelError`` naming
the rank, and every later step raises it again.

``run_worker`` is the worker loop as a plain function, and two launchers run it, chosen
explicitly by the caller (``LLMEngine(..., tp_launcher=...)``, passed on to
``TensorParallelWorkers.launch``):

- ``"local"`` (the default: ``pdserve generate --tp``, tests): ranks 1..N-1 are subprocesses of
  this one (this module's ``main``), on 127.0.0.1.
- ``"ray"`` (a Serve replica, ``deploy/pools/servers.py``): the engine runs in a Ray actor placed
  in a placement group of at least N bundles (Serve's ``placement_group_bundles``); rank i is a
  Ray actor in bundle i asking for that bundle's CPUs and GPUs, its long-running ``run`` method
  is ``run_worker``, and its ObjectRef finishing (``ray.wait``) is the rank's death. Rank 0's
  store and gloo sockets are on the node's IP, so the group may span the group's nodes; on CUDA
  each actor sees only its own GPU (CUDA_VISIBLE_DEVICES, set by Ray) and uses ``cuda:0``.
  ``close()`` kills the actors (``ray.kill``) and waits until Ray reports them dead.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Sequence as Seq
from datetime import timedelta
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from workers.engine.assemble import ContextPlan, assemble
from workers.engine.block_manager import first_window_block
from workers.engine.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.layers.kv_cache import PagedKVCache
from workers.models.config import ModelConfig
from workers.models.parallel import TPGroup
from workers.protocol import decode, encode
from workers.transfer.pair import abort_process_group, new_process_group
from workers.transfer.tp_transfer import RankOp, RankReport, RankTransferAgent

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a model collective waiting longer fails (the group's timeout)
STARTUP_TIMEOUT_S = 300.0  # workers must start and join within this
# The control group never times out in practice: a worker idles there between steps.
_IDLE_TIMEOUT = timedelta(days=365)
RANK_ACTOR_PREFIX = "pdserve-tp/"  # a rank actor's name: this, its placement group's id, /rank
_EXIT_GRACE_S = 10.0  # a worker told to shut down gets this long before it is killed
_HOST = "127.0.0.1"
# A message's first broadcast (8 KiB): decode steps of dozens of sequences fit in it whole.
MESSAGE_INTS = 1024
# A worker subprocess's entry (-c rather than -m: the package's __init__ imports this module first).
_WORKER_MAIN = "import sys; from workers.engine.tensor_parallel import main; sys.exit(main(sys.argv[1:]))"


class Message(enum.IntEnum):
    INIT = 1  # payload: [sliding_window or -1]
    STEP = 2  # payload: encode_step
    SHUTDOWN = 3
    TRANSFER = 4  # payload: [seq]; the RankOp is at tp/op/{seq} in the store (tp_transfer.py)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or a step failed part-way: the ranks are out of step and the
    engine cannot go on. Close it and start a new one."""


def rank_device(device: str, rank: int) -> torch.device:
    """A rank's device: CPU for every rank on CPU; on CUDA the engine's device index + rank."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


# --------------------------------------------------------------- step messages
def encode_step(out: SchedulerOutput, block_size: int, sliding_window: int | None) -> list[int]:
    """``[num_decodes, num_prefills]`` then per item ``start, num_new_tokens, completes,
    n, token_ids[start:start + n], first_block, m, block_table[first_block:first_block + m],
    prompt_logprobs top (-1: none), targets.start, targets.stop``: what ``ModelRunner.execute``
    reads of each sequence, and no more (decodes send one token and the blocks attention reads)."""
    msg = [len(out.decodes), len(out.prefills)]
    for item in out.decodes + out.prefills:
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_new_tokens
        targets = seq.prompt_logprob_targets(start, end)
        token_stop = max(end, targets.stop + 1) if targets else end  # a target's next token is scored
        first_block = first_window_block(start, sliding_window, block_size)
        blocks = seq.block_table[first_block : -(-end // block_size)]
        top = seq.params.prompt_logprobs
        msg += [start, item.num_new_tokens, int(item.completes), token_stop - start]
        msg += seq.token_ids[start:token_stop]
        msg += [first_block, len(blocks), *blocks]
        msg += [-1 if top is None else top, targets.start, targets.stop]
    return msg


class _Window:
    """A run of a list from index ``offset`` on, indexed as the whole list is: what a worker rank
    holds of a sequence's token ids or block table. Reading outside the run is a bug in
    ``encode_step`` (it sent too little) and raises."""

    __slots__ = ("offset", "values")

    def __init__(self, offset: int, values: list[int]) -> None:
        self.offset, self.values = offset, values

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            if key.start is None or key.start < self.offset or key.step is not None:
                raise IndexError(f"slice {key} reaches before index {self.offset}: the step message lacks it")
            return self.values[key.start - self.offset : None if key.stop is None else key.stop - self.offset]
        if not self.offset <= key < self.offset + len(self.values):
            raise IndexError(f"index {key} is outside [{self.offset}, {self.offset + len(self.values)})")
        return self.values[key - self.offset]


@functools.lru_cache(maxsize=64)
def _prompt_logprob_params(top: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=1, prompt_logprobs=top)


class StepSeq:
    """The part of a ``Sequence`` that ``ModelRunner.execute`` reads, rebuilt on a worker rank."""

    __slots__ = ("num_computed_tokens", "num_tokens", "token_ids", "block_table", "params", "_targets")

    def __init__(
        self, start: int, num_tokens: int, tokens: _Window, blocks: _Window, top: int | None, targets: range
    ) -> None:
        self.num_computed_tokens, self.num_tokens = start, num_tokens
        self.token_ids, self.block_table = tokens, blocks
        self.params = _prompt_logprob_params(top)
        self._targets = targets

    def prompt_logprob_targets(self, start: int, end: int) -> range:
        return self._targets


def decode_step(msg: Seq[int]) -> SchedulerOutput:
    """The scheduled items of ``encode_step``'s message, over ``StepSeq`` views."""
    num_decodes, num_prefills = msg[0], msg[1]
    i = 2
    items = []
    for _ in range(num_decodes + num_prefills):
        start, num_new, completes, n = msg[i : i + 4]
        tokens = list(msg[i + 4 : i + 4 + n])
        i += 4 + n
        first_block, m = msg[i : i + 2]
        blocks = list(msg[i + 2 : i + 2 + m])
        i += 2 + m
        top, t_start, t_stop = msg[i : i + 3]
        i += 3
        # ScheduledSeq.completes compares the tokens computed after the step with num_tokens.
        num_tokens = start + num_new + (0 if completes else 1)
        view = StepSeq(
            start,
            num_tokens,
            _Window(start, tokens),
            _Window(first_block, blocks),
            None if top < 0 else top,
            range(t_start, t_stop),
        )
        items.append(ScheduledSeq(cast(Sequence, view), num_new))
    if i != len(msg):
        raise ValueError(f"step message of {len(msg)} ints has {len(msg) - i} left over")
    return SchedulerOutput(items[:num_decodes], items[num_decodes:], 0)


# ------------------------------------------------------------------ the groups
class RankGroups:
    """One rank's two process groups: control (gloo: messages, rank 0 the root) and model
    (``tp``: the model's collectives). Made by every rank at once (the constructors rendezvous
    over ``store``)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device, bind_host: str) -> None:
        self.rank, self.world_size = rank, world_size
        # Any: torch's stubs give c10d backends no collectives (pair.py's groups are untyped too).
        self.control: Any = new_process_group(
            dist.PrefixStore("tp/control", store), rank, world_size, "gloo", _IDLE_TIMEOUT, bind_host
        )
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            # A timed-out collective aborts the communicator instead of killing the process.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        model_group = new_process_group(
            dist.PrefixStore("tp/model", store), rank, world_size, backend, COLLECTIVE_TIMEOUT, bind_host, device
        )
        self.tp = TPGroup(rank, world_size, model_group)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.control.broadcast([tensor], opts).wait()

    def send(self, kind: Message, payload: Seq[int] = ()) -> None:
        """Rank 0: a message to every worker. One broadcast of ``MESSAGE_INTS`` ints (kind,
        length, the payload's start); a payload longer than that (a long prefill chunk) sends
        its rest in a second one."""
        head = torch.zeros(MESSAGE_INTS, dtype=torch.int64)
        first = min(len(payload), MESSAGE_INTS - 2)
        head[0], head[1] = int(kind), len(payload)
        head[2 : 2 + first] = torch.tensor(payload[:first], dtype=torch.int64)
        self._broadcast(head)
        if len(payload) > first:
            self._broadcast(torch.tensor(payload[first:], dtype=torch.int64))

    def receive(self) -> tuple[Message, list[int]]:
        """A worker: the next message from rank 0 (waits as long as rank 0 lives)."""
        head = torch.empty(MESSAGE_INTS, dtype=torch.int64)
        self._broadcast(head)
        kind, n = int(head[0]), int(head[1])
        first = min(n, MESSAGE_INTS - 2)
        payload = head[2 : 2 + first].tolist()
        if n > first:
            rest = torch.empty(n - first, dtype=torch.int64)
            self._broadcast(rest)
            payload += rest.tolist()
        return Message(kind), payload

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The fewest KV blocks any rank can hold: every rank allocates that many."""
        t = torch.tensor([num_blocks], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self.control.allreduce([t], opts).wait()
        return int(t.item())

    def close(self) -> None:
        for group in (self.control, self.tp.process_group):
            abort_process_group(group)


# -------------------------------------------------------------------- rank 0
class _ProcRank:
    """A worker rank run as a subprocess of this one (the local launcher)."""

    def __init__(self, rank: int, proc: subprocess.Popen) -> None:
        self.rank, self.proc = rank, proc

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def describe(self) -> str:
        return f"tensor-parallel worker rank {self.rank} (pid {self.proc.pid}) exited with code {self.proc.returncode}"

    def wait(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def reap(self) -> None:
        self.proc.wait()


class _ActorRank:
    """A worker rank run as a Ray actor in a bundle of rank 0's placement group: ``ref`` is its
    running ``run`` call (``run_worker``), ready once the rank has ended for any reason."""

    def __init__(self, rank: int, name: str, actor: Any, ref: Any) -> None:
        self.rank, self.name, self.actor, self.ref = rank, name, actor, ref

    def exited(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def describe(self) -> str:
        import ray

        name = f"tensor-parallel worker rank {self.rank} (Ray actor {self.name})"
        try:
            ray.get(self.ref, timeout=0)
        except ray.exceptions.RayActorError as exc:
            return f"{name} died ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})"
        except Exception as exc:  # noqa: BLE001 - the rank raised: its traceback's line is added from the store
            return f"{name} failed ({type(exc).__name__})"
        return f"{name} returned"

    def wait(self, timeout_s: float) -> None:
        import ray

        ray.wait([self.ref], timeout=timeout_s)

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def reap(self) -> None:
        """Wait (bounded) until Ray reports the killed actor dead: a call on it then fails."""
        import ray

        try:
            ray.get(self.actor.node_ip.remote(), timeout=_EXIT_GRACE_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        except Exception:  # noqa: BLE001 - any failure means it is not serving calls
            return


_RankHandle = _ProcRank | _ActorRank


class TensorParallelWorkers:
    """Rank 0's side: ranks 1..N-1 (subprocesses of this one or Ray actors), the groups joining
    them, and each step's broadcast. ``close()`` stops them (a finalizer kills any left if it is
    never called)."""

    def __init__(self, ranks: Seq[_RankHandle], store: dist.TCPStore, groups: RankGroups) -> None:
        self.ranks = list(ranks)  # ranks[i] is rank i + 1
        self._store = store
        self.groups = groups
        self._failure: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill, self.ranks)
        self._ops = itertools.count(1)

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The local launcher's worker processes (rank i + 1 at index i); empty under Ray."""
        return [r.proc for r in self.ranks if isinstance(r, _ProcRank)]

    @property
    def tp(self) -> TPGroup:
        return self.groups.tp

    @classmethod
    def launch(cls, config: EngineConfig, launcher: str = "local") -> TensorParallelWorkers:
        """Start ranks 1..N-1 with ``launcher`` ("local": subprocesses here; "ray": Ray actors
        in this actor's placement group) and join them."""
        if launcher == "local":
            return cls._launch_local(config)
        if launcher == "ray":
            return cls._launch_ray(config)
        raise ValueError(f"tp_launcher {launcher!r}: choose 'local' or 'ray'")

    @classmethod
    def _launch_local(cls, config: EngineConfig) -> TensorParallelWorkers:
        """Ranks 1..N-1 as subprocesses on this host (gloo on 127.0.0.1; NCCL for the model on
        CUDA). Workers use as many threads as this process."""
        world = config.tensor_parallel_size
        store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        init_method = f"tcp://{_HOST}:{store.port}"
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the same code as this process
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        config_json = json.dumps(_config_dict(config))
        ranks: list[_RankHandle] = []
        try:
            for rank in range(1, world):
                args = [sys.executable, "-c", _WORKER_MAIN, "--rank", str(rank)]
                args += ["--world-size", str(world), "--init-method", init_method, "--parent-pid", str(os.getpid())]
                args += ["--num-threads", str(torch.get_num_threads()), "--config", config_json]
                ranks.append(_ProcRank(rank, subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL)))
            _wait_joined(store, ranks)
            groups = RankGroups(store, 0, world, rank_device(config.device, 0), _HOST)
        except BaseException:
            _kill(ranks)
            raise
        logger.info(
            "tensor parallel: %d ranks joined (pids %s), model group %s",
            world,
            ", ".join(str(r.proc.pid) for r in ranks if isinstance(r, _ProcRank)),
            "nccl" if rank_device(config.device, 0).type == "cuda" else "gloo",
        )
        return cls(ranks, store, groups)

    @classmethod
    def _launch_ray(cls, config: EngineConfig) -> TensorParallelWorkers:
        """Ranks 1..N-1 as Ray actors in bundles 1..N-1 of the placement group this actor runs
        in (each asking for its bundle's CPUs and GPUs); the store and gloo on the node's IP."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world = config.tensor_parallel_size
        # (get_current_placement_group would start a local Ray in a process that has none)
        pg = ray.util.get_current_placement_group() if ray.is_initialized() else None
        if pg is None:
            raise TensorParallelError(
                f"tensor_parallel_size={world} with the Ray launcher needs the engine inside a Ray actor "
                "in a placement group of at least that many bundles (a Serve deployment's "
                "placement_group_bundles); this process is in none"
            )
        bundles = pg.bundle_specs
        if len(bundles) < world:
            raise TensorParallelError(
                f"tensor_parallel_size={world}: this actor's placement group has {len(bundles)} bundle(s); "
                f"it needs one per rank ({world})"
            )
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        init_method = f"tcp://{host}:{store.port}"
        rank_device_name = "cuda:0" if torch.device(config.device).type == "cuda" else config.device
        actor_cls = _rank_actor_class()
        ranks: list[_RankHandle] = []
        try:
            for rank in range(1, world):
                spec = bundles[rank]
                name = f"{RANK_ACTOR_PREFIX}{pg.id.hex()}/{rank}"  # found by the replica's placement group
                actor = actor_cls.options(
                    name=name,
                    num_cpus=spec.get("CPU", 0),
                    num_gpus=spec.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=rank
                    ),
                ).remote()
                ref = actor.run.remote(config, rank, world, init_method, torch.get_num_threads(), rank_device_name)
                ranks.append(_ActorRank(rank, name, actor, ref))
            _wait_joined(store, ranks)
            groups = RankGroups(store, 0, world, rank_device(config.device, 0), host)
        except BaseException:
            _kill(ranks)
            raise
        logger.info(
            "tensor parallel: %d ranks joined (Ray actors in placement group %s, store %s), model group %s",
            world,
            pg.id.hex()[:12],
            init_method,
            "nccl" if rank_device(config.device, 0).type == "cuda" else "gloo",
        )
        return cls(ranks, store, groups)

    def check(self) -> None:
        """Raise TensorParallelError when a rank has died or a step has failed (a health check:
        it sends nothing to the ranks)."""
        if self._closed:
            raise TensorParallelError("the engine is closed: its tensor-parallel workers are stopped")
        if self._failure is None:
            self._failure = self._dead_workers()
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    def agree_num_blocks(self, num_blocks: int) -> int:
        return self._guard(lambda: self.groups.agree_num_blocks(num_blocks))

    def start(self, sliding_window: int | None) -> None:
        """Tell the workers what rank 0 settled on; they build their caches and runners."""
        self._guard(lambda: self.groups.send(Message.INIT, [-1 if sliding_window is None else sliding_window]))

    def execute(self, runner: ModelRunner, out: SchedulerOutput):
        """One step on every rank: broadcast its inputs, run rank 0's share; ``runner.execute``'s
        result (the logits are whole on rank 0)."""

        def step():
            self.groups.send(Message.STEP, encode_step(out, runner.block_size, runner.sliding_window))
            return runner.execute(out)

        return self._guard(step)

    def dispatch(self, op: RankOp) -> int:
        """Engine thread, between steps: hand ``op`` to the worker ranks it names (KV transfer,
        ``workers/transfer/tp_transfer.py``): the op goes into the store, its number out in one
        broadcast; each rank runs it on a thread of its own and leaves its report. Returns the
        number ``collect`` waits on."""
        seq = next(self._ops)

        def post() -> None:
            self._store.set(f"tp/op/{seq}", encode(op).decode())
            self.groups.send(Message.TRANSFER, [seq])

        self._guard(post)
        return seq

    def collect(self, seq: int, ranks: Seq[int], timeout_s: float) -> dict[int, RankReport]:
        """Any thread: the reports of ``ranks`` on op ``seq``, waiting up to ``timeout_s``; a rank
        that died or did not answer in time is missing from the result. Clears the op's keys."""
        deadline = time.monotonic() + timeout_s
        pending = set(ranks)
        reports: dict[int, RankReport] = {}
        pause = 0.001
        while pending:
            for rank in sorted(pending):
                key = f"tp/op/{seq}/done/{rank}"
                if self._store.check([key]):
                    reports[rank] = decode(RankReport, self._store.get(key))
                    pending.discard(rank)
            if not pending or time.monotonic() >= deadline:
                break
            if self._failure is not None or any(r.exited() for r in self.ranks if r.rank in pending):
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.002)  # a transfer takes tens of ms: poll finely
        for key in [f"tp/op/{seq}"] + [f"tp/op/{seq}/done/{rank}" for rank in ranks]:
            try:
                self._store.delete_key(key)
            except Exception:  # noqa: BLE001 - a leftover key costs a few bytes
                pass
        return reports

    def _guard(self, fn):
        """Run ``fn`` with every worker alive; a failure on the way leaves the ranks out of step:
        remember it, name the dead rank if one is, raise TensorParallelError now and from then on."""
        self.check()
        try:
            return fn()
        except Exception as exc:
            self._failure = self._dead_workers(wait_s=2.0) or f"a tensor-parallel step failed on rank 0: {exc}"
            raise TensorParallelError(self._failure) from exc

    def _dead_workers(self, wait_s: float = 0.0) -> str | None:
        """A description of the workers that have exited (waiting up to ``wait_s`` for an exit
        to show: a collective fails as soon as a peer's sockets close), or None."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [r for r in self.ranks if r.exited()]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not dead:
            return None
        parts = []
        for r in dead:
            error = _worker_error(self._store, r.rank)
            parts.append(r.describe() + (f": {error}" if error else ""))
        return "; ".join(parts) + ": the engine cannot go on; close it and start a new one"

    def close(self) -> None:
        """Stop every worker (SHUTDOWN, then a kill for any still there after a grace period)
        and wait for each to exit. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None and self._dead_workers() is None:
            try:
                self.groups.send(Message.SHUTDOWN)
            except Exception as exc:  # noqa: BLE001 - they are killed below
                logger.warning("tensor parallel: shutdown message failed (%s); killing the workers", exc)
            deadline = time.monotonic() + _EXIT_GRACE_S
            for r in self.ranks:
                r.wait(max(0.0, deadline - time.monotonic()))
        self._finalizer()  # kills and reaps any worker still running (a Ray actor always: it outlives its call)
        self.groups.close()


def _config_dict(config: EngineConfig) -> dict[str, Any]:
    fields = dataclasses.asdict(config)
    fields["kv_cache_dtype"] = config.kv_cache_dtype.value
    return fields


def _kill(ranks: list[_RankHandle]) -> None:
    for r in ranks:
        r.kill()
    for r in ranks:
        r.reap()


def _wait_joined(store: dist.TCPStore, ranks: list[_RankHandle]) -> None:
    """Wait until every worker has connected to the store; fail at once if one exits first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = set(range(1, len(ranks) + 1))
    while pending:
        pending = {rank for rank in pending if not store.check([f"tp/joined/{rank}"])}
        for r in ranks:
            if r.exited():
                error = _worker_error(store, r.rank)
                raise TensorParallelError(f"{r.describe()} while starting{': ' + error if error else ''}")
        if pending and time.monotonic() > deadline:
            raise TensorParallelError(
                f"tensor-parallel worker ranks {sorted(pending)} did not join within {STARTUP_TIMEOUT_S:.0f}s"
            )
        time.sleep(0.02)


def _worker_error(store: dist.Store, rank: int) -> str | None:
    """The last line of the traceback a worker left in the store before exiting, if any."""
    key = f"tp/error/{rank}"
    try:
        if store.check([key]):
            lines = store.get(key).decode(errors="replace").strip().splitlines()
            return lines[-1] if lines else None
    except Exception:  # noqa: BLE001 - the description goes without it
        return None
    return None


# ------------------------------------------------------------------- workers
def run_worker(
    config: EngineConfig,
    rank: int,
    world_size: int,
    init_method: str,
    *,
    bind_host: str = _HOST,
    num_threads: int | None = None,
    device: str | None = None,
) -> None:
    """Worker rank ``rank``: join rank 0's store at ``init_method`` (``tcp://host:port``), load
    this rank's shard, build its KV cache and runner as rank 0 does, then run every step rank 0
    broadcasts until SHUTDOWN. A failure is left in the store for rank 0's error and re-raised.
    ``device``: this rank's device when it is not ``rank_device(config.device, rank)`` (a Ray
    actor on CUDA sees only its own GPU: ``cuda:0``)."""
    if num_threads:
        torch.set_num_threads(num_threads)
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method {init_method!r}: expected tcp://HOST:PORT")
    store = dist.TCPStore(
        url.hostname, url.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
    )
    try:
        own = torch.device(device) if device is not None else rank_device(config.device, rank)
        if own.type == "cuda":
            torch.cuda.set_device(own)
        store.set(f"tp/joined/{rank}", "1")
        groups = RankGroups(store, rank, world_size, own, bind_host)
        try:
            _serve(config, groups, own, store, bind_host)
        finally:
            groups.close()
    except BaseException:
        try:
            store.set(f"tp/error/{rank}", traceback.format_exc())
        except Exception:  # noqa: BLE001 - rank 0 is gone too: nobody to tell
            pass
        raise


def _serve(config: EngineConfig, groups: RankGroups, device: torch.device, store: dist.Store, bind_host: str) -> None:
    """Build what rank 0 builds (``LLMEngine.__init__``), in the same order of collectives, then
    run its steps; KV transfer ops run beside them on the rank's transfer agent."""

    def settle(model_config: ModelConfig, num_blocks: int) -> ContextPlan:
        kind, payload = groups.receive()  # rank 0's plan: the sliding window it settled on
        if kind is not Message.INIT:
            raise RuntimeError(f"expected INIT from rank 0, got {kind.name}")
        max_len = config.max_model_len or model_config.max_position_embeddings  # rank 0 holds the limit
        return ContextPlan(max_len, payload[0] if payload[0] >= 0 else None, None)

    parts = assemble(config, device, groups.tp, groups.agree_num_blocks, settle, rank0=False)
    kv, runner = parts.kv, parts.runner
    agent: RankTransferAgent | None = None
    try:
        while True:
            kind, payload = groups.receive()
            if kind is Message.SHUTDOWN:
                return
            if kind is Message.TRANSFER:
                agent = _transfer(store, groups.rank, payload[0], agent, kv, device, bind_host)
                continue
            if kind is not Message.STEP:
                raise RuntimeError(f"unexpected message {kind.name} from rank 0")
            runner.execute(decode_step(payload))
    finally:
        if agent is not None:
            agent.close()


def _transfer(
    store: dist.Store,
    rank: int,
    seq: int,
    agent: RankTransferAgent | None,
    kv: PagedKVCache,
    device: torch.device,
    bind_host: str,
) -> RankTransferAgent | None:
    """One ``Message.TRANSFER`` on a worker rank: ``open`` builds the rank's transfer agent (and
    answers with its address) here; a send or recv runs on the agent's threads, so the next step
    is not held up; either way the report goes into the store. Returns the agent."""
    op = decode(RankOp, store.get(f"tp/op/{seq}"))
    if op.kind != "open" and rank not in op.pairs:
        return agent  # not this rank's: the op names only the ranks that move data
    key = f"tp/op/{seq}/done/{rank}"

    def report(result: RankReport) -> None:
        try:
            store.set(key, encode(result).decode())
        except Exception:  # noqa: BLE001 - rank 0 is gone: nobody to tell
            pass

    if op.kind == "open":
        try:
            if agent is not None:
                agent.close()
            agent = RankTransferAgent(op, rank, kv.layers, device, bind_host)
            report(RankReport(True, address=agent.address))
        except Exception as exc:  # noqa: BLE001 - rank 0 refuses to serve transfers then
            report(RankReport(False, error=f"{type(exc).__name__}: {exc}"))
        return agent
    if agent is None:
        report(RankReport(False, error=f"rank {rank} has no transfer agent (no open op came first)"))
        return agent
    agent.submit(op, report)
    return agent


class TensorParallelRank:
    """One worker rank as a Ray actor, in a bundle of its engine's placement group (the Ray
    launcher; ``_rank_actor_class`` makes it a Ray actor class): ``run`` is the rank's life."""

    def run(
        self, config: EngineConfig, rank: int, world_size: int, init_method: str, num_threads: int, device: str
    ) -> None:
        import ray

        run_worker(
            config,
            rank,
            world_size,
            init_method,
            bind_host=ray.util.get_node_ip_address(),
            num_threads=num_threads,
            device=device,
        )

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


@functools.cache
def _rank_actor_class() -> Any:
    """``TensorParallelRank`` as a Ray actor class (made on first use: the local launcher never
    imports Ray). No restarts: a rank that died leaves the group out of step for good."""
    import ray

    return ray.remote(max_restarts=0, max_task_retries=0)(TensorParallelRank)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker outlives no parent: rank 0 killed mid-start-up leaves nobody to stop it."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one tensor-parallel worker rank of an LLMEngine")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    fields = json.loads(args.config)
    if fields.get("compile_batch_sizes") is not None:
        fields["compile_batch_sizes"] = tuple(fields["compile_batch_sizes"])
    run_worker(EngineConfig(**fields), args.rank, args.world_size, args.init_method, num_threads=args.num_threads)
    return 0
