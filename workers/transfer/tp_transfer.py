"""KV transfer between tensor-parallel replicas of any sizes: one message per (prefill rank,
decode rank) pair that exchanges data, each over its own pair group, coordinated by rank 0 of
each side.

Each rank of a replica holds its own KV heads of every block (``workers/transfer/tp_plan.py``
says which), so a decode rank receives exactly its heads, from the prefill ranks that hold them.
Rank 0 of each replica is the engine process; ranks 1..N-1 are its tensor-parallel workers
(``workers/engine/tensor_parallel.py``), which take part through a ``RankTransferAgent``: rank 0
writes a ``RankOp`` (JSON) into the replica's rank store, broadcasts its sequence number on the
replica's control group between two steps (``Message.TRANSFER``: one broadcast per transfer, never
per layer), and each named rank runs its pairs on a thread of its own (the steps go on meanwhile:
a transfer touches only blocks no step reads or writes) and leaves a ``RankReport`` in the store.

The request path, as with one rank per side (``client.py``/``server.py``, issue 3's rules):

* Decode rank 0 (``TPPuller``) holds its lock for the prefill replica for the whole transfer,
  picks each pair's epoch (a pair's group is reused while it lives; a failed pair gets a new
  epoch next time, as does every pair of a restarted prefill replica) and transport, and sends
  one ``TransferRequest`` with the pairs to prefill rank 0's control server.
* Prefill rank 0 (``TPSender``) claims the lease (acknowledging the Send), dispatches its
  workers' pairs, sends its own, and frees the blocks only once every rank has reported: a worker
  rank may still be reading them until then.
* Decode rank 0 dispatches its workers' receives, runs its own, and waits for every rank's
  report. The transfer succeeded only if every pair did on every rank; otherwise the request is
  recomputed (the decode worker's rule), after every rank has stopped writing its blocks.

Concurrency: a rank runs its pairs of one transfer at once, a thread each (prefill TP 1 to
decode TP 2 sends both halves together, as two links would carry them); each pair is its own
group, so no pair waits on another and there is no order to deadlock on. Every wait is bounded
by the request's deadline; a worker rank that died is noticed while its report is awaited.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from workers.protocol import KVHandle, KVLayout, PairTransfer, TransferAddress, TransferRequest, TransferStats
from workers.threads import one_torch_thread
from workers.transfer.buffers import check_block_ids, layout_of
from workers.transfer.client import KVTransferClient, RequestSend, transfer_tag
from workers.transfer.config import TransferConfig, Transport
from workers.transfer.device import resolve_transport
from workers.transfer.errors import KVCorruptError, KVTransferError
from workers.transfer.pair import acquire, remaining_s
from workers.transfer.server import KVTransferServer, SendResult
from workers.transfer.tp_plan import heads_of_rank, plan_tp_transfer

logger = logging.getLogger(__name__)

REPORT_GRACE_S = 5.0  # past the deadline, how long rank 0 waits for a rank's report
RANK_CALL_TIMEOUT_S = 60.0  # handing an op to the ranks waits for the step running now


def rank_worker_id(worker_id: str, rank: int) -> str:
    """The pair-group identity of one rank of a replica (its slots and store keys)."""
    return f"{worker_id}/r{rank}"


def model_layout(local: KVLayout, num_kv_heads: int) -> KVLayout:
    """The whole model's layout (every KV head) of one rank's ``local`` layout: what KVHandles
    and TransferRequests carry, and what the two sides compare."""
    return dataclasses.replace(local, num_kv_heads=num_kv_heads)


# --------------------------------------------------------------- rank 0 <-> ranks 1..N-1
@dataclass(frozen=True, slots=True)
class RankPair:
    """One pair of a transfer as one rank runs it: the peer rank, where to find it (decode side:
    the prefill rank's store; prefill side: the decode rank's worker id), the pair's epoch and
    transport, and this rank's local KV heads ``[head_start, head_stop)`` it moves."""

    peer_rank: int
    peer_worker_id: str
    epoch: int
    transport: str
    head_start: int
    head_stop: int
    peer: TransferAddress | None = None  # decode side only


