"""The cluster's state as the ingress sees it: every replica of every pool (each asked directly,
through a call pinned to its replica id), the Redis index, and the ingress's own request
figures. Backs ``GET /v1/cluster/status``, the dashboard and ``pdserve status``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

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
        ids.append(name[len(prefix):])
    return sorted(ids)


async def pool_status(handle, app_name: str, deployment: str, timeout_s: float = 3.0) -> list[dict[str, Any]]:
    ids = await asyncio.to_thread(replica_ids, app_name, deployment)

    async def one(replica_id: str) -> dict[str, Any]:
        try:
            stats = await asyncio.wait_for(handle.stats.remote(target_replica=replica_id), timeout_s)
            if stats["worker_id"] != replica_id:  # the replica left; the call landed elsewhere
                return {"worker_id": replica_id, "healthy": False, "error": "not reachable through the router (starting or gone)"}
            return {"healthy": True, **stats}
        except Exception as exc:  # noqa: BLE001 - a replica that cannot answer is shown as such
            return {"worker_id": replica_id, "healthy": False, "error": f"{type(exc).__name__}: {exc}"[:200]}

    return list(await asyncio.gather(*(one(i) for i in ids)))


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
        "workers": {wid: {"role": rec.role, "free_blocks": rec.free_blocks, "total_blocks": rec.total_blocks,
                          "num_running": rec.num_running, "num_waiting": rec.num_waiting}
                    for wid, rec in workers.items()},
    }
