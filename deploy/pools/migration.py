"""Moving a running request's decode streams to other decode replicas (``POST
/v1/cluster/migrate``, ``pdserve migrate``), in two phases as Llumnix does:

1. pre-copy: each stream's decode replica holds another reference to the stream's full blocks
   (``PreCopy`` on its control server) while the stream goes on decoding there; another decode
   replica (Serve-routed, the source ranked last) pulls them into its prefix cache
   (``DecodeServer.prefetch``) and publishes them to the index;
2. move: the source stops the stream between two steps (``Move``) and ends it with a hand-off;
   the ingress serving the stream continues it on the replica the decode router ranks first,
   the one holding its prefix now, which pulls only the blocks written since the pre-copy.

Phase 1 is best effort: if it fails, the move pulls every block. With ``recompute`` there is no
KV to move: the other replica computes prompt and tokens so far (what a tensor-parallel decode
replica does, and what a dead replica's streams get).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from deploy.api.openai_protocol import RequestError
from workers.protocol import GenerateRequest, KVHandle, TransferAddress, decode
from workers.transfer.control import ControlClient
from workers.transfer.errors import KVTransferError

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0
PREFETCH_TIMEOUT_S = 30.0  # a pre-copy that takes longer is abandoned: the move sends everything


class Mover:
    def __init__(
        self,
        control: ControlClient,
        decode_addresses: Callable[[], Any],
        decode,
        block_hashes: Callable[[Sequence[int], str | None], tuple[bytes, ...]],
    ) -> None:
        """``decode_addresses``: coroutine function returning each decode replica's control
        address by worker id; ``decode``: the decode pool's Serve handle."""
        self.control = control
        self.decode_addresses = decode_addresses
        self.decode = decode
        self.block_hashes = block_hashes
        self.precopied_blocks = 0  # blocks moved ahead of the moves (phase 1)

    async def move(self, request_id: str, recompute: bool = False) -> dict[str, list[str]]:
        """Move the decode streams ``request_id`` names; the ids moved, by source replica.
        RequestError 409 with fewer than two decode replicas, 404 when none decodes it now."""
        addresses: dict[str, TransferAddress] = await self.decode_addresses()
        if len(addresses) < 2:
            raise RequestError(
                f"{len(addresses)} decode replica(s) registered: a stream needs another to move to", "request_id", 409
            )

        async def one(worker_id: str, address: TransferAddress) -> list[str]:
            # per replica, so that one that does not answer delays no other's move
            if not recompute:
                await self._precopy(worker_id, address, request_id)
            try:
                return await self.control.move(address, request_id, CONTROL_TIMEOUT_S, recompute)
            except KVTransferError as exc:
                logger.warning("migrate %s: %s", request_id, exc)
                return []

        answers = await asyncio.gather(*(one(w, a) for w, a in addresses.items()))
        moved = {worker: ids for worker, ids in zip(addresses, answers, strict=True) if ids}
        if not moved:
            raise RequestError(
                f"request_id {request_id!r} is not decoding on any decode replica now", "request_id", 404
            )
        return moved

    async def _precopy(self, worker_id: str, address: TransferAddress, request_id: str) -> None:
        """Phase 1 for the streams of ``request_id`` on ``worker_id`` (none there: nothing)."""
        try:
            copies = await self.control.precopy(address, request_id, CONTROL_TIMEOUT_S)
        except KVTransferError as exc:
            logger.info("migrate %s: no pre-copy on %s (%s); the move sends every block", request_id, worker_id, exc)
            return
        for copy in copies:
            handle = decode(KVHandle, copy["handle"])
            tokens, salt = tuple(copy["token_ids"]), copy["cache_salt"]
            request = GenerateRequest(
                request_id=handle.request_id,
                prompt_token_ids=tokens,
                sampling={"max_tokens": 1},
                cache_salt=salt,
                block_hashes=self.block_hashes(tokens, salt),
                arrival_time=time.time(),
                avoid_workers=(worker_id,),
            )
            try:
                answer = await asyncio.wait_for(self.decode.prefetch.remote(request, handle), PREFETCH_TIMEOUT_S)
                self.precopied_blocks += answer["blocks"]
                logger.info(
                    "migrate %s: pre-copied %d blocks of %s from %s to %s",
                    request_id,
                    answer["blocks"],
                    copy["request_id"],
                    worker_id,
                    answer["worker_id"],
                )
            except Exception as exc:  # noqa: BLE001 - best effort: the move then sends everything
                logger.warning("migrate %s: pre-copy from %s failed: %s", request_id, worker_id, exc)
                with contextlib.suppress(KVTransferError):
                    await self.control.release(handle.address, handle.request_id, CONTROL_TIMEOUT_S)