@dataclass(frozen=True, slots=True)
class RankOp:
    """What rank 0 asks its worker ranks to do. ``open``: start a transfer agent (prefill: a
    rendezvous store) with these settings; ``send``/``recv``: move ``block_ids`` over each rank's
    ``pairs`` within ``timeout_s``."""

    kind: str  # "open" | "send" | "recv"
    pairs: dict[int, tuple[RankPair, ...]] = field(default_factory=dict)  # rank -> its pairs
    request_id: str = ""
    tag: int = 0
    block_ids: tuple[int, ...] = ()
    timeout_s: float = 0.0
    checksum: bool = True  # send/recv: block checksums follow the blocks (workers/transfer/checksum.py)
    # open
    role: str = ""
    worker_id: str = ""
    transport: str = "auto"
    host: str = "127.0.0.1"
    node_id: str = ""
    connect_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    generation: int = 0

    def ranks(self, world_size: int) -> list[int]:
        """The worker ranks that act on this op (and report)."""
        if self.kind == "open":
            return list(range(1, world_size))
        return sorted(r for r in self.pairs if r > 0)


@dataclass(frozen=True, slots=True)
class RankReport:
    """A worker rank's answer to a ``RankOp``: bytes moved, pairs created, the peer ranks whose
    pair failed (with the first error), and (``open``) the rank's own address."""

    ok: bool
    num_bytes: int = 0
    created: bool = False
    failed_peers: tuple[int, ...] = ()
    error: str = ""
    address: TransferAddress | None = None
    corrupt: bool = False  # a failed pair's blocks arrived with other checksums than were sent


Dispatch = Callable[[RankOp], int]  # rank 0: write the op, broadcast it; its sequence number
Collect = Callable[[int, Sequence[int], float], dict[int, RankReport]]  # seq, ranks, timeout_s


def rank_channel(call_on_engine_thread: Callable, tp) -> tuple[Dispatch | None, Collect | None]:
    """A worker's way to its engine's worker ranks: ``dispatch`` runs on the engine thread (the
    control group's only user; ``EngineLoop.call_future``), ``collect`` on any. Both None for an
    engine of one rank (``tp``: its ``TensorParallelWorkers``, or None)."""
    if tp is None:
        return None, None

    def dispatch(op: RankOp) -> int:
        return call_on_engine_thread(lambda e: tp.dispatch(op)).result(RANK_CALL_TIMEOUT_S)

    return dispatch, tp.collect


def open_config(role: str, worker_id: str, config: TransferConfig, generation: int = 0) -> RankOp:
    return RankOp(
        kind="open",
        role=role,
        worker_id=worker_id,
        transport=config.transport.value,
        host=config.host,
        node_id=config.node_id,
        connect_timeout_s=config.connect_timeout_s,
        transfer_timeout_s=config.transfer_timeout_s,
        generation=generation,
    )


def run_pairs(
    pairs: Sequence[RankPair], move: Callable[[RankPair, float], tuple[int, bool]], deadline: float
) -> RankReport:
    """Run every pair of one rank at once (a thread each beyond the first, which runs here); a
    failed pair does not stop the others (their peers are waiting). ``move(pair, deadline)``
    returns (bytes, group created)."""
    ordered = sorted(pairs, key=lambda p: p.peer_rank)

    def attempt(pair: RankPair) -> tuple[int, bool] | Exception:
        try:
            return move(pair, deadline)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which decides
            return exc

    if len(ordered) > 1:
        with ThreadPoolExecutor(
            max_workers=len(ordered) - 1, thread_name_prefix="kv-pair", initializer=one_torch_thread
        ) as pool:
            others = [pool.submit(attempt, pair) for pair in ordered[1:]]
            outcomes = [attempt(ordered[0])] + [f.result() for f in others]
    else:
        outcomes = [attempt(pair) for pair in ordered]
    total, created, failed, first_error = 0, False, [], ""
    for pair, outcome in zip(ordered, outcomes):
        if isinstance(outcome, Exception):
            failed.append(pair.peer_rank)
            first_error = first_error or f"{type(outcome).__name__}: {outcome}"
        else:
            total += outcome[0]
            created |= outcome[1]
    corrupt = any(isinstance(outcome, KVCorruptError) for outcome in outcomes)
    return RankReport(not failed, total, created, tuple(failed), first_error, corrupt=corrupt)


