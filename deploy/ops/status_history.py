"""The dashboard's server-side window: one condensed sample of the cluster every ``INTERVAL_S``
over the last ``WINDOW_S``, kept in the ingress replica (``GET /v1/cluster/history``), so a
freshly opened page draws the last minutes at once. Also the per-window rates of the status
endpoint (throughput, errors, refusals) and the count of completion responses by HTTP status.

Each ingress replica samples what it sees itself (its own requests, every worker replica), as
the status endpoint does. Sampling is a small asyncio task on the replica's event loop: every
call it makes is awaited (the replica list is read in a thread), so it never blocks the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("pdserve")

INTERVAL_S = 5.0  # idle cost: one stats call per worker replica per sample
WINDOW_S = 600.0
RATE_WINDOW_S = 60.0  # the status endpoint's rates: over the last minute

# cumulative counters of a sample -> the per-second rate derived from them
RATES = {
    "completion_tokens": "output_tokens_per_s",
    "finished": "requests_per_s",
    "failed": "failed_per_s",
    "aborted": "aborted_per_s",
    "refused": "refused_per_s",
    "client_errors": "client_errors_per_s",
}


# ------------------------------------------------------------------ completion responses by status
class ResponseCounts:
    """HTTP statuses of the completion routes' answers, in this process (one ingress replica).

    A 503 (pool full) or 429 is a refusal; other 4xx the client's fault; other 5xx ours. A
    request whose client left before any answer started is not counted.
    """

    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}

    def add(self, status: int) -> None:
        self.by_status[status] = self.by_status.get(status, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        counts = dict(self.by_status)
        refused = sum(n for s, n in counts.items() if s in (429, 503))
        return {
            "responses": {str(s): n for s, n in sorted(counts.items())},
            "total": sum(counts.values()),
            "ok": sum(n for s, n in counts.items() if 200 <= s < 300),
            "refused": refused,
            "client_errors": sum(n for s, n in counts.items() if 400 <= s < 500 and s != 429),
            "server_errors": sum(n for s, n in counts.items() if s >= 500 and s != 503),
        }


RESPONSES = ResponseCounts()


def counted(path: str, method: str) -> bool:
    return method == "POST" and path.rstrip("/").endswith("/completions")


class CountResponses:
    """Pure ASGI middleware: counts the status of each completion response in ``RESPONSES``.

    Module-level (Serve pickles the app by reference), so in a replica it counts into that
    replica's ``RESPONSES``. It only watches ``http.response.start``: streams pass untouched.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not counted(scope.get("path", ""), scope.get("method", "")):
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start" and status is None:
                status = int(message["status"])
                RESPONSES.add(status)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if status is None:
                RESPONSES.add(500)  # Starlette's outermost handler answers 500 for it
            raise


def install_response_counter(app) -> None:
    app.add_middleware(CountResponses)  # outermost of the app's middleware: sees 401/413 too


# ------------------------------------------------------------------ samples
def _num(x) -> float | None:
    return None if x is None else float(x)


def condense(status: dict, previous: dict | None, previous_bytes: dict[str, int]) -> tuple[dict, dict[str, int]]:
    """One sample from a status-like dict (``time``, ``requests``, ``http``, ``pools``), with the
    rates since ``previous``. Returns the sample and the decode replicas' byte counters."""
    req = status.get("requests") or {}
    http = status.get("http") or {}
    pools = status.get("pools") or {}
    t = float(status["time"])
    sample: dict[str, Any] = {
        "t": t,
        "ttft": dict(req.get("ttft_s") or {}),
        "itl": dict(req.get("itl_s") or {}),
        "active": req.get("active"),
        "started": req.get("started"),
        "finished": req.get("finished"),
        "failed": req.get("failed"),
        "aborted": req.get("aborted"),
        "completion_tokens": req.get("completion_tokens"),
        "refused": http.get("refused"),
        "client_errors": http.get("client_errors"),
        "http_total": http.get("total"),
        "kv_usage": {
            name: _mean([r.get("kv_usage") for r in replicas if r.get("healthy")]) for name, replicas in pools.items()
        },
    }
    dt = t - previous["t"] if previous is not None else 0.0
    for counter, rate in RATES.items():
        now, before = sample.get(counter), (previous or {}).get(counter)
        sample[rate] = max(0.0, (now - before) / dt) if dt > 0 and now is not None and before is not None else None
    # KV bytes received by the decode pool: per replica, so a replica that restarted (new id, or
    # a counter that went down) adds nothing this round rather than a negative rate
    decode_bytes = {
        r["worker_id"]: int(r.get("transfer_bytes") or 0) for r in pools.get("decode") or [] if r.get("healthy")
    }
    sample["transfer_bytes_per_s"] = None
    if "decode" in pools and previous is not None and dt > 0:
        moved = sum(
            b - previous_bytes[w] for w, b in decode_bytes.items() if w in previous_bytes and b >= previous_bytes[w]
        )
        sample["transfer_bytes_per_s"] = moved / dt
    return sample, decode_bytes


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


