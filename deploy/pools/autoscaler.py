"""The ``autoscaler`` deployment (``autoscaling: pd``): one replica that, every ``interval_s``,
reads both pools' replicas, runs the pd policy (``deploy/pools/autoscaling.py``) and sets each pool's
target replica count through Serve's external-scaler API (the application is deployed with
``external_scaler_enabled``; see the policy module for what Serve 2.60 offers and why).

Each change is logged at INFO, one line with the signals that caused it, through Serve's own
replica logger (``ray.serve``: this replica's file under the session's ``logs/serve/`` and the
driver's console; a plain logger has no handler in a Ray worker), and kept (the last
``DECISIONS_KEPT``) with a timeline of the targets for ``status()``, which the ingress's status
endpoint, ``pdserve status`` and the dashboard show."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx
from ray import serve

from deploy.args import PDServeArgs
from deploy.ops.cluster_status import PoolReader
from deploy.pools.autoscaling import (
    Decision,
    PolicyConfig,
    PolicyState,
    PoolBounds,
    decide,
    describe,
    kv_usage_ahead,
)
from deploy.pools.autoscaling_signals import SignalReader
from workers.transfer.control import ControlClient

logger = logging.getLogger("ray.serve.pdserve")  # Serve's handlers; its LoggingConfig sets the level

DECISIONS_KEPT = 50
TIMELINE_S = 600.0  # the targets' timeline covers the last 10 minutes
STATS_TIMEOUT_S = 5.0
SCALE_TIMEOUT_S = 10.0
DEFAULT_DASHBOARD_PORT = 8265
# After a change that shrinks decode: how long to watch the replicas Serve stops (the pools'
# drain time, deploy/builder.py's POOL_DRAIN_S: then Serve cuts their streams anyway), how often,
# and each Retire call's deadline
RETIRE_WATCH_S = 15.0
RETIRE_POLL_S = 0.5
RETIRE_TIMEOUT_S = 5.0


def policy_config(args: PDServeArgs) -> PolicyConfig:
    a = args.autoscaling
    assert a is not None
    return PolicyConfig(
        max_total_replicas=args.autoscaling_budget,
        prefill=PoolBounds(*args.autoscaling_bounds("prefill")),
        decode=PoolBounds(*args.autoscaling_bounds("decode")),
        ttft_target_s=a.ttft_target_s,
        tpot_target_s=a.tpot_target_s,
        kv_usage_target=a.kv_usage_target,
        prefill_tokens_per_s=a.prefill_tokens_per_s,
        upscale_delay_s=a.upscale_delay_s,
        downscale_delay_s=a.downscale_delay_s,
        cooldown_s=a.cooldown_s,
        look_back_s=a.look_back_s,
        kv_look_ahead_s=a.kv_look_ahead_s,
        fill_budget=a.fill_budget,
        move_step=a.move_step,
        take_ratio=a.take_ratio,
    )


def held_blocks(pool: list[dict[str, Any]], worker_id: str) -> int:
    """KV blocks a decode replica's sequences hold, as its stats said (0 if it did not answer)."""
    for r in pool:
        if r.get("worker_id") == worker_id and r.get("healthy"):
            return int(r.get("total_blocks", 0)) - int(r.get("free_blocks", 0))
    return 0


def room_to_hand_over(pool: list[dict[str, Any]], leaving: set[str], kv_usage_target: float) -> int:
    """KV blocks the decode replicas that stay (answering, not in ``leaving``) can take while each
    stays within ``kv_usage_target`` of its blocks: the rest of their KV is for what prefill hands
    over meanwhile."""
    room = 0
    for r in pool:
        if r.get("healthy") and r.get("worker_id") not in leaving:
            reserve = (1.0 - kv_usage_target) * int(r.get("total_blocks", 0))
            room += max(0, int(r.get("free_blocks", 0) - reserve))
    return room


