"""What a benchmark run is: the server, the endpoint, the arrival rate and concurrency, the SLOs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deploy.ops.loadgen.workloads import WorkloadSpec

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
REFUSED_STATUSES = (429, 503)
SLO_NAMES = ("ttft", "tpot", "e2el")


class BenchmarkError(Exception):
    """The benchmark cannot run at all (no model to name, bad server address)."""


@dataclass(frozen=True)
class BenchConfig:
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str | None = None  # None: the chat endpoint for multi-turn, completions otherwise
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_rate: float = math.inf  # Poisson arrivals per second; inf sends everything at once
    max_concurrency: int | None = None  # in-flight requests (conversations, for multi-turn)
    ignore_eos: bool = False
    temperature: float = 0.0
    goodput_slos_ms: Mapping[str, float] = field(default_factory=dict)  # "ttft"|"tpot"|"e2el" -> ms
    percentiles: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0  # per request, connect to last byte
    progress: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in (None, COMPLETIONS, CHAT):
            raise ValueError(f"endpoint {self.endpoint!r} is unknown: use {COMPLETIONS} or {CHAT}")
        if self.workload.dataset == "multi-turn" and self.endpoint == COMPLETIONS:
            raise ValueError(f"the multi-turn dataset sends message lists: use --endpoint {CHAT}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate {self.request_rate} must be positive (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency {self.max_concurrency} must be at least 1")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout {self.timeout_s} must be positive seconds")
        for name, ms in self.goodput_slos_ms.items():
            if name not in SLO_NAMES or not ms > 0:
                forms = " ".join(f"{n}:MS" for n in SLO_NAMES)
                raise ValueError(f"goodput SLO {name}:{ms} is invalid: use {forms} with positive milliseconds")
        if not self.percentiles or any(not 0 < p <= 100 for p in self.percentiles):
            raise ValueError(f"percentiles {self.percentiles} must lie in (0, 100]")

    @property
    def resolved_endpoint(self) -> str:
        return self.endpoint or (CHAT if self.workload.dataset == "multi-turn" else COMPLETIONS)

    @property
    def chat(self) -> bool:
        return self.resolved_endpoint == CHAT

    @property
    def server_root(self) -> str:
        """The base URL without a trailing ``/v1``: endpoints carry their own."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root
