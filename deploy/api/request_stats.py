"""The ingress's request figures: counters and a sliding window of latency samples, from which
the status endpoint and dashboard compute percentiles over the last minutes.

Every choice that starts ends exactly once, as one of ``OUTCOMES``: ``finished`` (EOS, a stop
token or string, the length limit), ``aborted`` (the client left or cancelled: guidellm does at
its time limit; nobody saw an error) or ``failed`` (the client got an error)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 300.0
MAX_SAMPLES = 20_000


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in qs}
    ordered = sorted(values)
    return {f"p{q}": ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] for q in qs}


@dataclass
class LatencyWindow:
    samples: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))  # (time, seconds)

    def add(self, seconds: float, now: float | None = None) -> None:
        self.samples.append((now or time.time(), seconds))

    def recent(self, window_s: float = WINDOW_S, now: float | None = None) -> list[float]:
        cutoff = (now or time.time()) - window_s
        while self.samples and self.samples[0][0] < cutoff:
            self.samples.popleft()
        return [s for _, s in self.samples]


OUTCOMES = ("finished", "aborted", "failed")


@dataclass
class RequestStats:
    started: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0  # client disconnects and cancellations: not failures
    active: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: LatencyWindow = field(default_factory=LatencyWindow)
    itl: LatencyWindow = field(default_factory=LatencyWindow)
    e2e: LatencyWindow = field(default_factory=LatencyWindow)
    timeline: deque = field(default_factory=lambda: deque(maxlen=600))  # (time, ttft_p50, itl_p50, tok/s)

    def begin(self, prompt_tokens: int) -> None:
        self.started += 1
        self.active += 1
        self.prompt_tokens += prompt_tokens

    def end(self, outcome: str, e2e_s: float | None = None, now: float | None = None) -> None:
        """One choice ended: ``outcome`` is one of ``OUTCOMES``; ``e2e_s`` counts for finished ones."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r}: one of {', '.join(OUTCOMES)}")
        self.active -= 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        if outcome == "finished" and e2e_s is not None:
            self.e2e.add(e2e_s, now)

    def snapshot(self) -> dict:
        ttft, itl, e2e = self.ttft.recent(), self.itl.recent(), self.e2e.recent()
        return {
            "started": self.started,
            "finished": self.finished,
            "failed": self.failed,
            "aborted": self.aborted,
            "active": self.active,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cluster_prefix_hit_rate": self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "ttft_s": percentiles(ttft),
            "itl_s": percentiles(itl),
            "e2e_s": percentiles(e2e),
            "window_s": WINDOW_S,
        }
