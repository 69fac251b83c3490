"""The operator dashboard: one static page served by the ingress at ``/dashboard``.

The page holds no data of its own. On load it draws the ingress's server-side window
(``GET /v1/cluster/history``: one sample every ``INTERVAL_S`` over the last 10 minutes, see
``deploy.ops.status_history``), then every 2 s it polls ``GET /v1/cluster/status`` for the figures
and ``GET /v1/cluster/history?since=<newest sample>`` for the charts. Everything it loads
(HTML, JS, CSS) comes from ``deploy/ops/static`` through this app, so it works on a cluster with no
outside network.

Every URL in the page is relative to the page itself, so the dashboard works at ``/dashboard``
and under any Serve route prefix (``/dash/dashboard`` fetches ``/dash/v1/cluster/status``).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from deploy.ops.status_history import install_response_counter

STATIC_DIR = Path(__file__).parent / "static"


def install_dashboard(app: FastAPI) -> None:
    """Mount ``/dashboard`` (the page) and ``/dashboard/static/*`` (its script and styles), and
    count the completion routes' answers by HTTP status (the page's refusal and error figures).

    Plain routes on the module-level app: Serve's ingress keeps routes that are not methods of
    the deployment class as they are.
    """
    install_response_counter(app)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        # no-cache: a redeployed dashboard.js must not meet a stale page from the browser cache
        return FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-cache"})

    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
