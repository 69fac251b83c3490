"""Leases on a prefill worker's blocks: held until decode claims them, or freed when they expire.

The prefill worker grants a lease when it hands out a KVHandle. Exactly one of three things then
ends it, and ``on_release(request_id, reason)`` runs exactly once, outside the table's lock:
  * "claimed"  - the decode worker pulled the blocks and acked (``claim``),
  * "released" - the request ended another way, e.g. the client went away (``release``),
  * "expired"  - nobody claimed it within the TTL (``sweep``), so a decode worker that crashed
                 after receiving the handle strands nothing.
``extend`` pushes a live lease's end later (a request waiting for room on the decode side).
``on_release`` is where the prefill worker frees (or caches) the blocks; it must not call back
into the table.

Expiry is driven by ``sweep``: every ``grant`` sweeps, and ``start()`` runs a timer thread that
sweeps every ``interval_s``. Thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

OnRelease = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class Lease:
    request_id: str
    expires_at: float  # on the table's clock (monotonic by default)


@dataclass(slots=True)
class _Entry:
    lease: Lease
    on_release: OnRelease
    seq: int


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._heap: list[tuple[float, int, str]] = []  # may hold stale entries; seq tells
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._entries

    def grant(self, request_id: str, ttl_s: float, on_release: OnRelease) -> Lease:
        """Hold ``request_id``'s blocks for ``ttl_s`` seconds."""
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        self.sweep()
        with self._lock:
            if request_id in self._entries:
                raise ValueError(f"request {request_id} already holds a lease")
            lease = Lease(request_id, self._clock() + ttl_s)
            seq = next(self._seq)
            self._entries[request_id] = _Entry(lease, on_release, seq)
            heapq.heappush(self._heap, (lease.expires_at, seq, request_id))
        return lease

    def claim(self, request_id: str) -> bool:
        """Decode acked: end the lease as "claimed". False if it was unknown or already overdue
        (an overdue lease ends as "expired" here, as a sweep would have ended it)."""
        entry = self._pop(request_id)
        if entry is None:
            return False
        reason = "claimed" if self._clock() < entry.lease.expires_at else "expired"
        self._fire(entry, reason)
        return reason == "claimed"

    def extend(self, request_id: str, ttl_s: float) -> float | None:
        """Hold the blocks until ``ttl_s`` from now (a lease never ends earlier than it already
        would); returns the seconds left, None when the lease is unknown or already overdue."""
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        now = self._clock()
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.lease.expires_at <= now:
                return None
            if now + ttl_s > entry.lease.expires_at:
                entry.lease = Lease(request_id, now + ttl_s)
                entry.seq = next(self._seq)  # the old heap item goes stale
                heapq.heappush(self._heap, (entry.lease.expires_at, entry.seq, request_id))
            return entry.lease.expires_at - now

    def release(self, request_id: str) -> bool:
        """End the lease as "released" (request aborted); False if it was unknown."""
        entry = self._pop(request_id)
        if entry is None:
            return False
        self._fire(entry, "released")
        return True

    def sweep(self) -> list[str]:
        """End every overdue lease as "expired"; returns their request ids."""
        now = self._clock()
        expired: list[_Entry] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                _, seq, request_id = heapq.heappop(self._heap)
                entry = self._entries.get(request_id)
                if entry is not None and entry.seq == seq:
                    del self._entries[request_id]
                    expired.append(entry)
        for entry in expired:
            logger.info("lease on %s expired unclaimed; its blocks are freed", entry.lease.request_id)
            self._fire(entry, "expired")
        return [entry.lease.request_id for entry in expired]

    def start(self, interval_s: float = 1.0) -> None:
        """Sweep every ``interval_s`` on a daemon thread until ``close()``."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="kv-lease-sweeper", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sweep()

    def _pop(self, request_id: str) -> _Entry | None:
        with self._lock:
            return self._entries.pop(request_id, None)

    def _fire(self, entry: _Entry, reason: str) -> None:
        try:
            entry.on_release(entry.lease.request_id, reason)
        except Exception:  # noqa: BLE001 - one bad callback must not stop the others
            logger.exception("on_release for %s (%s) raised", entry.lease.request_id, reason)
