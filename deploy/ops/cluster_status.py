"""The cluster's state as the ingress sees it: every replica of every pool (each asked for its
figures directly, at the control address it registered in the application's worker directory,
``deploy/pools/directory.py``; no Serve call), the Redis index, and the ingress's own request
figures. Backs ``GET /v1/cluster/status``, the dashboard and ``pdserve status``; what the
ingress's history samples (``deploy.ops.status_history``) comes from here too."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from deploy.ops.status_history import RESPONSES, StatusHistory
from deploy.pools import directory as worker_directory

logger = logging.getLogger("pdserve")

REPLICA_PREFIX = "SERVE_REPLICA::"


def replica_ids(app_name: str, deployment: str) -> list[str]:
    """Ids of the live replicas of one deployment (Serve names each replica actor
    ``SERVE_REPLICA::<app>#<deployment>#<id>``). Blocking: call from a thread."""
    prefix = f"{REPLICA_PREFIX}{app_name}#{deployment}#"
    ids = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if not name.startswith(prefix):
            continue
        ids.append(name[len(prefix) :])
    return sorted(ids)


class PoolReader:
    """Reads each live replica's figures: Serve's replica list (its replica actors' names), the
    directory's control addresses, one ``Stats`` call per replica with a deadline. A replica
    that does not answer is listed ``healthy: False`` with the reason. Entries the directory
    still holds for replicas Serve no longer lists are deleted once stale."""

    def __init__(self, app_name: str, control, timeout_s: float = 3.0) -> None:
        self.app_name = app_name
        self.control = control  # ControlClient
        self.timeout_s = timeout_s

    async def read(self, deployment: str) -> list[dict[str, Any]]:
        ids, found = await asyncio.gather(
            asyncio.to_thread(replica_ids, self.app_name, deployment),
            worker_directory.entries(self.app_name, deployment),
        )
        addresses = None if found is None else {w: e.address for w, e in found.items()}
        if found and (gone := worker_directory.stale(found, ids, time.time())):
            await worker_directory.forget(self.app_name, deployment, gone)

        async def one(replica_id: str) -> dict[str, Any]:
            address = (addresses or {}).get(replica_id)
            if address is None:
                why = (
                    "not registered in the worker directory yet (starting)"
                    if addresses is not None
                    else "the worker directory is not readable"
                )
                entry: dict[str, Any] = {"worker_id": replica_id, "healthy": False, "error": why}
                if addresses is not None:
                    entry["starting"] = True  # Serve has it, the directory not yet: a change landing
                return entry
            try:
                return {"healthy": True, **await self.control.stats(address, self.timeout_s)}
            except Exception as exc:  # noqa: BLE001 - a replica that cannot answer is shown as such
                return {"worker_id": replica_id, "healthy": False, "error": f"{type(exc).__name__}: {exc}"[:200]}

        return list(await asyncio.gather(*(one(i) for i in ids)))

    async def addresses(self, deployment: str) -> dict:
        """Each registered replica's control address in ``deployment`` (empty when the worker
        directory is not readable)."""
        return await worker_directory.lookup(self.app_name, deployment) or {}

    async def live_addresses(self, deployment: str) -> dict:
        """``addresses`` of the replicas Serve runs now (an entry of a replica just killed lives
        in the directory until it goes stale)."""
        ids, found = await asyncio.gather(
            asyncio.to_thread(replica_ids, self.app_name, deployment), self.addresses(deployment)
        )
        return {worker: address for worker, address in found.items() if worker in set(ids)}

    async def read_all(self, names: list[str]) -> dict[str, list[dict[str, Any]]]:
        return dict(zip(names, await asyncio.gather(*(self.read(n) for n in names))))


async def index_status(index) -> dict[str, Any]:
    if index is None:
        return {"configured": False}
    workers = await index.live_workers()
    if workers is None:
        return {"configured": True, "healthy": False, "live_workers": None}
    return {
        "configured": True,
        "healthy": True,
        "live_workers": len(workers),
        "workers": {
            wid: {
                "role": rec.role,
                "free_blocks": rec.free_blocks,
                "total_blocks": rec.total_blocks,
                "num_running": rec.num_running,
                "num_waiting": rec.num_waiting,
            }
            for wid, rec in workers.items()
        },
    }


async def autoscaling_status(autoscaler, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The pd autoscaler's state (``deploy/pools/autoscaler.py``: targets, last signals, recent
    changes, the targets' timeline); None without ``autoscaling: pd``."""
    if autoscaler is None:
        return None
    try:
        return await asyncio.wait_for(autoscaler.status.remote(), timeout_s)
    except Exception as exc:  # noqa: BLE001 - shown as such; the pools' figures still answer
        return {"policy": "pd", "error": f"autoscaler not reachable: {type(exc).__name__}: {exc}"[:200]}


# ------------------------------------------------------------------ figures the dashboard adds
def pair_table(pools: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (prefill replica, decode replica) pair that moved KV or tried to, merged from
    the decode replicas' per-peer counters (each pair lives on exactly one decode replica).
    ``prefill_live``: the prefill replica is among the healthy ones now."""
    live = {r["worker_id"] for r in pools.get("prefill") or [] if r.get("healthy")}
    rows = []
    for r in pools.get("decode") or []:
        if not r.get("healthy"):
            continue
        for prefill_id, pair in (r.get("pairs") or {}).items():
            rows.append({"prefill": prefill_id, "decode": r["worker_id"], "prefill_live": prefill_id in live, **pair})
    return sorted(rows, key=lambda row: (row["prefill"], row["decode"]))


def _with_aborted(requests: dict[str, Any], stats) -> dict[str, Any]:
    """Client disconnects, where the request figures count them apart from failures."""
    aborted = getattr(stats, "aborted", None)
    if "aborted" not in requests and isinstance(aborted, int):
        requests["aborted"] = aborted
    return requests


async def sample_status(ingress) -> dict[str, Any]:
    """What the history keeps of the cluster: the ingress's figures and every pool's replicas."""
    names = [name for name, handle in ingress.pools.items() if handle is not None]
    pools = await ingress.pool_reader.read_all(names)
    requests = _with_aborted(ingress.stats.snapshot(), ingress.stats)
    return {"time": time.time(), "requests": requests, "http": RESPONSES.snapshot(), "pools": pools}


def extend_status(status: dict[str, Any], ingress) -> dict[str, Any]:
    """The status endpoint's dict plus the pair table, completion responses by HTTP status and
    the rates over the last minute (from the ingress's history)."""
    _with_aborted(status["requests"], ingress.stats)
    status["http"] = RESPONSES.snapshot()
    status["pairs"] = pair_table(status["pools"])
    history = getattr(ingress, "history", None)
    if history is not None:
        history.ensure_running()  # (re)starts the sampler if the constructor had no event loop
    status["throughput"] = history.rates(status) if history is not None else None
    status["history"] = (
        {"samples": len(history.samples), "interval_s": history.interval_s, "window_s": history.window_s}
        if history is not None
        else None
    )
    return status


def start_history(ingress) -> StatusHistory:
    """The ingress's status history, sampling from now on (see ``deploy.ops.status_history``)."""
    return StatusHistory(lambda: sample_status(ingress)).start()
