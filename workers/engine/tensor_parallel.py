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

``run_worker`` is the worker loop as a plain function: this module's ``main`` runs it in a
subprocess (``TensorParallelWorkers.launch``, the engine alone on one host); a launcher that
places ranks as Ray actors can call it the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
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

from workers.engine.block_manager import first_window_block
from workers.engine.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.layers.kv_cache import PagedKVCache, plan_num_blocks
from workers.models.config import ModelConfig
from workers.models.loader import load_model, resolve_dtype
from workers.models.parallel import TPGroup, rank_model_config
from workers.transfer.pair import new_process_group

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a model collective waiting longer fails
STARTUP_TIMEOUT_S = 300.0  # workers must start and join within this
# The control group never times out in practice: a worker idles there between steps.
_IDLE_TIMEOUT = timedelta(days=365)
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
        self.tp = TPGroup(rank, world_size, model_group, COLLECTIVE_TIMEOUT)

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
            for method in ("abort", "shutdown"):
                fn = getattr(group, method, None)
                if fn is not None:
                    try:
                        fn()
                        break
                    except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
                        continue


# -------------------------------------------------------------------- rank 0
class TensorParallelWorkers:
    """Rank 0's side: ranks 1..N-1 as subprocesses of this one, the groups joining them, and each
    step's broadcast. ``close()`` stops them (a finalizer kills any left if it is never called)."""

    def __init__(self, procs: list[subprocess.Popen], store: dist.TCPStore, groups: RankGroups) -> None:
        self.procs = procs  # procs[i] is rank i + 1
        self._store = store
        self.groups = groups
        self._failure: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill, procs)

    @property
    def tp(self) -> TPGroup:
        return self.groups.tp

    @classmethod
    def launch(cls, config: EngineConfig) -> TensorParallelWorkers:
        """Start ranks 1..N-1 on this host and join them (gloo on 127.0.0.1; NCCL for the model
        on CUDA). Workers use as many threads as this process."""
        world = config.tensor_parallel_size
        store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        init_method = f"tcp://{_HOST}:{store.port}"
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the same code as this process
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        config_json = json.dumps(_config_dict(config))
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, world):
                args = [sys.executable, "-c", _WORKER_MAIN, "--rank", str(rank)]
                args += ["--world-size", str(world), "--init-method", init_method, "--parent-pid", str(os.getpid())]
                args += ["--num-threads", str(torch.get_num_threads()), "--config", config_json]
                procs.append(subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL))
            _wait_joined(store, procs)
            groups = RankGroups(store, 0, world, rank_device(config.device, 0), _HOST)
        except BaseException:
            _kill(procs)
            raise
        logger.info(
            "tensor parallel: %d ranks joined (pids %s), model group %s",
            world,
            ", ".join(str(p.pid) for p in procs),
            "nccl" if rank_device(config.device, 0).type == "cuda" else "gloo",
        )
        return cls(procs, store, groups)

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

    def _guard(self, fn):
        """Run ``fn`` with every worker alive; a failure on the way leaves the ranks out of step:
        remember it, name the dead rank if one is, raise TensorParallelError now and from then on."""
        if self._closed:
            raise TensorParallelError("the engine is closed: its tensor-parallel workers are stopped")
        if self._failure is None:
            self._failure = self._dead_workers()
        if self._failure is not None:
            raise TensorParallelError(self._failure)
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
            dead = [(rank, p) for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not dead:
            return None
        parts = []
        for rank, p in dead:
            part = f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.returncode}"
            error = _worker_error(self._store, rank)
            parts.append(part + (f": {error}" if error else ""))
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
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._finalizer()  # kills and reaps any worker still running
        self.groups.close()


def _config_dict(config: EngineConfig) -> dict[str, Any]:
    fields = dataclasses.asdict(config)
    fields["kv_cache_dtype"] = config.kv_cache_dtype.value
    return fields


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _wait_joined(store: dist.TCPStore, procs: list[subprocess.Popen]) -> None:
    """Wait until every worker has connected to the store; fail at once if one exits first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = set(range(1, len(procs) + 1))
    while pending:
        pending = {rank for rank in pending if not store.check([f"tp/joined/{rank}"])}
        for rank, p in enumerate(procs, start=1):
            if p.poll() is not None:
                error = _worker_error(store, rank)
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.returncode} "
                    f"while starting{': ' + error if error else ''}"
                )
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
) -> None:
    """Worker rank ``rank``: join rank 0's store at ``init_method`` (``tcp://host:port``), load
    this rank's shard, build its KV cache and runner as rank 0 does, then run every step rank 0
    broadcasts until SHUTDOWN. A failure is left in the store for rank 0's error and re-raised."""
    if num_threads:
        torch.set_num_threads(num_threads)
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method {init_method!r}: expected tcp://HOST:PORT")
    store = dist.TCPStore(
        url.hostname, url.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
    )
    try:
        device = rank_device(config.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store.set(f"tp/joined/{rank}", "1")
        groups = RankGroups(store, rank, world_size, device, bind_host)
        try:
            _serve(config, groups, device)
        finally:
            groups.close()
    except BaseException:
        try:
            store.set(f"tp/error/{rank}", traceback.format_exc())
        except Exception:  # noqa: BLE001 - rank 0 is gone too: nobody to tell
            pass
        raise


def _serve(config: EngineConfig, groups: RankGroups, device: torch.device) -> None:
    """Build what rank 0 builds (``LLMEngine.__init__``), in the same order of collectives."""
    model_config = ModelConfig.from_dir(config.model_dir)
    dtype = resolve_dtype(model_config, device, config.dtype)
    max_len = config.max_model_len or model_config.max_position_embeddings
    model = load_model(config.model_dir, device, config.dtype, max_len, config.load_progress, groups.tp)
    local = rank_model_config(model_config, groups.tp)
    num_blocks = groups.agree_num_blocks(plan_num_blocks(config, local, dtype, device))
    kind, payload = groups.receive()
    if kind is not Message.INIT:
        raise RuntimeError(f"expected INIT from rank 0, got {kind.name}")
    sliding_window = payload[0] if payload[0] >= 0 else None
    kv = PagedKVCache(local, num_blocks, config.block_size, config.kv_cache_dtype, dtype, device)
    runner = ModelRunner(model, kv, sliding_window)
    while True:
        kind, payload = groups.receive()
        if kind is Message.SHUTDOWN:
            return
        if kind is not Message.STEP:
            raise RuntimeError(f"unexpected message {kind.name} from rank 0")
        runner.execute(decode_step(payload))


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
