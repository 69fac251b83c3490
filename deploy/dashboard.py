"""The operator dashboard: one static page served by the ingress at ``/dashboard``.

The page holds no data of its own; its script polls ``GET /v1/cluster/status`` every 2 s and
keeps the latency time series in the browser. Everything it loads (HTML, JS, CSS) comes from
``deploy/static`` through this app, so it works on a cluster with no outside network.

Every URL in the page is relative to the page itself, so the dashboard works at ``/dashboard``
and under any Serve route prefix (``/dash/dashboard`` fetches ``/dash/v1/cluster/status``).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"


def install_dashboard(app: FastAPI) -> None:
    """Mount ``/dashboard`` (the page) and ``/dashboard/static/*`` (its script and styles).

    Plain routes on the module-level app: Serve's ingress keeps routes that are not methods of
    the deployment class as they are.
    """

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        # no-cache: a redeployed dashboard.js must not meet a stale page from the browser cache
        return FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-cache"})

    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
