"""Prefill side of KV transfer: hosts the rendezvous store and sends blocks to decode workers.

Protocol (the decode side, ``KVTransferClient``, drives it):
  * The decode worker picks the pair's epoch and sends a ``TransferRequest`` through the control
    plane; this side calls ``send(request, kv_caches)`` while the decode side calls ``pull``.
  * The group for ``(decode_worker_id, epoch)`` is reused while it lives. A newer epoch means the
    decode side tore its end down: this side tears down its old group and rendezvouses under the
    new epoch. An epoch at or below the newest one seen, with no live group, is refused at once
    (its store keys are spent); the decode side then starts a new epoch.
  * Rank 0 (here) posts the send, rank 1 posts the recv; either may post first, because both
    backends hold a point-to-point message until its match is posted. Every wait is bounded by
    the request's deadline and no wait depends on the other side finishing first, so a dead or
    stalled peer costs one deadline, never a hang.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from workers.protocol import TransferAddress, TransferRequest, TransferStats
from workers.transfer import object_store
from workers.transfer.buffers import check_block_ids, layout_of
from workers.transfer.config import TransferConfig, Transport
from workers.transfer.device import device_address
from workers.transfer.errors import KVTransferError
from workers.transfer.pair import PREFILL_RANK, PairGroup, PairSlot, PairSlots, acquire

logger = logging.getLogger(__name__)

_DEVICE_TYPE_OF = {Transport.GLOO: "cpu", Transport.GLOO_STAGED: "cuda", Transport.NCCL: "cuda"}


@dataclass(frozen=True)
class SendResult:
    """The outcome of ``send``; ``object_ref`` is the buffer's Ray ref for ``object_store``."""

    stats: TransferStats
    object_ref: Any = None