class RankTransferAgent:
    """A worker rank's side of KV transfer (``role`` prefill: a ``KVTransferServer`` with its own
    rendezvous store; decode: a ``KVTransferClient``), built by an ``open`` op and running the
    ``send``/``recv`` ops rank 0 dispatches on a thread pool of its own."""

    def __init__(
        self, op: RankOp, rank: int, kv_caches: Sequence[torch.Tensor], device: torch.device, bind_host: str
    ) -> None:
        if op.role not in ("prefill", "decode"):
            raise ValueError(f"transfer agent role {op.role!r}: prefill or decode")
        # A Ray rank actor binds to its own node's address; a local subprocess shares rank 0's host.
        host = op.host if bind_host in ("127.0.0.1", "") else bind_host
        config = TransferConfig(
            transport=Transport(op.transport),
            host=host,
            node_id=op.node_id,
            connect_timeout_s=op.connect_timeout_s,
            transfer_timeout_s=op.transfer_timeout_s,
        )
        self.role, self.rank, self.kv_caches = op.role, rank, list(kv_caches)
        self.worker_id = rank_worker_id(op.worker_id, rank)
        self.server: KVTransferServer | None = None
        self.client: KVTransferClient | None = None
        if op.role == "prefill":
            self.server = KVTransferServer(self.worker_id, config, device)
            self.address = dataclasses.replace(self.server.address, generation=op.generation)
        else:
            self.client = KVTransferClient(self.worker_id, config, device)
            self.address = self.client.identity
        self._pool = ThreadPoolExecutor(
            max_workers=16, thread_name_prefix=f"kv-rank{rank}", initializer=one_torch_thread
        )

    def submit(self, op: RankOp, done: Callable[[RankReport], None]) -> None:
        """Run ``op`` on the agent's pool; ``done(report)`` gets its outcome (never raises)."""

        def work() -> None:
            try:
                report = self.run(op)
            except Exception as exc:  # noqa: BLE001 - becomes the report
                report = RankReport(False, error=f"{type(exc).__name__}: {exc}")
            done(report)

        self._pool.submit(work)

    def run(self, op: RankOp) -> RankReport:
        deadline = time.monotonic() + op.timeout_s
        pairs = op.pairs.get(self.rank, ())
        layout = layout_of(self.kv_caches)
        if op.kind == "send" and self.server is not None:
            server = self.server

            def send(pair: RankPair, deadline: float) -> tuple[int, bool]:
                request = TransferRequest(
                    op.request_id,
                    pair.peer_worker_id,
                    pair.epoch,
                    op.block_ids,
                    layout,
                    pair.transport,
                    op.tag,
                    checksum=op.checksum,
                )
                heads = range(pair.head_start, pair.head_stop)
                result = server.send(request, self.kv_caches, remaining_s(deadline), heads=heads)
                return result.stats.num_bytes, result.stats.created_pair

            return run_pairs(pairs, send, deadline)
        if op.kind == "recv" and self.client is not None:
            client = self.client

            def recv(pair: RankPair, deadline: float) -> tuple[int, bool]:
                if pair.peer is None:
                    raise ValueError(f"pair with prefill rank {pair.peer_rank} has no address")
                heads = range(pair.head_start, pair.head_stop)
                transport = Transport(pair.transport)
                return client.recv_pair(
                    pair.peer, pair.epoch, transport, self.kv_caches, op.block_ids, op.tag, deadline, heads, op.checksum
                )

            return run_pairs(pairs, recv, deadline)
        raise ValueError(f"a {self.role} rank's transfer agent cannot run a {op.kind!r} op")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
        if self.client is not None:
            self.client.close()


