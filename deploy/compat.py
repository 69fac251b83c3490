"""The Ray this application was tested against, checked where the application is built.

pdserve uses Serve APIs that change between Ray releases (request routers and their stats, the
external scaler of ``autoscaling: pd``, replica placement options), so ``pyproject.toml`` pins
``ray[serve]`` to the releases the test suite ran against, and ``make_app`` refuses any other
Ray with a message saying what to install: a machine that brings its own Ray (a GPU image) fails
at start-up, not in the middle of serving. ``PDSERVE_ALLOW_UNTESTED_RAY=1`` tries anyway (logged
as a warning)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

TESTED_RAY = ((2, 60),)  # (major, minor) releases the whole test suite ran against
ALLOW_ENV = "PDSERVE_ALLOW_UNTESTED_RAY"


def _release(version: str) -> tuple[int, int]:
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError as exc:
        raise RuntimeError(f"cannot read Ray's version {version!r}") from exc


def check_ray_version(version: str | None = None) -> None:
    if version is None:
        import ray

        version = ray.__version__
    if _release(version) in TESTED_RAY:
        return
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_RAY)
    message = (
        f"pdserve was tested with Ray {tested} and this is Ray {version}: its Serve APIs (request "
        f"routers, the external scaler, placement options) change between releases. Install "
        f"ray[serve]=={TESTED_RAY[-1][0]}.{TESTED_RAY[-1][1]}.* (pip install -e . does), or set "
        f"{ALLOW_ENV}=1 to try this Ray anyway"
    )
    if os.environ.get(ALLOW_ENV) == "1":
        logger.warning("%s (%s=1: trying)", message, ALLOW_ENV)
        return
    raise RuntimeError(message)
