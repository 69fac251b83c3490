"""pdserve's own log lines inside a Serve replica.

In a replica Serve configures one logger, ``ray.serve``: its handlers write the replica's log
file under ``logs/serve/`` and stderr (``RAY_SERVE_LOG_TO_STDERR``, on by default), which Ray
forwards to the driver's console, prefixed with the replica's name. Its level is the
deployment's ``LoggingConfig`` level, which pdserve sets to WARNING to mute Serve's own per-call
lines (``deploy/builder.py``). pdserve's loggers (``pdserve``, and the engine's under
``workers``) are not under it: their records reached only Python's last-resort handler, which
drops everything below WARNING, so a replica's start-up lines (its torch threads, the small-batch /
oneDNN choice, the attention kernel, its KV blocks) were lost. ``route_to_serve`` gives them
Serve's handlers at pdserve's own ``log_level``.
"""

from __future__ import annotations

import logging

LOGGERS = ("pdserve", "workers")


def route_to_serve(level: str) -> None:
    """In a replica: ``LOGGERS`` log at ``level`` through Serve's replica handlers (only them:
    no second copy through the root logger). Outside a replica, where ``ray.serve`` has no
    handlers, only the level is set."""
    handlers = logging.getLogger("ray.serve").handlers
    for name in LOGGERS:
        log = logging.getLogger(name)
        log.setLevel(level)
        if handlers:
            log.handlers = list(handlers)
            log.propagate = False
