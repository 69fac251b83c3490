"""A 2-rank process group between one prefill worker (rank 0) and one decode worker (rank 1).

Lifetime: a group is created by both sides at once (the constructor rendezvous blocks until the
peer arrives), used for any number of transfers, and torn down on the first failure: ``close()``
aborts it and it is never reused. The next transfer creates a new group under a new epoch, so its
store keys (``pair/{decode_worker_id}/{epoch}/...``) are fresh.

Locking: a group is used only under its ``PairSlot.lock``; the slot outlives the groups it holds.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workers.protocol import KVLayout
from workers.transfer import checksum as checksums
from workers.transfer.buffers import buffer_shape, gather_blocks, head_slice, scatter_blocks
from workers.transfer.config import Transport
from workers.transfer.errors import KVCorruptError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend  # what both process groups are

logger = logging.getLogger(__name__)

PREFILL_RANK = 0
DECODE_RANK = 1


def remaining_s(deadline: float) -> float:
    """Seconds left before a ``time.monotonic()`` deadline; TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def backend_of(transport: Transport) -> str:
    return "nccl" if transport is Transport.NCCL else "gloo"


def new_process_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    timeout: datetime.timedelta,
    bind_host: str | None = None,
    device: torch.device | None = None,
) -> C10dBackend:
    """A process group outside torch.distributed's global state (no ``init_process_group``: pair
    groups come and go while the worker lives), with its own timeout and, for gloo, its sockets
    bound to ``bind_host`` (the node's address: across hosts, never every interface).

    The one place that touches torch's private process-group options (``ProcessGroupGloo._Options``
    and its ``_timeout`` and ``_devices``; ``ProcessGroupNCCL.Options._timeout``): a torch that
    renames them fails here, loudly, and in ``tests/unit/test_process_group.py``. Blocks until
    every rank has called it with the same store (the rendezvous)."""
    try:
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            with torch.cuda.device(device):
                return dist.ProcessGroupNCCL(store, rank, world_size, options)
        if backend != "gloo":
            raise ValueError(f"backend {backend!r}: gloo or nccl")
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: not in torch's stubs
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host or "")]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    except AttributeError as exc:
        raise RuntimeError(
            f"torch {torch.__version__} changed the private process-group options pdserve uses "
            f"(workers/transfer/pair.py:new_process_group): {exc}"
        ) from exc


