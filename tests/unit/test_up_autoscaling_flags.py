"""`pdserve up --autoscaling pd|queue --max-replicas N`: the flags become the application's
autoscaling arguments, and wrong combinations are refused before anything starts."""

from __future__ import annotations

import pytest

from deploy.args import Mode
from deploy.ops.cli import build_parser, up_app_args


def _app_args(model: str, *flags: str):
    args = build_parser().parse_args(["up", "--model", model, "--threads-per-replica", "1", *flags])
    return up_app_args(args, model, None)


def test_pd_takes_the_budget_and_leaves_the_pools_to_the_policy(tiny_llama):
    app = _app_args(tiny_llama, "--autoscaling", "pd", "--max-replicas", "4")
    assert app.autoscaling is not None and app.autoscaling.policy == "pd"
    assert app.autoscaling_budget == 4
    assert app.autoscaling_bounds("prefill") == (1, 3) and app.autoscaling_bounds("decode") == (1, 3)
    assert app.prefill.autoscaling_config is None and app.decode.autoscaling_config is None
    assert (app.prefill.replicas, app.decode.replicas) == (1, 1)


def test_pd_budget_defaults_to_the_starting_replicas(tiny_llama):
    app = _app_args(tiny_llama, "--autoscaling", "pd", "--prefill", "2", "--decode", "1")
    assert app.autoscaling_budget == 3


def test_queue_gives_each_pool_serves_own_autoscaling(tiny_llama):
    app = _app_args(tiny_llama, "--autoscaling", "queue", "--max-replicas", "3", "--decode", "2")
    assert app.autoscaling is None
    assert app.prefill.autoscaling_config == {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 1}
    assert app.decode.autoscaling_config == {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2}
    colocated = _app_args(tiny_llama, "--mode", "colocated", "--autoscaling", "queue")
    assert colocated.mode is Mode.COLOCATED
    assert colocated.colocated.autoscaling_config == {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1}


def test_fixed_replicas_without_the_flag(tiny_llama):
    app = _app_args(tiny_llama, "--prefill", "2")
    assert app.autoscaling is None and app.prefill.autoscaling_config is None and app.prefill.replicas == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--max-replicas", "4"), "--max-replicas sizes --autoscaling"),
        (("--mode", "colocated", "--autoscaling", "pd"), "use mode disaggregated"),
        (("--autoscaling", "pd", "--prefill", "3", "--max-replicas", "3"), "outside autoscaling.prefill bounds"),
        (("--autoscaling", "queue", "--decode", "3", "--max-replicas", "2"), "below a pool's starting replicas 3"),
    ],
)
def test_wrong_combinations_are_refused_with_the_reason(tiny_llama, flags, message):
    with pytest.raises(ValueError, match=message):
        _app_args(tiny_llama, *flags)


def test_ray_dashboard_runs_when_asked_for_or_needed_by_pd():
    """A Ray that `pdserve up` starts runs without its dashboard (idle CPU) unless --ray-dashboard
    asks for it or --autoscaling pd needs its REST API; queue autoscaling is Serve's own."""
    from deploy.ops.cli import _ray_dashboard

    def dashboard(*flags: str) -> bool:
        return _ray_dashboard(build_parser().parse_args(["up", *flags]))

    assert dashboard() is False
    assert dashboard("--ray-dashboard") is True
    assert dashboard("--autoscaling", "pd") is True
    assert dashboard("--autoscaling", "queue") is False