class KVTransferServer:
    """Sends KV blocks to any number of decode workers, one pair group per decode worker.

    Thread-safe: transfers to different decode workers run in parallel; transfers to one decode
    worker are serialized by that pair's lock. ``send``/``connect`` block until the decode side
    arrives or the deadline passes, so call them from a thread, never inside ``async def``.
    """

    def __init__(
        self, worker_id: str, config: TransferConfig | None = None, device: str | torch.device = "cpu"
    ) -> None:
        self.worker_id = worker_id
        self.config = config or TransferConfig()
        self.device = torch.device(device)
        # Hosted for the worker's life; decode workers find it through the KVHandle's address.
        self._store: dist.TCPStore | None = dist.TCPStore(
            self.config.host,
            self.config.port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.config.connect_timeout_s),
        )
        self.address: TransferAddress = device_address(
            self.config.host, self._store.port, worker_id, self.config.node_id, self.device
        )
        self._pairs = PairSlots()
        logger.info("KV transfer server %s listening on %s:%d", worker_id, self.config.host, self._store.port)

    def _slot(self, decode_worker_id: str) -> PairSlot:
        return self._pairs.get(decode_worker_id)

    def _group_for(
        self, slot: PairSlot, decode_worker_id: str, epoch: int, transport: Transport, deadline: float
    ) -> tuple[PairGroup, bool]:
        """The live group for ``epoch``, creating it if the epoch is new. Caller holds slot.lock."""
        group = slot.group
        if group is not None and group.epoch == epoch:
            if group.transport is not transport:
                raise ValueError(f"pair epoch {epoch} uses {group.transport.value}, request asks for {transport.value}")
            return group, False
        if epoch <= slot.last_epoch:
            raise KVTransferError(
                f"epoch {epoch} of decode worker {decode_worker_id} is spent (newest "
                f"{slot.last_epoch}); the decode side must start a new epoch",
                peer_id=decode_worker_id,
            )
        slot.tear_down(f"decode worker {decode_worker_id} started epoch {epoch}")
        slot.last_epoch = epoch
        group = PairGroup.create(
            store_host=self.config.host,
            store_port=self.address.port,
            bind_host=self.config.host,
            peer_id=decode_worker_id,
            decode_worker_id=decode_worker_id,
            epoch=epoch,
            rank=PREFILL_RANK,
            transport=transport,
            device=self.device,
            deadline=deadline,
            buffer_cache_bytes=self.config.buffer_cache_bytes,
        )
        group.fault_corrupt_bytes = self.config.fault_corrupt_bytes
        slot.group = group
        logger.info(
            "pair group %s -> %s epoch %d created (%s)", self.worker_id, decode_worker_id, epoch, transport.value
        )
        return group, True

    def _check_device(self, transport: Transport, kv_caches: Sequence[torch.Tensor]) -> None:
        actual = kv_caches[0].device
        if actual.type != self.device.type:
            raise ValueError(f"kv_caches are on {actual} but this server was built for {self.device}")
        wanted = _DEVICE_TYPE_OF.get(transport)
        if wanted is not None and wanted != actual.type:
            raise ValueError(f"transport {transport.value} moves {wanted} tensors; KV cache is on {actual}")

    def connect(
        self,
        decode_worker_id: str,
        epoch: int,
        transport: str | Transport = Transport.GLOO,
        timeout_s: float | None = None,
    ) -> None:
        """Create the pair group now; the decode side must be in ``KVTransferClient.connect``."""
        transport = Transport(transport)
        deadline = time.monotonic() + (timeout_s or self.config.connect_timeout_s)
        slot = self._slot(decode_worker_id)
        if not acquire(slot.lock, deadline):
            raise KVTransferError(
                f"pair with {decode_worker_id} stayed busy past the deadline", peer_id=decode_worker_id
            )
        try:
            self._group_for(slot, decode_worker_id, epoch, transport, deadline)
        except KVTransferError:
            raise
        except Exception as exc:
            slot.tear_down(f"connect failed: {exc}")
            raise KVTransferError(
                f"pair group with {decode_worker_id} epoch {epoch} failed: {exc}", peer_id=decode_worker_id
            ) from exc
        finally:
            slot.lock.release()

    def send(
        self,
        request: TransferRequest,
        kv_caches: Sequence[torch.Tensor],
        timeout_s: float | None = None,
        heads: range | None = None,
    ) -> SendResult:
        """Send ``request.src_block_ids`` of all layers to the decode worker, as one message
        (only local KV heads ``heads`` when given: one pair's share of a tensor-parallel
        transfer, ``workers/transfer/tp_transfer.py``).

        Raises ValueError for a bad request (nothing sent, pair kept) and KVTransferError when
        the transfer fails or misses its deadline (pair torn down).
        """
        start = time.monotonic()
        deadline = start + (timeout_s or self.config.transfer_timeout_s)
        transport = Transport(request.transport)
        peer = request.decode_worker_id
        layout = layout_of(kv_caches)
        layout.check_matches(request.layout, ours="prefill", theirs="decode")
        check_block_ids(request.src_block_ids, kv_caches[0].shape[1], "src_block_ids")
        self._check_device(transport, kv_caches)

        def stats(epoch: int, nbytes: int, created: bool) -> TransferStats:
            return TransferStats(
                request.request_id,
                peer,
                transport.value,
                epoch,
                len(request.src_block_ids),
                nbytes,
                time.monotonic() - start,
                created,
            )

        if transport is Transport.OBJECT_STORE:
            ref = object_store.put_blocks(kv_caches, request.src_block_ids, layout)
            return SendResult(stats(0, layout.bytes_per_block * len(request.src_block_ids), False), ref)

        slot = self._slot(peer)
        if not acquire(slot.lock, deadline):
            raise KVTransferError(
                f"pair with {peer} stayed busy past the deadline", peer_id=peer, request_id=request.request_id
            )
        try:
            group, created = self._group_for(slot, peer, request.epoch, transport, deadline)
            nbytes = group.send(
                kv_caches, request.src_block_ids, layout, request.tag, deadline, heads=heads, checksum=request.checksum
            )
            return SendResult(stats(request.epoch, nbytes, created))
        except KVTransferError:
            raise
        except Exception as exc:
            slot.tear_down(f"send of {request.request_id} failed")
            logger.warning(
                "KV send %s -> %s failed after %.2fs: %s", request.request_id, peer, time.monotonic() - start, exc
            )
            raise KVTransferError(
                f"sending {request.request_id} to {peer} failed: {exc}", peer_id=peer, request_id=request.request_id
            ) from exc
        finally:
            slot.lock.release()

    def close_pair(self, decode_worker_id: str) -> None:
        """Tear down the group with a decode worker that left; a later request re-pairs."""
        self._pairs.close(decode_worker_id)

    def close(self) -> None:
        self._pairs.close_all("server closed")
        self._store = None