def abort_process_group(pg) -> None:
    """Abort a group made by ``new_process_group`` (pending ops fail, sockets close): ``abort``
    where the backend has it, else ``shutdown``; a broken group may refuse both, and is dropped
    anyway."""
    for method in ("abort", "shutdown"):
        fn = getattr(pg, method, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # noqa: BLE001 - see above
                continue


class PairGroup:
    """One live process group with one peer, plus the scratch buffers its transfers reuse."""

    def __init__(
        self,
        pg,
        store,
        *,
        peer_id: str,
        epoch: int,
        transport: Transport,
        rank: int,
        device: torch.device,
        buffer_cache_bytes: int,
    ) -> None:
        self.pg = pg
        self._store = store  # NCCL creates communicators lazily through it: keep it alive
        self.peer_id = peer_id
        self.epoch = epoch
        self.transport = transport
        self.rank = rank
        self.device = device
        self._buffer_cache_bytes = buffer_cache_bytes
        self._scratch: torch.Tensor | None = None
        self.closed = False
        self.fault_corrupt_bytes = 0  # tests only: TransferConfig.fault_corrupt_bytes

    @property
    def backend(self) -> str:
        return backend_of(self.transport)

    @classmethod
    def create(
        cls,
        *,
        store_host: str,
        store_port: int,
        bind_host: str,
        peer_id: str,
        decode_worker_id: str,
        epoch: int,
        rank: int,
        transport: Transport,
        device: torch.device,
        deadline: float,
        buffer_cache_bytes: int,
    ) -> PairGroup:
        """Rendezvous with the peer, which must be calling ``create`` with the other rank now."""
        # Each group gets its own store connection: a blocked rendezvous for one peer then cannot
        # hold up the store client that another pair's rendezvous is using.
        store = dist.TCPStore(
            store_host, store_port, is_master=False, timeout=_td(remaining_s(deadline)), wait_for_workers=False
        )
        prefixed = dist.PrefixStore(f"pair/{decode_worker_id}/{epoch}", store)
        if transport is Transport.NCCL:
            # On a timeout, abort the communicator but keep the worker alive (the default mode
            # kills the process); read by each ProcessGroupNCCL when it is constructed.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        pg = new_process_group(
            prefixed, rank, 2, backend_of(transport), _td(remaining_s(deadline)), bind_host=bind_host, device=device
        )
        group = cls(
            pg,
            store,
            peer_id=peer_id,
            epoch=epoch,
            transport=transport,
            rank=rank,
            device=device,
            buffer_cache_bytes=buffer_cache_bytes,
        )
        if transport is Transport.NCCL:
            group._warm_up_nccl(deadline)  # NCCL connects on first use: do it inside this deadline
        return group

    def _warm_up_nccl(self, deadline: float) -> None:
        with torch.cuda.device(self.device):
            probe = torch.zeros(1, device=self.device)
            if self.rank == PREFILL_RANK:
                self._wait(self.pg.send([probe], DECODE_RANK, 0), deadline)
            else:
                self._wait(self.pg.recv([probe], PREFILL_RANK, 0), deadline)
            torch.cuda.current_stream(self.device).synchronize()

    def _wait(self, work, deadline: float) -> None:
        work.wait(_td(remaining_s(deadline)))

    def _host_wire(self, layout: KVLayout, num_blocks: int, dtype: torch.dtype, checksum: bool) -> Wire:
        """A CPU wire buffer for one transfer; reused across transfers up to ``buffer_cache_bytes``."""
        nbytes = wire_bytes(layout, num_blocks, checksum)
        pinned = self.transport is Transport.GLOO_STAGED
        if nbytes > self._buffer_cache_bytes:
            return Wire(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned), layout, num_blocks, dtype, checksum)
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return Wire(self._scratch[:nbytes], layout, num_blocks, dtype, checksum)

    def _corrupt(self, wire: Wire) -> None:
        """Tests only: flip ``fault_corrupt_bytes`` random bytes of the blocks about to be sent."""
        if self.fault_corrupt_bytes > 0:
            data = wire.raw[: wire.data_bytes]
            where = torch.tensor(random.sample(range(data.numel()), min(self.fault_corrupt_bytes, data.numel())))
            data[where.to(data.device)] ^= 0x5A

    def send(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        layout: KVLayout,
        tag: int,
        deadline: float,
        heads: range | None = None,
        checksum: bool = True,
    ) -> int:
        """Gather ``block_ids`` of all layers (only local KV heads ``heads`` when given: a
        tensor-parallel peer's share) and send them as one message, each block's checksum after
        the blocks when ``checksum`` (and the layout has whole words); returns the blocks' bytes."""
        kv_caches, layout = head_slice(kv_caches, layout, heads)
        dtype = kv_caches[0].dtype
        checksum = checksum and checksums_fit(layout)
        if self.transport is Transport.GLOO:
            wire = self._host_wire(layout, len(block_ids), dtype, checksum)
            wire.fill(kv_caches, block_ids)
            self._corrupt(wire)
            self._wait(self.pg.send([wire.raw], DECODE_RANK, tag), deadline)
            return wire.data_bytes
        with torch.cuda.device(self.device):
            staged = Wire.empty(layout, len(block_ids), dtype, checksum, self.device)
            staged.fill(kv_caches, block_ids)  # checksums computed on the device, written after the blocks
            self._corrupt(staged)
            if self.transport is Transport.GLOO_STAGED:
                host = self._host_wire(layout, len(block_ids), dtype, checksum)
                host.raw.copy_(staged.raw, non_blocking=True)
                torch.cuda.current_stream(self.device).synchronize()
                self._wait(self.pg.send([host.raw], DECODE_RANK, tag), deadline)
            else:
                # ProcessGroupNCCL orders its stream after the current one (the gather) and
                # keeps ``staged`` alive until the send kernel is done.
                self._wait(self.pg.send([staged.raw], DECODE_RANK, tag), deadline)
                torch.cuda.current_stream(self.device).synchronize()
            return staged.data_bytes

    def recv(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        layout: KVLayout,
        tag: int,
        deadline: float,
        heads: range | None = None,
        checksum: bool = True,
    ) -> int:
        """Receive one message and scatter it into ``block_ids`` (into local KV heads ``heads``
        only when given); returns the blocks' bytes. With ``checksum`` (the sender was asked for
        it) each block's checksum is verified: ``KVCorruptError`` names the blocks that differ.

        Returns only once the blocks are written (device synchronized), so the caller may
        schedule them at once.
        """
        kv_caches, layout = head_slice(kv_caches, layout, heads)
        dtype = kv_caches[0].dtype
        checksum = checksum and checksums_fit(layout)
        if self.transport is Transport.GLOO:
            wire = self._host_wire(layout, len(block_ids), dtype, checksum)
            self._wait(self.pg.recv([wire.raw], PREFILL_RANK, tag), deadline)
            self._verify(wire, wire.drain(kv_caches, block_ids))
            return wire.data_bytes
        with torch.cuda.device(self.device):
            if self.transport is Transport.GLOO_STAGED:
                host = self._host_wire(layout, len(block_ids), dtype, checksum)
                self._wait(self.pg.recv([host.raw], PREFILL_RANK, tag), deadline)
                staged = Wire(host.raw.to(self.device, non_blocking=True), layout, len(block_ids), dtype, checksum)
            else:
                staged = Wire.empty(layout, len(block_ids), dtype, checksum, self.device)
                # wait() makes the current stream wait for the recv kernel, then the scatter.
                self._wait(self.pg.recv([staged.raw], PREFILL_RANK, tag), deadline)
            received = staged.drain(kv_caches, block_ids)
            torch.cuda.current_stream(self.device).synchronize()
            self._verify(staged, received)
            return staged.data_bytes

    def _verify(self, wire: Wire, received: torch.Tensor | None) -> None:
        if received is None or wire.sums is None:
            return
        bad = checksums.mismatched(received, wire.sums)
        if bad:
            raise KVCorruptError(
                f"{len(bad)} of {wire.num_blocks} blocks from {self.peer_id} arrived with another checksum "
                f"than was sent (positions {bad[:8]})",
                peer_id=self.peer_id,
                blocks=tuple(bad),
            )

    def close(self) -> None:
        """Abort the group (pending ops fail, sockets close) and drop its buffers; idempotent."""
        if self.closed:
            return
        self.closed = True
        abort_process_group(self.pg)
        self._scratch = None
        self._store = None