# ------------------------------------------------------------------ rank 0, prefill side
class TPSender:
    """Prefill rank 0's side of a transfer with ``pairs``: dispatch the worker ranks' sends, run
    rank 0's own over ``server`` (its ``KVTransferServer``), and return once every rank has
    reported, so the caller may free the blocks."""

    def __init__(
        self, server: KVTransferServer, tensor_parallel_size: int, dispatch: Dispatch | None, collect: Collect | None
    ) -> None:
        self.server = server
        self.tp = tensor_parallel_size
        self._dispatch, self._collect = dispatch, collect

    def send(self, request: TransferRequest, kv_caches: Sequence[torch.Tensor], timeout_s: float) -> SendResult:
        start = time.monotonic()
        deadline = start + timeout_s
        local = layout_of(kv_caches)
        check_block_ids(request.src_block_ids, kv_caches[0].shape[1], "src_block_ids")
        by_rank: dict[int, list[RankPair]] = {}
        for pair in request.pairs:
            if not 0 <= pair.prefill_rank < self.tp:
                raise ValueError(f"pair names prefill rank {pair.prefill_rank}; this replica has {self.tp} rank(s)")
            if pair.head_stop > local.num_kv_heads:
                raise ValueError(
                    f"pair asks prefill rank {pair.prefill_rank} for local heads [{pair.head_start}, "
                    f"{pair.head_stop}); each rank holds {local.num_kv_heads}"
                )
            by_rank.setdefault(pair.prefill_rank, []).append(
                RankPair(
                    pair.decode_rank,
                    rank_worker_id(request.decode_worker_id, pair.decode_rank),
                    pair.epoch,
                    pair.transport,
                    pair.head_start,
                    pair.head_stop,
                )
            )
        workers = {r: tuple(p) for r, p in by_rank.items() if r > 0}
        seq = None
        if workers:
            if self._dispatch is None:
                raise ValueError("pairs name worker ranks but this prefill replica has one rank")
            op = RankOp(
                "send",
                workers,
                request.request_id,
                request.tag,
                request.src_block_ids,
                remaining_s(deadline),
                checksum=request.checksum,
            )
            seq = self._dispatch(op)

        def send(pair: RankPair, deadline: float) -> tuple[int, bool]:
            one = TransferRequest(
                request.request_id,
                pair.peer_worker_id,
                pair.epoch,
                request.src_block_ids,
                local,
                pair.transport,
                request.tag,
                checksum=request.checksum,
            )
            result = self.server.send(
                one, kv_caches, remaining_s(deadline), heads=range(pair.head_start, pair.head_stop)
            )
            return result.stats.num_bytes, result.stats.created_pair

        reports = {0: run_pairs(by_rank.get(0, ()), send, deadline)} if 0 in by_rank else {}
        if seq is not None and self._collect is not None:
            reports |= self._collect(seq, sorted(workers), max(0.0, deadline - time.monotonic()) + REPORT_GRACE_S)
        failed = {r: rep for r, rep in reports.items() if not rep.ok}
        missing = sorted(set(by_rank) - set(reports))
        if failed or missing:
            parts = [f"prefill rank {r}: {rep.error}" for r, rep in sorted(failed.items())]
            parts += [f"prefill rank {r}: no report" for r in missing]
            raise KVTransferError(
                f"sending {request.request_id} failed on {'; '.join(parts)}",
                peer_id=request.decode_worker_id,
                request_id=request.request_id,
            )
        nbytes = sum(rep.num_bytes for rep in reports.values())
        stats = TransferStats(
            request.request_id,
            request.decode_worker_id,
            request.pairs[0].transport,
            request.pairs[0].epoch,
            len(request.src_block_ids),
            nbytes,
            time.monotonic() - start,
            any(rep.created for rep in reports.values()),
            tuple(reports[r].num_bytes if r in reports else 0 for r in range(self.tp)),
        )
        return SendResult(stats)


