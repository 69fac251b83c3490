"""A pool's tensor_parallel_size as Serve options: a placement group of one bundle per rank, the
replica actor (rank 0) inside the first; prefill and decode pools of their own sizes; refused
where it cannot run (heads that do not split, compiled decode). Options dicts and argument
checks only: no Ray cluster."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deploy.args import PDServeArgs, PoolArgs
from deploy.builder import _pool_options, make_app, serve_logging


def options(pool: PoolArgs) -> dict:
    return _pool_options(pool, "deploy.pools.routers:PrefixAwareRouter", {}, serve_logging("INFO", access_log=False))


def test_one_rank_has_no_placement_group():
    opts = options(PoolArgs(num_cpus=2, num_gpus=1, resources={"decode": 1}))
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1, "resources": {"decode": 1}}
    assert "placement_group_bundles" not in opts and "placement_group_strategy" not in opts


def test_gpu_ranks_are_bundles_of_one_node_with_custom_resources_on_the_first():
    opts = options(PoolArgs(tensor_parallel_size=4, num_cpus=2, num_gpus=1, resources={"decode": 1}))
    assert opts["placement_group_bundles"] == [
        {"CPU": 2, "GPU": 1, "decode": 1},
        {"CPU": 2, "GPU": 1},
        {"CPU": 2, "GPU": 1},
        {"CPU": 2, "GPU": 1},
    ]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1, "resources": {"decode": 1}}


def test_cpu_ranks_pack_and_the_strategy_is_overridable():
    opts = options(PoolArgs(tensor_parallel_size=2, num_cpus=0.5))
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert opts["placement_group_strategy"] == "PACK"
    spread = options(PoolArgs(tensor_parallel_size=2, num_gpus=1, placement_group_strategy="SPREAD"))
    assert spread["placement_group_strategy"] == "SPREAD"
    with pytest.raises(ValidationError, match="placement_group_strategy 'TIGHT'"):
        PoolArgs(tensor_parallel_size=2, placement_group_strategy="TIGHT")
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        PoolArgs(tensor_parallel_size=0)
    with pytest.raises(ValidationError, match="a bundle of num_cpus/num_gpus per rank"):
        PoolArgs(tensor_parallel_size=2, num_cpus=0)


def test_serve_accepts_the_options_with_the_replica_in_the_first_bundle(tiny_llama):
    """Serve's own validation (the replica actor must fit bundle 0) runs when the app is built."""
    app = make_app(
        {
            "model": tiny_llama,
            "device": "cpu",
            "mode": "colocated",
            "colocated": {"tensor_parallel_size": 2, "num_cpus": 0.5, "resources": {"pool": 1}},
        }
    )
    colocated = app._bound_deployment.init_kwargs["colocated"]._bound_deployment
    config = colocated._replica_config
    assert config.placement_group_bundles == [{"CPU": 0.5, "pool": 1}, {"CPU": 0.5}]
    assert config.placement_group_strategy == "PACK"


def test_disaggregated_pools_of_different_sizes_get_their_own_bundles(tiny_llama):
    app = make_app(
        {
            "model": tiny_llama,
            "device": "cpu",
            "prefill": {"tensor_parallel_size": 2, "num_cpus": 0.5},
            "decode": {"tensor_parallel_size": 1, "num_cpus": 0.5},
        }
    )
    kwargs = app._bound_deployment.init_kwargs
    prefill = kwargs["prefill"]._bound_deployment._replica_config
    decode = kwargs["decode"]._bound_deployment._replica_config
    assert prefill.placement_group_bundles == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert decode.placement_group_bundles is None


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_disaggregated_pools_take_their_own_tensor_parallel_size_checked_against_the_heads(tiny_llama, pool):
    args = PDServeArgs(model=tiny_llama, **{pool: {"tensor_parallel_size": 2}})
    assert getattr(args, pool).tensor_parallel_size == 2
    other = "decode" if pool == "prefill" else "prefill"
    assert getattr(args, other).tensor_parallel_size == 1
    with pytest.raises(ValidationError, match=f"{pool}.tensor_parallel_size 3: the model's 4 attention heads"):
        PDServeArgs(model=tiny_llama, **{pool: {"tensor_parallel_size": 3}})
    with pytest.raises(ValidationError, match=f"{pool}.tensor_parallel_size 2 runs eager only"):
        PDServeArgs(model=tiny_llama, enforce_eager=False, **{pool: {"tensor_parallel_size": 2}})


def test_colocated_tensor_parallel_size_is_checked_against_the_heads(tiny_llama):
    PDServeArgs(model=tiny_llama, mode="colocated", colocated={"tensor_parallel_size": 2})
    with pytest.raises(ValidationError, match="colocated.tensor_parallel_size 3: the model's 4 attention heads"):
        PDServeArgs(model=tiny_llama, mode="colocated", colocated={"tensor_parallel_size": 3})
    with pytest.raises(ValidationError, match="eager only"):
        PDServeArgs(model=tiny_llama, mode="colocated", enforce_eager=False, colocated={"tensor_parallel_size": 2})


def test_engine_kwargs_carry_the_pools_size(tiny_llama):
    args = PDServeArgs(model=tiny_llama, mode="colocated", colocated={"tensor_parallel_size": 2})
    assert args.engine_kwargs("cpu", "colocated")["tensor_parallel_size"] == 2
    assert args.engine_kwargs("cpu", "prefill")["tensor_parallel_size"] == 1
