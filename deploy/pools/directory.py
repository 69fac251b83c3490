"""The application's worker directory: where each worker replica's KV control server listens.

The entries live in the GCS's key-value store (Ray's internal KV, namespace ``pdserve``, the
store Serve keeps its own checkpoints in), one key per replica,
``workers::<app>#<deployment>#<worker_id>``, holding the JSON of its ``TransferAddress`` and when
it last wrote it. The directory has no process of its own: an idle server has one Ray worker
fewer waking 100 times a second (Ray's signal check), and the GCS is on the head node, so a
worker host whose link goes down does not take the directory with it.

Every worker replica writes its entry when it starts (retrying every
``FIRST_REGISTRATION_RETRY_S`` until the GCS takes it), writes it again every ``REFRESH_S`` (an
entry removed by hand comes back), and deletes it when it stops. Serve's replica list (its
replica actors' names) says which replicas exist; a reader joins the two, so an entry left by
a replica that died without stopping is never used. A reader that finds such an entry (its
replica not in Serve's list) older than ``STALE_S`` deletes it.

The cluster status and the autoscaler look replicas up here and then ask each one for its
figures directly (``ControlClient.stats``, with a deadline): no call goes through a Serve handle,
so a status read never takes a slot of a replica's ``max_ongoing_requests``, and it works the
same while Redis (the prefix index) is down. A replica Serve lists that is not in the directory
yet is shown as starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from workers.protocol import TransferAddress

logger = logging.getLogger("pdserve")

NAMESPACE = b"pdserve"
REFRESH_S = 30.0
FIRST_REGISTRATION_RETRY_S = 0.1  # until a replica's first write lands (the status shows it from then on)
STALE_S = 60.0  # an entry of a replica Serve no longer lists, not written for this long, is deleted
CALL_TIMEOUT_S = 5.0


def key_prefix(app_name: str, deployment: str) -> bytes:
    """The keys of one deployment's entries start with this (``#`` separates, as in the names
    Serve gives replica actors)."""
    return f"workers::{app_name}#{deployment}#".encode()


def entry_key(app_name: str, deployment: str, worker_id: str) -> bytes:
    return key_prefix(app_name, deployment) + worker_id.encode()


@dataclass(frozen=True)
class Entry:
    address: TransferAddress
    written_at: float  # the writer's wall clock (time.time()) at its last write


def encode(address: TransferAddress, now: float) -> bytes:
    return json.dumps({"address": dataclasses.asdict(address), "written_at": now}).encode()


def decode(raw: bytes) -> Entry | None:
    """The entry, or None for a value this version cannot read (logged at debug)."""
    try:
        doc = json.loads(raw)
        return Entry(TransferAddress(**doc["address"]), float(doc["written_at"]))
    except (ValueError, TypeError, KeyError) as exc:
        logger.debug("worker directory: unreadable entry %r: %s", raw[:200], exc)
        return None


def _gcs():
    """This process's GCS client (a Ray worker's or driver's). Raises RuntimeError outside Ray."""
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    client = internal_kv_get_gcs_client()
    if client is None:
        raise RuntimeError("not connected to Ray: the worker directory lives in its GCS")
    return client


async def write(app_name: str, deployment: str, address: TransferAddress) -> None:
    value = encode(address, time.time())
    key = entry_key(app_name, deployment, address.worker_id)
    await _gcs().async_internal_kv_put(key, value, True, NAMESPACE, timeout=CALL_TIMEOUT_S)


async def forget(app_name: str, deployment: str, worker_ids: Iterable[str]) -> None:
    """Delete these replicas' entries (best effort: a failure is logged at debug)."""
    for worker_id in worker_ids:
        key = entry_key(app_name, deployment, worker_id)
        try:
            await _gcs().async_internal_kv_del(key, False, NAMESPACE, timeout=CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a reader finds it again and retries
            logger.debug("worker directory: deleting %s failed: %s", key, exc)


async def entries(app_name: str, deployment: str) -> dict[str, Entry] | None:
    """``deployment``'s entries by worker id, or None when the GCS did not answer in time."""
    prefix = key_prefix(app_name, deployment)
    try:
        gcs = _gcs()
        keys = await gcs.async_internal_kv_keys(prefix, NAMESPACE, timeout=CALL_TIMEOUT_S)
        if not keys:
            return {}
        values = await gcs.async_internal_kv_multi_get(list(keys), NAMESPACE, timeout=CALL_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - shown as "not readable" by the caller
        logger.debug("worker directory lookup failed: %s", exc)
        return None
    out = {}
    for key, raw in values.items():
        entry = decode(raw)
        if entry is not None:
            out[key[len(prefix) :].decode()] = entry
    return out


async def lookup(app_name: str, deployment: str) -> dict[str, TransferAddress] | None:
    """``deployment``'s registered control addresses by worker id, or None when the directory
    did not answer."""
    found = await entries(app_name, deployment)
    return None if found is None else {worker_id: e.address for worker_id, e in found.items()}


def stale(found: dict[str, Entry], live_ids: Iterable[str], now: float) -> list[str]:
    """Worker ids of entries whose replica is not in ``live_ids`` (Serve's list) and that were not
    written for ``STALE_S``: left by replicas that died without stopping."""
    live = set(live_ids)
    return sorted(w for w, e in found.items() if w not in live and now - e.written_at > STALE_S)


class Registration:
    """A worker replica's entry, written by a task on the replica's event loop."""

    def __init__(self, app_name: str, deployment: str, address: TransferAddress) -> None:
        self.app_name, self.deployment, self.address = app_name, deployment, address
        self._task: asyncio.Task | None = None
        self.written = 0  # writes that landed

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await write(self.app_name, self.deployment, self.address)
                self.written += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the GCS is briefly away: written again soon
                logger.debug("worker %s: writing its directory entry failed: %s", self.address.worker_id, exc)
            # Until the first write lands the replica is shown as starting: retried quickly.
            await asyncio.sleep(REFRESH_S if self.written else FIRST_REGISTRATION_RETRY_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await forget(self.app_name, self.deployment, [self.address.worker_id])