# ------------------------------------------------------------------- rank 0, decode side
class PairEpochs:
    """Decode rank 0's epoch for each (prefill replica, prefill rank, decode rank) pair: reused
    while the pair's group lives, new after the pair failed or the prefill replica restarted (a
    new generation). Epochs count up from the wall clock, as ``KVTransferClient``'s do."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = itertools.count(time.time_ns() // 1000)
        self._live: dict[tuple[str, int, int], tuple[int, int]] = {}  # key -> (epoch, generation)

    def get(self, prefill_worker_id: str, generation: int, prefill_rank: int, decode_rank: int) -> int:
        key = (prefill_worker_id, prefill_rank, decode_rank)
        with self._lock:
            live = self._live.get(key)
            if live is not None and live[1] == generation:
                return live[0]
            epoch = next(self._next)
            self._live[key] = (epoch, generation)
            return epoch

    def spoil(self, prefill_worker_id: str, prefill_rank: int, decode_rank: int) -> None:
        with self._lock:
            self._live.pop((prefill_worker_id, prefill_rank, decode_rank), None)

    def forget(self, prefill_worker_id: str) -> None:
        with self._lock:
            for key in [k for k in self._live if k[0] == prefill_worker_id]:
                del self._live[key]


class TPPuller:
    """Decode rank 0's side of a transfer to or from a tensor-parallel replica: plan the pairs,
    send the Send, dispatch the worker ranks' receives, run rank 0's own, and return once every
    rank has reported (raising KVTransferError if any pair failed: the caller recomputes)."""

    def __init__(
        self,
        worker_id: str,
        config: TransferConfig,
        device: torch.device,
        num_kv_heads: int,
        tensor_parallel_size: int,
        dispatch: Dispatch | None,
        collect: Collect | None,
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.num_kv_heads = num_kv_heads
        self.tp = tensor_parallel_size
        self.client = KVTransferClient(rank_worker_id(worker_id, 0), config, device)
        self.identities: list[TransferAddress] = [self.client.identity]  # index = rank; ``open`` adds the rest
        self._dispatch, self._collect = dispatch, collect
        self.epochs = PairEpochs()
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def _lock(self, prefill_worker_id: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(prefill_worker_id, threading.Lock())

    def pull(
        self,
        handle: KVHandle,
        kv_caches: Sequence[torch.Tensor],
        dst_block_ids: Sequence[int],
        request_send: RequestSend,
        *,
        src_block_ids: Sequence[int],
        timeout_s: float,
    ) -> TransferStats:
        start = time.monotonic()
        deadline = start + timeout_s
        src, dst = tuple(src_block_ids), tuple(dst_block_ids)
        self.client.validate(handle, kv_caches, src, dst, num_kv_heads=self.num_kv_heads)
        peer = handle.prefill_worker_id
        if handle.lease_expires_at < time.time():
            raise KVTransferError(
                f"lease on {handle.request_id} at {peer} has expired", peer_id=peer, request_id=handle.request_id
            )
        try:
            return self._pull(handle, kv_caches, src, dst, request_send, deadline, start)
        except (KVTransferError, ValueError):
            raise
        except Exception as exc:  # a failed dispatch, a dead rank: the caller recomputes
            raise KVTransferError(
                f"pulling {handle.request_id} from {handle.prefill_worker_id} failed: {exc}",
                peer_id=handle.prefill_worker_id,
                request_id=handle.request_id,
            ) from exc

    def _pull(self, handle, kv_caches, src, dst, request_send, deadline: float, start: float) -> TransferStats:
        peer = handle.prefill_worker_id
        p = handle.tensor_parallel_size
        addresses = handle.rank_addresses or (handle.address,)
        plan = plan_tp_transfer(self.num_kv_heads, p, self.tp)
        tag = transfer_tag(handle.request_id)
        lock = self._lock(peer)
        if not acquire(lock, deadline):
            raise KVTransferError(
                f"pair with {peer} stayed busy past the deadline", peer_id=peer, request_id=handle.request_id
            )
        try:
            pairs: list[PairTransfer] = []
            receives: dict[int, list[RankPair]] = {}
            for s in plan.slices:
                i, j = s.prefill_rank, s.decode_rank
                transport = resolve_transport(self.config.transport, self.identities[j], addresses[i])
                if transport is Transport.OBJECT_STORE:
                    raise ValueError("transport 'object_store' does not move KV between tensor-parallel replicas")
                epoch = self.epochs.get(peer, handle.address.generation, i, j)
                pairs.append(PairTransfer(i, j, epoch, transport.value, s.src.start, s.src.stop))
                receives.setdefault(j, []).append(
                    RankPair(i, addresses[i].worker_id, epoch, transport.value, s.dst.start, s.dst.stop, addresses[i])
                )
            request = TransferRequest(
                handle.request_id,
                self.worker_id,
                pairs[0].epoch,
                src,
                handle.layout,
                pairs[0].transport,
                tag,
                tuple(pairs),
                checksum=self.client.config.checksum,
            )
            request_send(request)  # acknowledged: the lease is claimed and every prefill rank is sending
            workers = {j: tuple(r) for j, r in receives.items() if j > 0}
            seq = None
            if workers:
                if self._dispatch is None:
                    raise ValueError("the plan names decode worker ranks but this replica has one rank")
                seq = self._dispatch(
                    RankOp(
                        "recv",
                        workers,
                        handle.request_id,
                        tag,
                        dst,
                        remaining_s(deadline),
                        checksum=request.checksum,
                    )
                )

            def recv(pair: RankPair, deadline: float) -> tuple[int, bool]:
                assert pair.peer is not None
                heads = range(pair.head_start, pair.head_stop)
                return self.client.recv_pair(
                    pair.peer,
                    pair.epoch,
                    Transport(pair.transport),
                    kv_caches,
                    dst,
                    tag,
                    deadline,
                    heads,
                    request.checksum,
                )

            reports = {0: run_pairs(receives.get(0, ()), recv, deadline)} if 0 in receives else {}
            if seq is not None and self._collect is not None:
                reports |= self._collect(seq, sorted(workers), max(0.0, deadline - time.monotonic()) + REPORT_GRACE_S)
        finally:
            lock.release()
        failures, corrupt = [], False
        for j in sorted(receives):
            report = reports.get(j)
            if report is None:
                failures.append(f"decode rank {j}: no report")
                for pair in receives[j]:
                    self.epochs.spoil(peer, pair.peer_rank, j)
            elif not report.ok:
                failures.append(f"decode rank {j}: {report.error}")
                corrupt |= report.corrupt
                for i in report.failed_peers:
                    self.epochs.spoil(peer, i, j)
        if failures:
            raise (KVCorruptError if corrupt else KVTransferError)(
                f"pulling {handle.request_id} from {peer} failed on {'; '.join(failures)}",
                peer_id=peer,
                request_id=handle.request_id,
            )
        rank_bytes = tuple(reports[j].num_bytes if j in reports else 0 for j in range(self.tp))
        return TransferStats(
            handle.request_id,
            peer,
            pairs[0].transport,
            pairs[0].epoch,
            len(src),
            sum(rank_bytes),
            time.monotonic() - start,
            any(r.created for r in reports.values()),
            rank_bytes,
        )

    def close(self) -> None:
        self.client.close()


__all__ = [
    "PairEpochs",
    "RankOp",
    "RankPair",
    "RankReport",
    "RankTransferAgent",
    "TPPuller",
    "TPSender",
    "heads_of_rank",
    "model_layout",
    "open_config",
    "rank_channel",
    "rank_worker_id",
    "run_pairs",
]
