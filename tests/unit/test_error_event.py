"""A stream's error event names the worker's own failure, not Ray's wrapper around it (a
RayTaskError's text is a remote traceback with terminal colour codes)."""

from __future__ import annotations

from ray.exceptions import RayTaskError

from deploy.api.responses import ResponseBuilder, root_cause
from workers.engine_loop import EngineDeadError


def test_the_error_event_names_the_workers_exception_without_rays_wrapper():
    dead = EngineDeadError("engine failed: TensorParallelError('tensor-parallel worker rank 1 died')")
    wrapped = RayTaskError("handle_request", "Traceback ...\x1b[36mray::ServeReplica:decode\x1b[39m ...", dead)
    assert root_cause(wrapped) is dead
    assert root_cause(dead) is dead
    event = ResponseBuilder("cmpl-1", "m", None, False, 3, False).error_event(wrapped)
    message = event["error"]["message"]
    assert message == f"generation failed: {dead}"
    assert "\x1b[" not in message and "ServeReplica" not in message
    assert event["error"]["code"] == "worker_failed" and event["error"]["type"] == "server_error"
