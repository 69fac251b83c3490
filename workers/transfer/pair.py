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
import threading
import time
import zlib
from contextlib import nullcontext as _nullcontext
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from workers.protocol import KVLayout
from workers.transfer.buffers import (
    buffer_shape,
    chunk_plan,
    chunk_rows,
    chunk_source_view,
    gather_blocks,
    gather_chunk,
    scatter_blocks,
    scatter_chunk,
)
from workers.transfer.config import Transport

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


def chunk_tag(tag: int, index: int) -> int:
    """The message tag of chunk ``index`` of the request tagged ``tag`` (chunk 0 keeps ``tag``);
    distinct per chunk and, like the request tag, a non-negative int32."""
    if index == 0:
        return tag
    return zlib.crc32(f"{tag}/{index}".encode()) & 0x7FFFFFFF


_CHUNK_KEY = "transfer/chunk_bytes"


def backend_of(transport: Transport) -> str:
    return "nccl" if transport is Transport.NCCL else "gloo"


class PairGroup:
    """One live process group with one peer, plus the scratch buffers its transfers reuse.

    ``chunk_bytes`` is the pair's pipelining chunk size (see ``buffers.chunk_plan``): the decode
    side's configured value, handed to the prefill side through the rendezvous store when the
    group is created, so both ranks always cut a transfer the same way.
    """

    def __init__(self, pg, store, *, peer_id: str, epoch: int, transport: Transport, rank: int,
                 device: torch.device, buffer_cache_bytes: int, chunk_bytes: int) -> None:
        self.pg = pg
        self._store = store  # NCCL creates communicators lazily through it: keep it alive
        self.peer_id = peer_id
        self.epoch = epoch
        self.transport = transport
        self.rank = rank
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._buffer_cache_bytes = buffer_cache_bytes
        self._scratch: list[torch.Tensor | None] = [None, None]  # double buffer, per side
        self.closed = False

    @property
    def backend(self) -> str:
        return backend_of(self.transport)

    @classmethod
    def create(cls, *, store_host: str, store_port: int, bind_host: str, peer_id: str,
               decode_worker_id: str, epoch: int, rank: int, transport: Transport,
               device: torch.device, deadline: float, buffer_cache_bytes: int,
               chunk_bytes: int) -> PairGroup:
        """Rendezvous with the peer, which must be calling ``create`` with the other rank now."""
        # Each group gets its own store connection: a blocked rendezvous for one peer then cannot
        # hold up the store client that another pair's rendezvous is using.
        store = dist.TCPStore(store_host, store_port, is_master=False,
                              timeout=_td(remaining_s(deadline)), wait_for_workers=False)
        prefixed = dist.PrefixStore(f"pair/{decode_worker_id}/{epoch}", store)
        timeout = _td(remaining_s(deadline))
        if transport is Transport.NCCL:
            # On a timeout, abort the communicator but keep the worker alive (the default mode
            # kills the process); read by each ProcessGroupNCCL when it is constructed.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            with torch.cuda.device(device):
                pg = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            pg = dist.ProcessGroupGloo(prefixed, rank, 2, options)
        if rank == DECODE_RANK:
            prefixed.set(_CHUNK_KEY, str(chunk_bytes))
        else:
            store.set_timeout(_td(remaining_s(deadline)))
            chunk_bytes = int(prefixed.get(_CHUNK_KEY))
        group = cls(pg, store, peer_id=peer_id, epoch=epoch, transport=transport, rank=rank,
                    device=device, buffer_cache_bytes=buffer_cache_bytes, chunk_bytes=chunk_bytes)
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

    def _host_buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Flat CPU byte buffer ``slot`` (0 or 1) of at least ``nbytes``; kept and reused across
        transfers while both slots fit in ``buffer_cache_bytes``."""
        pinned = self.transport is Transport.GLOO_STAGED
        if 2 * nbytes > self._buffer_cache_bytes:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        buf = self._scratch[slot]
        if buf is None or buf.numel() < nbytes:
            self._scratch[slot] = None
            buf = self._scratch[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return buf[:nbytes]

    def _plan(self, layout: KVLayout, num_blocks: int):
        plan = chunk_plan(layout, num_blocks, self.chunk_bytes)
        row_bytes = layout.bytes_per_block // (2 * layout.num_layers)
        return plan, [chunk_rows(chunk) * row_bytes for chunk in plan]

    def send(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], layout: KVLayout,
             tag: int, deadline: float) -> int:
        """Send ``block_ids`` of all layers; returns bytes sent.

        gloo: chunk by chunk, double-buffered, so gathering chunk i+1 (a CPU copy, or a GPU
        gather and device-to-host copy for gloo_staged) overlaps the send of chunk i.
        NCCL: one message; see ``_send_nccl``.
        """
        if self.transport is Transport.NCCL:
            return self._send_nccl(kv_caches, block_ids, layout, tag, deadline)
        plan, sizes = self._plan(layout, len(block_ids))
        staged = self.transport is Transport.GLOO_STAGED
        works: list = [None, None]
        with torch.cuda.device(self.device) if staged else _nullcontext():
            index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
            for i, (chunk, nbytes) in enumerate(zip(plan, sizes)):
                slot = i % 2
                if works[slot] is not None:
                    self._wait(works[slot], deadline)  # its buffer is free again
                    works[slot] = None
                view = None if staged else chunk_source_view(kv_caches, block_ids, chunk)
                if view is not None:
                    payload = view  # consecutive source blocks: send straight from the cache
                else:
                    payload = self._host_buffer(slot, nbytes)
                    if staged:
                        on_gpu = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                        gather_chunk(kv_caches, block_ids, chunk, on_gpu, index)
                        payload.copy_(on_gpu, non_blocking=True)
                        torch.cuda.current_stream(self.device).synchronize()
                    else:
                        gather_chunk(kv_caches, block_ids, chunk, payload, index)
                works[slot] = self.pg.send([payload], DECODE_RANK, chunk_tag(tag, i))
            for work in works:
                if work is not None:
                    self._wait(work, deadline)
        return sum(sizes)

    def _send_nccl(self, kv_caches, block_ids, layout, tag, deadline) -> int:
        """One message. NCCL send/recv are kernels on NCCL's own stream, already asynchronous to
        the host, and the gather/scatter kernels run at device-memory bandwidth (far above any
        NVLink/PCIe/network link), so splitting would only add launches and cross-stream
        syncs; there is no host copy to hide, unlike gloo."""
        dtype = kv_caches[0].dtype
        with torch.cuda.device(self.device):
            staged = torch.empty(buffer_shape(layout, len(block_ids)), dtype=dtype, device=self.device)
            gather_blocks(kv_caches, block_ids, staged)
            # ProcessGroupNCCL orders its stream after the current one (the gather) and
            # keeps ``staged`` alive until the send kernel is done.
            self._wait(self.pg.send([staged], DECODE_RANK, tag), deadline)
            torch.cuda.current_stream(self.device).synchronize()
            return staged.nbytes

    def recv(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], layout: KVLayout,
             tag: int, deadline: float) -> int:
        """Receive the transfer and scatter it into ``block_ids``; returns bytes received.

        gloo: the recvs of chunks i and i+1 are posted ahead (one per buffer), so scattering
        chunk i overlaps the wire time of chunk i+1. Every chunk lands in a scratch buffer,
        never straight in the destination blocks: a recv still pending when the transfer fails
        must not be able to write into blocks the caller frees.

        Returns only once the blocks are written (device synchronized), so the caller may
        schedule them at once.
        """
        if self.transport is Transport.NCCL:
            return self._recv_nccl(kv_caches, block_ids, layout, tag, deadline)
        plan, sizes = self._plan(layout, len(block_ids))
        staged = self.transport is Transport.GLOO_STAGED
        works: list = [None, None]
        copied: list = [None, None]  # gloo_staged: the host-to-device copy out of each buffer

        def post(i: int) -> None:
            slot = i % 2
            if copied[slot] is not None:
                copied[slot].synchronize()  # the GPU has read this buffer: reuse it
                copied[slot] = None
            buf = self._host_buffer(slot, sizes[i])
            works[slot] = (self.pg.recv([buf], PREFILL_RANK, chunk_tag(tag, i)), buf)

        with torch.cuda.device(self.device) if staged else _nullcontext():
            index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
            for i in range(min(2, len(plan))):
                post(i)
            for i, chunk in enumerate(plan):
                slot = i % 2
                work, buf = works[slot]
                works[slot] = None
                self._wait(work, deadline)
                if staged:
                    on_gpu = buf.to(self.device, non_blocking=True)
                    scatter_chunk(on_gpu, kv_caches, block_ids, chunk, index)
                    copied[slot] = torch.cuda.Event()
                    copied[slot].record()
                else:
                    scatter_chunk(buf, kv_caches, block_ids, chunk, index)
                if i + 2 < len(plan):
                    post(i + 2)
            if staged:
                torch.cuda.current_stream(self.device).synchronize()
        return sum(sizes)

    def _recv_nccl(self, kv_caches, block_ids, layout, tag, deadline) -> int:
        dtype = kv_caches[0].dtype
        with torch.cuda.device(self.device):
            staged = torch.empty(buffer_shape(layout, len(block_ids)), dtype=dtype, device=self.device)
            # wait() makes the current stream wait for the recv kernel, then the scatter.
            self._wait(self.pg.recv([staged], PREFILL_RANK, tag), deadline)
            scatter_blocks(staged, kv_caches, block_ids)
            torch.cuda.current_stream(self.device).synchronize()
            return staged.nbytes

    def close(self) -> None:
        """Abort the group (pending ops fail, sockets close) and drop its buffers; idempotent."""
        if self.closed:
            return
        self.closed = True
        for method in ("abort", "shutdown"):
            fn = getattr(self.pg, method, None)
            if fn is not None:
                try:
                    fn()
                    break
                except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
                    continue
        self._scratch = [None, None]
        self._store = None


@dataclass
class PairSlot:
    """Per-peer state. ``lock`` serializes every transfer with this peer, across epochs.

    ``last_epoch`` is the newest epoch this side has created (or tried to create) a group for;
    an epoch is never used twice, since its store keys are already spent.
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    group: PairGroup | None = None
    last_epoch: int = -1

    def tear_down(self, reason: str) -> None:
        if self.group is None:
            return
        group, self.group = self.group, None
        group.close()
        logger.info("pair group with %s epoch %d torn down: %s", group.peer_id, group.epoch, reason)


def acquire(lock: threading.Lock, deadline: float) -> bool:
    try:
        return lock.acquire(timeout=remaining_s(deadline))
    except TimeoutError:
        return False