class StatusHistory:
    """A ring of condensed samples, fed by ``collect`` (a coroutine returning a status-like
    dict) every ``interval_s`` from a task on the event loop, or by ``record`` directly."""

    def __init__(
        self,
        collect: Callable[[], Awaitable[dict]] | None = None,
        interval_s: float = INTERVAL_S,
        window_s: float = WINDOW_S,
    ) -> None:
        self.collect = collect
        self.interval_s = interval_s
        self.window_s = window_s
        self.samples: deque[dict] = deque(maxlen=int(window_s / interval_s) + 1)
        self._bytes: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        self.errors = 0

    # ---------------------------------------------------------------- feeding
    def record(self, status: dict) -> dict | None:
        """Append the sample of ``status``; a status older than the newest sample is dropped."""
        previous = self.samples[-1] if self.samples else None
        if previous is not None and float(status["time"]) <= previous["t"]:
            return None
        sample, self._bytes = condense(status, previous, self._bytes)
        self.samples.append(sample)
        cutoff = sample["t"] - self.window_s
        while self.samples and self.samples[0]["t"] < cutoff:
            self.samples.popleft()
        return sample

    def start(self) -> StatusHistory:
        """Start sampling on the running event loop; without one (or without ``collect``),
        ``ensure_running`` from any coroutine starts it later."""
        self.ensure_running()
        return self

    def ensure_running(self) -> bool:
        if self.collect is None:
            return False
        if self._task is not None and not self._task.done():
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self._task = loop.create_task(self._run(), name="pdserve-status-history")
        return True

    async def _run(self) -> None:
        collect = self.collect
        if collect is None:  # ensure_running starts no task then
            return
        while True:
            started = time.monotonic()
            try:
                status = await collect()
                self.record(status)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one bad round must not end the history
                self.errors += 1
                if self.errors in (1, 10) or self.errors % 100 == 0:
                    logger.warning("status history: sample failed (%d so far): %s", self.errors, exc)
            await asyncio.sleep(max(0.05, self.interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        """Stop sampling for good (the ingress is draining: a sample would read replicas that are
        stopping, on an event loop whose executor may already be shut down). ``ensure_running``
        starts nothing afterwards; the samples so far stay readable."""
        self.collect = None
        if self._task is not None:
            self._task.cancel()

    # ---------------------------------------------------------------- reading
    def export(self, since: float | None = None) -> dict:
        samples = [s for s in self.samples if since is None or s["t"] > since]
        return {"interval_s": self.interval_s, "window_s": self.window_s, "samples": samples}

    def rates(self, status: dict, window_s: float = RATE_WINDOW_S) -> dict:
        """Rates over the last ``window_s``: the status's counters against the oldest sample in
        that window. ``None`` figures when no sample is old enough to measure from."""
        current, _ = condense(status, None, {})
        now = current["t"]
        base = next((s for s in self.samples if s["t"] >= now - window_s - self.interval_s / 2), None)
        span = now - base["t"] if base is not None else 0.0
        out: dict[str, Any] = {"window_s": round(span, 3) if span > 0 else None}
        delta: dict[str, float | None] = {}
        for counter, rate in RATES.items():
            a, b = current.get(counter), (base or {}).get(counter)
            counted = max(0, a - b) if span > 0 and a is not None and b is not None else None
            delta[counter] = counted
            out[rate] = counted / span if counted is not None else None
        ended = sum(delta[k] or 0 for k in ("finished", "failed", "aborted"))
        out["error_fraction"] = (delta["failed"] or 0) / ended if ended else None
        http_now, http_base = status.get("http") or {}, (base or {}).get("http_total")
        out["refusal_fraction"] = None
        total_now = http_now.get("total")
        if span > 0 and total_now is not None and http_base is not None and total_now > http_base:
            out["refusal_fraction"] = (delta["refused"] or 0) / (total_now - http_base)
        bytes_moved = None
        if base is not None and span > 0 and "decode" in (status.get("pools") or {}):
            later = [s for s in self.samples if s["t"] > base["t"]]
            if later:
                moved = sum((s["transfer_bytes_per_s"] or 0) * (s["t"] - p["t"]) for p, s in zip([base, *later], later))
                bytes_moved = moved / (later[-1]["t"] - base["t"])
        out["transfer_bytes_per_s"] = bytes_moved
        return out
