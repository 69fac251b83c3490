"""Device backends: everything device-specific under the model and the engine (``base.py``).

``select(name, device, config)`` makes the engine's backend once: "auto" is the device's own
(``cpu`` on a CPU, ``cuda`` on a GPU); "reference" runs plain torch anywhere (the
specification the others are checked against). ``PDSERVE_BACKEND=reference`` makes "auto" mean
the reference in a process and its children (Ray workers inherit it from ``ray start``/``pdserve
up``): the whole suite runs on it that way.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.backends.base import Backend
    from workers.engine.config import EngineConfig

BACKENDS = ("auto", "cpu", "cuda", "reference")


FORCE_ENV = "PDSERVE_BACKEND"  # set: what "auto" means in this process (the conformance runs force reference)


def resolve(name: str, device: torch.device) -> str:
    """The backend ``name`` means on ``device`` ("auto": ``$PDSERVE_BACKEND`` when set, else the
    device's own)."""
    if name == "auto" and os.environ.get(FORCE_ENV, "auto") != "auto":
        name = os.environ[FORCE_ENV]
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "cuda" if device.type == "cuda" else "cpu" if device.type == "cpu" else "reference"
    if name in ("cpu", "cuda") and device.type != name:
        raise ValueError(f"backend={name!r} runs on a {name} device, not {device}: use backend auto or reference")
    return name


def select(name: str, device: torch.device, config: EngineConfig) -> Backend:
    """The backend for an engine on ``device`` (its classes load only when chosen)."""
    resolved = resolve(name, device)
    if resolved == "cpu":
        from workers.backends.cpu.backend import CPUBackend

        return CPUBackend(device, config)
    if resolved == "cuda":
        from workers.backends.cuda.backend import CUDABackend

        return CUDABackend(device, config)
    from workers.backends.reference import ReferenceBackend

    return ReferenceBackend(device, config)
