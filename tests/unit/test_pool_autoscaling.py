"""A pool's autoscaling_config is Serve's own, checked at the boundary and passed through."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deploy.args import PoolArgs
from deploy.builder import _pool_options, serve_logging


def options(pool: PoolArgs) -> dict:
    return _pool_options(pool, "deploy.pools.routers:DecodeRouter", {}, serve_logging("INFO", access_log=False))


def test_autoscaling_config_replaces_a_fixed_replica_count():
    pool = PoolArgs(autoscaling_config={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8})
    opts = options(pool)
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}
    assert "num_replicas" not in opts
    assert options(PoolArgs(replicas=2))["num_replicas"] == 2 and "autoscaling_config" not in options(PoolArgs())


@pytest.mark.parametrize(
    "config, message",
    [
        ({"min_replicas": 0, "max_replicas": 2}, "min_replicas must be >= 1"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"max_replica": 2}, "max_replica"),
    ],
)
def test_bad_autoscaling_configs_are_refused_by_name(config, message):
    with pytest.raises(ValidationError, match=message):
        PoolArgs(autoscaling_config=config)