@dataclass
class PairSlot:
    """Per-peer state. ``lock`` serializes every transfer with this peer, across epochs.

    ``last_epoch`` is the newest epoch this side has created (or tried to create) a group for;
    an epoch is never used twice, since its store keys are already spent. ``peer_generation``
    is the peer's process generation the group was made with (decode side; 0: unknown): a
    KVHandle naming another one comes from a restarted peer, whose end of the group is gone.
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    group: PairGroup | None = None
    last_epoch: int = -1
    peer_generation: int = 0

    def tear_down(self, reason: str) -> None:
        if self.group is None:
            return
        group, self.group = self.group, None
        group.close()
        logger.info("pair group with %s epoch %d torn down: %s", group.peer_id, group.epoch, reason)


class PairSlots:
    """One ``PairSlot`` per peer, for either side of the pairs (server: decode peers, client:
    prefill peers). ``lock`` guards the table only, never a transfer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._slots: dict[str, PairSlot] = {}

    def get(self, peer_id: str) -> PairSlot:
        with self.lock:
            return self._slots.setdefault(peer_id, PairSlot())

    def close(self, peer_id: str, reason: str = "closed") -> None:
        """Tear down the group with a peer that left; a later transfer re-pairs."""
        slot = self.get(peer_id)
        with slot.lock:
            slot.tear_down(reason)

    def close_all(self, reason: str) -> None:
        with self.lock:
            slots = list(self._slots.values())
        for slot in slots:
            with slot.lock:
                slot.tear_down(reason)


def acquire(lock: threading.Lock, deadline: float) -> bool:
    try:
        return lock.acquire(timeout=remaining_s(deadline))
    except TimeoutError:
        return False


def checksums_fit(layout: KVLayout) -> bool:
    """Whether a block's chunks are whole 8-byte words (every real head size): the checksum's unit."""
    return layout.bytes_per_block % (2 * layout.num_layers * checksums.SUM_BYTES) == 0


def wire_bytes(layout: KVLayout, num_blocks: int, checksum: bool) -> int:
    return num_blocks * (layout.bytes_per_block + (checksums.SUM_BYTES if checksum else 0))


class Wire:
    """One transfer's message as bytes (``raw``, what the backend moves: fp8 KV too, which gloo
    has no type for): the blocks, ``data`` (``buffers.buffer_shape``), then with a checksum one
    int64 per block, ``sums``."""

    def __init__(self, raw: torch.Tensor, layout: KVLayout, num_blocks: int, dtype: torch.dtype, checksum: bool):
        self.raw = raw
        self.num_blocks = num_blocks
        self.data_bytes = layout.bytes_per_block * num_blocks
        self.data = raw[: self.data_bytes].view(dtype).view(buffer_shape(layout, num_blocks))
        self.sums = raw[self.data_bytes :].view(torch.int64) if checksum else None

    @classmethod
    def empty(cls, layout: KVLayout, num_blocks: int, dtype: torch.dtype, checksum: bool, device) -> Wire:
        raw = torch.empty(wire_bytes(layout, num_blocks, checksum), dtype=torch.uint8, device=device)
        return cls(raw, layout, num_blocks, dtype, checksum)

    def fill(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
        """Gather ``block_ids`` into the message, with their checksums."""
        if self.sums is None:
            gather_blocks(kv_caches, block_ids, self.data)
        else:
            self.sums.copy_(checksums.gather(kv_caches, block_ids, self.data))

    def drain(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor | None:
        """Scatter the message into ``block_ids``; the checksums of what arrived (None without)."""
        if self.sums is None:
            scatter_blocks(self.data, kv_caches, block_ids)
            return None
        return checksums.scatter(self.data, kv_caches, block_ids)
