"""The application's worker directory: where each worker replica's KV control server listens.

One small Ray actor per application (named ``pdserve-workers:<app>``, no CPU, on the head node,
where the GCS is: a worker host whose link goes down must not take the directory with it),
created by the first ingress replica that starts, and again by a status reader (in an ingress
replica or the pd autoscaler) that finds it gone. Every worker replica
registers its control address there when it starts and re-registers every
``HEARTBEAT_S`` (which also refills a directory that was recreated); it leaves when it stops.
An entry not refreshed for ``EXPIRE_S`` is dropped.

The cluster status and the autoscaler look replicas up here and then ask each one for its
figures directly (``ControlClient.stats``, with a deadline): no call goes through a Serve handle,
so a status read never takes a slot of a replica's ``max_ongoing_requests``, and it works the
same while Redis (the prefix index) is down. A replica Serve lists that is not in the directory
yet is shown as starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import ray
from ray.actor import ActorHandle

from workers.protocol import TransferAddress

logger = logging.getLogger("pdserve")

NAMESPACE = "pdserve"
HEARTBEAT_S = 2.0
FIRST_REGISTRATION_RETRY_S = 0.1  # until a replica's first registration lands (the ingress may start later)
HEAD_NODE = "node:__internal_head__"  # the resource every Ray head node has
EXPIRE_S = 10.0
CALL_TIMEOUT_S = 5.0


def directory_name(app_name: str) -> str:
    return f"pdserve-workers:{app_name}"


@ray.remote(num_cpus=0)
class WorkerDirectory:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[float, TransferAddress]] = {}

    def register(self, deployment: str, address: TransferAddress) -> None:
        self._entries[(deployment, address.worker_id)] = (time.monotonic(), address)

    def leave(self, deployment: str, worker_id: str) -> None:
        self._entries.pop((deployment, worker_id), None)

    def lookup(self, deployment: str) -> dict[str, TransferAddress]:
        now = time.monotonic()
        for key in [k for k, (t, _) in self._entries.items() if now - t > EXPIRE_S]:
            del self._entries[key]
        return {wid: address for (dep, wid), (_, address) in self._entries.items() if dep == deployment}


def get_or_create(app_name: str) -> ActorHandle:
    """The application's directory, created if it does not exist (the ingress's call). Blocking."""
    # An ActorClass: mypy keeps a decorated class's own type (python/mypy#3135).
    directory = WorkerDirectory.options(  # type: ignore[attr-defined]
        name=directory_name(app_name), namespace=NAMESPACE, get_if_exists=True, resources={HEAD_NODE: 0.001}
    )
    return directory.remote()


def find(app_name: str) -> ActorHandle | None:
    """The application's directory, or None while no ingress has created it. Blocking."""
    try:
        return ray.get_actor(directory_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return None


class Registration:
    """A worker replica's entry, kept fresh by a heartbeat task on the replica's event loop."""

    def __init__(self, app_name: str, deployment: str, address: TransferAddress) -> None:
        self.app_name, self.deployment, self.address = app_name, deployment, address
        self._directory: ActorHandle | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        registered = False
        while True:
            try:
                if self._directory is None:
                    self._directory = await asyncio.to_thread(find, self.app_name)
                if self._directory is not None:
                    await asyncio.wait_for(
                        self._directory.register.remote(self.deployment, self.address), CALL_TIMEOUT_S
                    )
                    registered = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the directory was replaced: look it up again
                logger.debug("worker %s: registering in the directory failed: %s", self.address.worker_id, exc)
                self._directory = None
            # Until the first registration lands the replica is invisible to the status: a replica
            # that started before the ingress had created the directory looked again only 2 s
            # later, and a status read right after the application was ready missed it.
            await asyncio.sleep(HEARTBEAT_S if registered else FIRST_REGISTRATION_RETRY_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._directory is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._directory.leave.remote(self.deployment, self.address.worker_id), CALL_TIMEOUT_S
                )


class DirectoryGone(Exception):
    """The directory's actor is dead: look it up (or make it) again."""


async def lookup(directory, deployment: str) -> dict[str, TransferAddress] | None:
    """``deployment``'s registered workers, or None when the directory did not answer (a
    timeout: a directory just made may still be starting its process). Raises
    ``DirectoryGone`` only when its actor is dead.

    A caller keeps its handle on None: the directory is a named actor that lives as long as its
    creator's handle, so a creator that dropped its handle on a slow answer killed it. On a busy
    2-core machine a new directory's process took longer than the 5 s deadline to start; its
    creator dropped it, the next reader made another, and the pd autoscaler read no replica
    for the first 60 s of a benchmark run (23 directories made and killed in that minute)."""
    if directory is None:
        return None
    try:
        return await asyncio.wait_for(directory.lookup.remote(deployment), CALL_TIMEOUT_S)
    except ray.exceptions.ActorDiedError as exc:
        raise DirectoryGone(str(exc)[:200]) from exc
    except Exception as exc:  # noqa: BLE001 - shown as such by the caller
        logger.debug("worker directory lookup failed: %s", exc)
        return None