def unread_pools(pools: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Pools with replicas listed and none of them answering, each with one replica's reason."""
    return {
        name: next((str(r.get("error")) for r in replicas if r.get("error")), "no answer")
        for name, replicas in pools.items()
        if replicas and not any(r.get("healthy") for r in replicas)
    }


def dashboard_urls(configured: str | None) -> list[str]:
    """Where to find the Ray dashboard's REST API: the configured URL, else port 8265 on the head
    (the GCS's host, from the public runtime context) and on this node (the autoscaler is placed
    on the head, where a dashboard bound to localhost answers)."""
    if configured:
        return [configured.rstrip("/")]
    import ray

    head = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
    return list(
        dict.fromkeys([f"http://{head}:{DEFAULT_DASHBOARD_PORT}", f"http://127.0.0.1:{DEFAULT_DASHBOARD_PORT}"])
    )


def ray_auth_headers() -> dict[str, str]:
    """The bearer token a Ray cluster with token authentication (``RAY_AUTH_MODE=token``, on by
    default for local clusters since Ray 2.59) wants on dashboard requests, from where Ray's token
    authentication documents it: ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``
    names, else ``~/.ray/auth_token``. No token: no header."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        if path.is_file():
            token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


class DashboardScaler:
    """Serve's external-scaler API, its public entry point: ``POST /api/v1/applications/<app>/
    deployments/<name>/scale`` on the Ray dashboard (``ScaleDeploymentRequest``). Serve refuses
    it unless the application was deployed with ``external_scaler_enabled``."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._client = httpx.AsyncClient(timeout=SCALE_TIMEOUT_S, headers=ray_auth_headers())

    async def set_target(self, app_name: str, deployment: str, num_replicas: int) -> None:
        unreachable = []
        for url in list(self.urls):
            try:
                resp = await self._client.post(
                    f"{url}/api/v1/applications/{app_name}/deployments/{deployment}/scale",
                    json={"target_num_replicas": num_replicas},
                )
            except httpx.HTTPError as exc:
                unreachable.append(f"{url} ({type(exc).__name__})")
                continue
            if resp.status_code != 200:
                raise RuntimeError(f"the Ray dashboard at {url} refused to scale {deployment}: {resp.text[:300]}")
            self.urls = [url] + [u for u in self.urls if u != url]  # ask the one that answered first
            return
        raise RuntimeError(
            f"no Ray dashboard answered at {', '.join(unreachable)}: set autoscaling.dashboard_url to the "
            "dashboard's address (ray start --head --dashboard-port ...)"
        )

    async def stopping_replicas(self, app_name: str, deployment: str) -> set[str]:
        """Ids of ``deployment``'s replicas that Serve is stopping (``GET /api/serve/applications/``,
        the Serve REST API's replica details)."""
        resp = await self._client.get(f"{self.urls[0]}/api/serve/applications/")
        resp.raise_for_status()
        app = (resp.json().get("applications") or {}).get(app_name) or {}
        replicas = ((app.get("deployments") or {}).get(deployment) or {}).get("replicas") or []
        return {r["replica_id"] for r in replicas if r.get("state") == "STOPPING"}


# On the head node: the dashboard (which it calls to set replica counts) listens there.
@serve.deployment(
    name="autoscaler", num_replicas=1, ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}
)
class PDAutoscaler:
    async def __init__(self, args: dict) -> None:  # type: ignore[misc]  # Serve awaits an async constructor
        self.args = PDServeArgs.model_validate(args)
        if self.args.autoscaling is None:
            raise ValueError("the pd autoscaler runs only with `autoscaling: pd` in the args")
        self.config = policy_config(self.args)
        self.interval_s = self.args.autoscaling.interval_s
        self.app_name = serve.get_replica_context().app_name
        self.targets = {"prefill": self.args.prefill.replicas, "decode": self.args.decode.replicas}
        self.reader = SignalReader(block_size=self.args.block_size)
        self.state = PolicyState(last_change=time.time())
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISIONS_KEPT)
        self.timeline: deque[tuple[float, int, int, int, int]] = deque()
        self.last: dict[str, Any] | None = None
        self.error: str | None = None
        self.unread: dict[str, str] = {}  # pool -> why none of its replicas answered, last round
        self._task: asyncio.Task | None = None
        self._retiring: asyncio.Task | None = None
        self._retire_wanted = 0  # decode replicas the running watch looks for
        self._retire_deadline = 0.0
        self.scaler = DashboardScaler(dashboard_urls(self.args.autoscaling.dashboard_url))
        self.pool_reader = PoolReader(self.app_name, ControlClient("autoscaler"), timeout_s=STATS_TIMEOUT_S)
        self._ensure_running()
        c = self.config
        logger.info(
            "autoscaling (pd): budget %d replicas, prefill %d..%d, decode %d..%d, TTFT target %.2f s, "
            "TPOT target %.0f ms",
            c.max_total_replicas,
            c.prefill.min_replicas,
            c.prefill.max_replicas,
            c.decode.min_replicas,
            c.decode.max_replicas,
            c.ttft_target_s,
            c.tpot_target_s * 1000,
        )

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one failed round must not stop the loop
                logger.warning("autoscaling: a decision round failed: %s", exc, exc_info=True)
            await asyncio.sleep(self.interval_s)

    async def step(self) -> Decision:
        """Read both pools, decide, apply a change (one round of the loop)."""
        prefill, decode = await asyncio.gather(self._read_pool("prefill"), self._read_pool("decode"))
        now = time.time()
        unread = unread_pools({"prefill": prefill, "decode": decode})
        if unread != self.unread:  # one line per change: which pool could not be read, and why
            if unread:
                logger.warning("autoscaling: cannot read %s", "; ".join(f"{k}: {v}" for k, v in unread.items()))
            else:
                logger.info("autoscaling: every pool is readable again")
            self.unread = unread
        p, d = self.reader.read(now, prefill, decode, self.targets["prefill"], self.targets["decode"])
        decision = decide(p, d, self.config, self.state, now)
        self.state = decision.state
        self.last = {
            "time": now,
            "prefill_need": decision.prefill_need,
            "decode_need": decision.decode_need,
            "held": decision.held,
            "unread": unread,
            "pending": decision.state.pending,
            "prefill": p.__dict__,
            # each running sequence's (tokens left, blocks) is summed up, not listed
            "decode": {k: v for k, v in d.__dict__.items() if k != "running_left"}
            | {"kv_usage_ahead": kv_usage_ahead(d, self.config)},
        }
        if decision.changed:
            line = describe(decision, p, d, self.config)
            try:
                for name, count in (("prefill", decision.prefill), ("decode", decision.decode)):
                    if count != self.targets[name]:
                        await self.scaler.set_target(self.app_name, name, count)
                        self.targets[name] = count
                self.error = None
                logger.info("autoscaling: %s", line)
                if decision.decode < d.replicas and self.args.max_migrations > 0:
                    self._watch_retiring(d.replicas - decision.decode)
                self.decisions.append(
                    {
                        "time": now,
                        "prefill": decision.prefill,
                        "decode": decision.decode,
                        "from": {"prefill": p.replicas, "decode": d.replicas},
                        "line": line,
                    }
                )
            except Exception as exc:  # noqa: BLE001 - shown in status; the next round tries again
                self.error = (
                    f"could not set the pools' replicas ({type(exc).__name__}: {exc}); deploy the "
                    "application with external_scaler_enabled (serve.run(..., external_scaler_enabled=True)"
                    " or external_scaler_enabled: true in the Serve config)"
                )[:400]
                logger.error("autoscaling: %s", self.error)
        self.timeline.append((now, self.targets["prefill"], self.targets["decode"], p.ready_replicas, d.ready_replicas))
        while self.timeline and self.timeline[0][0] < now - TIMELINE_S:
            self.timeline.popleft()
        return decision

    def _watch_retiring(self, count: int) -> None:
        """Watch for ``count`` more decode replicas stopping (``_retire_stopping``). A scale-down
        while a watch runs joins it, with a new deadline: two watches would each count the room
        in the replicas that stay, and hand over more than it holds."""
        if self._retiring is not None and not self._retiring.done():
            self._retire_wanted += count
            self._retire_deadline = time.monotonic() + RETIRE_WATCH_S
            return
        self._retiring = asyncio.get_running_loop().create_task(self._retire_stopping(count))

    async def _retire_stopping(self, count: int) -> None:
        """Tell the ``count`` decode replicas Serve stops for a scale-down to hand their streams
        over (``Retire`` on each one's control server; the ingress resumes each stream on another
        decode replica, as ``max_migrations`` allows), instead of holding their budget slots while
        their streams run out or the pools' drain time (15 s) cuts them, while the other pool's
        new replicas wait for those slots. Serve picks which replicas stop; the Serve REST API
        says which are stopping. A stopping replica is told only once the decode replicas that
        stay have the free KV blocks its sequences hold within their KV target
        (``room_to_hand_over``): handing more sequences than the replicas left have room for
        makes them all wait, and both the handed-over requests and the prompts behind them miss
        their targets; filling the replicas left to their last free block leaves the prompts
        that come back waiting, and the policy soon gives the replica back to decode
        (docs/decisions/0022-pd-autoscaler-through-external-scaler.md)."""
        retired: set[str] = set()
        handed = 0  # blocks handed over so far: counted against the room until the watch ends
        # what a scale-down joining the watch (``_watch_retiring``) raises
        self._retire_wanted = count
        self._retire_deadline = time.monotonic() + RETIRE_WATCH_S
        while len(retired) < self._retire_wanted and time.monotonic() < self._retire_deadline:
            try:
                stopping = await self.scaler.stopping_replicas(self.app_name, "decode") - retired
                addresses = await self.pool_reader.addresses("decode") if stopping else {}
                pool = await self.pool_reader.read("decode") if stopping else []
            except Exception as exc:  # noqa: BLE001 - they drain as before
                logger.warning("autoscaling: cannot tell which decode replicas are stopping: %s", exc)
                return
            room = room_to_hand_over(pool, stopping | retired, self.config.kv_usage_target) - handed
            for replica_id in sorted(stopping, key=lambda r: held_blocks(pool, r)):
                address = addresses.get(replica_id)
                if address is None:
                    continue  # not registered (it never started): nothing runs there
                held = held_blocks(pool, replica_id)
                if held > room:
                    continue  # the replicas that stay cannot hold its streams yet: they run on here
                room -= held
                handed += held
                retired.add(replica_id)
                try:
                    ended = await self.pool_reader.control.retire(address, RETIRE_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - that replica drains as before
                    logger.warning("autoscaling: decode replica %s did not take Retire: %s", replica_id, exc)
                    continue
                logger.info(
                    "autoscaling: decode replica %s is stopping: %d stream(s) handed to the other decode replicas",
                    replica_id,
                    ended,
                )
            await asyncio.sleep(RETIRE_POLL_S)

    async def _read_pool(self, name: str) -> list[dict[str, Any]]:
        """Each live replica's figures, as the status endpoint reads them (a replica that does
        not answer within the deadline counts as not ready)."""
        return await self.pool_reader.read(name)

    async def status(self) -> dict[str, Any]:
        """What the status endpoint shows: bounds, targets, the last round's signals, the
        recent changes and the targets' timeline."""
        self._ensure_running()
        c = self.config
        return {
            "policy": "pd",
            "budget": c.max_total_replicas,
            "interval_s": self.interval_s,
            "ttft_target_s": c.ttft_target_s,
            "tpot_target_s": c.tpot_target_s,
            "bounds": {
                "prefill": [c.prefill.min_replicas, c.prefill.max_replicas],
                "decode": [c.decode.min_replicas, c.decode.max_replicas],
            },
            "targets": dict(self.targets),
            "last": self.last,
            "error": self.error,
            "decisions": list(self.decisions),
            "timeline": [list(t) for t in self.timeline],
        }

    async def __del__(self) -> None:
        """Serve's graceful stop: end the loop before the replica's executor goes."""
        for task in (self._task, self._retiring):
            if task is not None:
                task.cancel()

    async def check_health(self) -> None:
        self._ensure_running()  # a loop that died of something unforeseen starts again
