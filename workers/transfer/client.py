"""Decode side of KV transfer: pulls a request's blocks from the prefill worker in its KVHandle.

The decode side paces each pair: it holds the pair's lock from dispatching the request to the
prefill side until its recv has completed, so at most one transfer per pair is in flight and
both sides see transfers in the same order. It also owns the epoch: a new group always gets a
new epoch (counting up from the wall clock in microseconds, so a restarted worker with the same
id never reuses spent store keys), and the epoch travels in the ``TransferRequest``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from workers.protocol import KVHandle, TransferAddress, TransferRequest, TransferStats
from workers.transfer import object_store
from workers.transfer.buffers import check_block_ids, layout_of, scatter_blocks
from workers.transfer.config import TransferConfig, Transport
from workers.transfer.device import device_address, resolve_transport
from workers.transfer.errors import KVCorruptError, KVTransferError
from workers.transfer.pair import DECODE_RANK, PairGroup, PairSlot, PairSlots, acquire

logger = logging.getLogger(__name__)

RequestSend = Callable[[TransferRequest], Any]
RequestConnect = Callable[[str, int, str], Any]


def transfer_tag(request_id: str) -> int:
    """The message tag both sides use for one request (non-negative int32)."""
    return zlib.crc32(request_id.encode()) & 0x7FFFFFFF


class KVTransferClient:
    """Pulls KV blocks from any number of prefill workers, one pair group per prefill worker.

    Thread-safe; ``pull``/``connect`` block up to their deadline, so call them from a thread,
    never inside ``async def``.
    """

    def __init__(
        self, worker_id: str, config: TransferConfig | None = None, device: str | torch.device = "cpu"
    ) -> None:
        self.worker_id = worker_id
        self.config = config or TransferConfig()
        self.device = torch.device(device)
        self.identity = device_address(self.config.host, 0, worker_id, self.config.node_id, self.device)
        self._pairs = PairSlots()
        self._epochs = itertools.count(time.time_ns() // 1000)

    def _slot(self, prefill_worker_id: str) -> PairSlot:
        return self._pairs.get(prefill_worker_id)

    def _next_epoch(self) -> int:
        with self._pairs.lock:
            return next(self._epochs)

    def _create_group(
        self, slot: PairSlot, address: TransferAddress, epoch: int, transport: Transport, deadline: float
    ) -> PairGroup:
        group = PairGroup.create(
            store_host=address.host,
            store_port=address.port,
            bind_host=self.config.host,
            peer_id=address.worker_id,
            decode_worker_id=self.worker_id,
            epoch=epoch,
            rank=DECODE_RANK,
            transport=transport,
            device=self.device,
            deadline=deadline,
            buffer_cache_bytes=self.config.buffer_cache_bytes,
        )
        slot.group = group
        slot.last_epoch = epoch
        logger.info(
            "pair group %s -> %s epoch %d created (%s)", address.worker_id, self.worker_id, epoch, transport.value
        )
        return group

    def connect(
        self, address: TransferAddress, request_connect: RequestConnect, timeout_s: float | None = None
    ) -> int | None:
        """Create the pair group with a prefill worker ahead of the first transfer.

        ``request_connect(decode_worker_id, epoch, transport)`` must make the prefill worker call
        ``KVTransferServer.connect`` with those arguments, without waiting for it to return.
        Returns the live epoch (None for the object store, which has no group).
        """
        transport = resolve_transport(self.config.transport, self.identity, address)
        if transport is Transport.OBJECT_STORE:
            return None
        deadline = time.monotonic() + (timeout_s or self.config.connect_timeout_s)
        slot = self._slot(address.worker_id)
        if not acquire(slot.lock, deadline):
            raise KVTransferError(
                f"pair with {address.worker_id} stayed busy past the deadline", peer_id=address.worker_id
            )
        try:
            if slot.group is not None and slot.group.transport is transport:
                return slot.group.epoch
            slot.tear_down("reconnecting")
            epoch = self._next_epoch()
            request_connect(self.worker_id, epoch, transport.value)
            return self._create_group(slot, address, epoch, transport, deadline).epoch
        except Exception as exc:
            slot.tear_down(f"connect failed: {exc}")
            raise KVTransferError(
                f"pair group with {address.worker_id} failed: {exc}", peer_id=address.worker_id
            ) from exc
        finally:
            slot.lock.release()

    def pull(
        self,
        handle: KVHandle,
        kv_caches: Sequence[torch.Tensor],
        dst_block_ids: Sequence[int],
        request_send: RequestSend,
        *,
        src_block_ids: Sequence[int] | None = None,
        timeout_s: float | None = None,
    ) -> TransferStats:
        """Copy ``src_block_ids`` (default: all of the handle's blocks) into ``dst_block_ids``.

        ``request_send(request)`` must dispatch ``KVTransferServer.send(request, ...)`` on the
        prefill worker named in the handle and return without waiting for it to finish (the send
        cannot finish before this side receives); pdserve's decode worker waits for the control
        server's acknowledgement (``workers/transfer/control.py``), and an exception it raises
        fails the pull before any receive is posted. Its return value is used only by ``object_store``:
        the sender's ``SendResult``, its ``object_ref``, or a Ray ref to either.

        Raises ValueError for bad arguments (checked before any traffic) and KVTransferError
        when the transfer fails or misses its deadline. On KVTransferError the destination
        blocks may be partly written; the caller still owns them and must free them.
        """
        start = time.monotonic()
        deadline = start + (timeout_s or self.config.transfer_timeout_s)
        src = tuple(handle.block_ids if src_block_ids is None else src_block_ids)
        dst = tuple(dst_block_ids)
        self.validate(handle, kv_caches, src, dst)
        peer = handle.prefill_worker_id
        if handle.lease_expires_at < time.time():
            raise KVTransferError(
                f"lease on {handle.request_id} at {peer} has expired", peer_id=peer, request_id=handle.request_id
            )
        transport = resolve_transport(self.config.transport, self.identity, handle.address)

        def request_for(epoch: int) -> TransferRequest:
            return TransferRequest(
                handle.request_id,
                self.worker_id,
                epoch,
                src,
                handle.layout,
                transport.value,
                transfer_tag(handle.request_id),
                checksum=self.config.checksum,
            )

        def stats(epoch: int, nbytes: int, created: bool) -> TransferStats:
            return TransferStats(
                handle.request_id, peer, transport.value, epoch, len(src), nbytes, time.monotonic() - start, created
            )

        if transport is Transport.OBJECT_STORE:
            return self._pull_object(handle, kv_caches, dst, request_send, request_for(0), deadline, stats)

        slot = self._slot(peer)
        if not acquire(slot.lock, deadline):
            raise KVTransferError(
                f"pair with {peer} stayed busy past the deadline", peer_id=peer, request_id=handle.request_id
            )
        try:
            group = slot.group
            if group is not None and group.transport is not transport:
                slot.tear_down(f"transport changed to {transport.value}")
                group = None
            if group is not None and handle.address.generation != slot.peer_generation:
                slot.tear_down(f"{peer} restarted (generation {handle.address.generation:x})")
                group = None
            epoch = group.epoch if group is not None else self._next_epoch()
            request = request_for(epoch)
            request_send(request)
            created = group is None
            if group is None:
                group = self._create_group(slot, handle.address, epoch, transport, deadline)
                slot.peer_generation = handle.address.generation
            nbytes = group.recv(kv_caches, dst, handle.layout, request.tag, deadline, checksum=request.checksum)
            return stats(epoch, nbytes, created)
        except Exception as exc:
            # A send the peer refused (its lease ended) never touched the group: keep it.
            if not getattr(exc, "refused", False):
                slot.tear_down(f"pull of {handle.request_id} failed")
            logger.warning(
                "KV pull %s <- %s failed after %.2fs: %s", handle.request_id, peer, time.monotonic() - start, exc
            )
            raise rewrap(exc, f"pulling {handle.request_id} from {peer} failed", peer, handle.request_id) from exc
        finally:
            slot.lock.release()

    def recv_pair(
        self,
        address: TransferAddress,
        epoch: int,
        transport: Transport,
        kv_caches: Sequence[torch.Tensor],
        dst_block_ids: Sequence[int],
        tag: int,
        deadline: float,
        heads: range | None = None,
        checksum: bool | None = None,
    ) -> tuple[int, bool]:
        """One pair's receive of a tensor-parallel transfer (``workers/transfer/tp_transfer.py``):
        the message of the prefill rank at ``address`` into ``dst_block_ids`` (its local KV heads
        ``heads``), over the pair group of ``epoch``, which the coordinating rank chose; a live
        group of another epoch is torn down first. Returns (bytes received, group created).
        The prefill rank must be sending now (its coordinator acknowledged the Send), with block
        checksums when ``checksum`` (default: this client's config). Raises KVTransferError (group
        torn down) on any failure, KVCorruptError where checksums differ."""
        peer = address.worker_id
        slot = self._slot(peer)
        if not acquire(slot.lock, deadline):
            raise KVTransferError(f"pair with {peer} stayed busy past the deadline", peer_id=peer)
        try:
            group = slot.group
            if group is not None and (group.epoch != epoch or group.transport is not transport):
                slot.tear_down(f"coordinator moved the pair to epoch {epoch}")
                group = None
            created = group is None
            if group is None:
                if epoch <= slot.last_epoch:  # its store keys are spent: a rendezvous would read stale ones
                    raise KVTransferError(
                        f"epoch {epoch} with {peer} is spent (newest {slot.last_epoch}, its group is gone); "
                        "the coordinator must pick a new one",
                        peer_id=peer,
                    )
                group = self._create_group(slot, address, epoch, transport, deadline)
            layout = layout_of(kv_caches)
            checksum = self.config.checksum if checksum is None else checksum
            return group.recv(kv_caches, dst_block_ids, layout, tag, deadline, heads=heads, checksum=checksum), created
        except Exception as exc:
            slot.tear_down(f"pair receive failed: {exc}")
            raise rewrap(exc, f"receiving from {peer} (epoch {epoch}) failed", peer) from exc
        finally:
            slot.lock.release()

    def _pull_object(self, handle, kv_caches, dst, request_send, request, deadline, stats):
        try:
            payload = request_send(request)
            buf = object_store.fetch_blocks(payload, handle.layout, len(dst), kv_caches[0].dtype, deadline)
            scatter_blocks(buf.to(kv_caches[0].device), kv_caches, dst)
            return stats(0, buf.nbytes, False)
        except Exception as exc:
            raise KVTransferError(
                f"object-store pull of {handle.request_id} failed: {exc}",
                peer_id=handle.prefill_worker_id,
                request_id=handle.request_id,
            ) from exc

    def validate(
        self,
        handle: KVHandle,
        kv_caches: Sequence[torch.Tensor],
        src: tuple[int, ...],
        dst: tuple[int, ...],
        num_kv_heads: int | None = None,
    ) -> None:
        """Refuse a pull before any traffic: a layout other than the handle's (compared as the
        whole model's, ``num_kv_heads`` of it, for a tensor-parallel replica's rank), another
        device, or block ids that do not fit."""
        ours = layout_of(kv_caches)
        if num_kv_heads is not None:
            ours = dataclasses.replace(ours, num_kv_heads=num_kv_heads)
        ours.check_matches(handle.layout)
        if kv_caches[0].device.type != self.device.type:
            raise ValueError(f"kv_caches are on {kv_caches[0].device} but this client was built for {self.device}")
        if len(src) != len(dst):
            raise ValueError(
                f"{len(src)} source blocks but {len(dst)} destination blocks: "
                "allocate one destination block per block pulled"
            )
        stray = sorted(set(src) - set(handle.block_ids))
        if stray:
            raise ValueError(f"src_block_ids {stray[:8]} are not in the KVHandle of {handle.request_id}")
        check_block_ids(dst, kv_caches[0].shape[1], "dst_block_ids", unique=True)

    def close_pair(self, prefill_worker_id: str) -> None:
        """Tear down the group with a prefill worker that left."""
        self._pairs.close(prefill_worker_id)

    def close(self) -> None:
        self._pairs.close_all("client closed")


def rewrap(exc: BaseException, what: str, peer: str, request_id: str = "") -> KVTransferError:
    """``exc`` as the transfer's one error type, with what failed; corruption stays corruption."""
    if isinstance(exc, KVCorruptError):
        return KVCorruptError(f"{what}: {exc}", peer_id=peer, request_id=request_id, blocks=exc.blocks)
    return KVTransferError(f"{what}: {exc}", peer_id=peer, request_id=request_id)
