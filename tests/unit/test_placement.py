"""Layouts placed before anything is deployed (deploy/placement.py): shares that fit a machine
``pdserve up`` runs Ray on, GPUs a rank, and refusals that name the flags (or the YAML fields)
to change; the watch that stops a deployment Serve cannot schedule."""

from __future__ import annotations

import pytest

from deploy.args import PDServeArgs
from deploy.ops.cli import SchedulingWatch, _reason, build_parser, up_layout
from deploy.placement import (
    CLI,
    YAML,
    Capacity,
    LayoutError,
    check_cpus,
    check_gpus,
    engine_ranks,
    plan_layout,
)

TWO_CORES = Capacity(cpus=2.0, gpus=0.0, memory_bytes=20 << 30, where="this machine (2 cores)", cores=2)
EIGHT_GPUS = Capacity(cpus=64.0, gpus=8.0, memory_bytes=None, where="the Ray cluster")


def _up(model: str, capacity: Capacity, *flags: str, own_machine: bool = True) -> PDServeArgs:
    args = build_parser().parse_args(["up", *flags])
    return up_layout(args, model, None, capacity, own_machine=own_machine)


@pytest.mark.parametrize(
    "flags", [("--prefill-tp", "2", "--decode-tp", "1"), ("--prefill-tp", "1", "--decode-tp", "2")]
)
def test_tensor_parallel_layouts_fit_two_cores_with_every_share_lowered_together(tiny_llama, flags):
    """Three engine ranks and the ingress ask for 0.5 x 3 + 1 = 2.5 CPUs; on 2 cores each share
    is scaled by 0.8 (0.4 a rank, 0.8 the ingress): everything can be scheduled."""
    placed = _up(tiny_llama, TWO_CORES, *flags)
    assert placed.prefill.num_cpus == placed.decode.num_cpus == pytest.approx(0.4)
    assert placed.ingress_num_cpus == pytest.approx(0.8)
    assert sum(engine_ranks(placed).values()) == 3
    check_cpus(placed, TWO_CORES, CLI, placed.ingress_num_cpus)  # fits as placed
    assert placed.prefill.num_gpus == placed.decode.num_gpus == 0


def test_a_layout_that_fits_keeps_its_shares(tiny_llama):
    placed = _up(tiny_llama, Capacity(8.0, 0.0, 20 << 30, "this machine (8 cores)", 8))
    assert (placed.prefill.num_cpus, placed.decode.num_cpus, placed.ingress_num_cpus) == (0.5, 0.5, 1.0)


def test_too_many_engine_ranks_for_the_cores_are_refused_naming_the_flags(tiny_llama):
    with pytest.raises(LayoutError) as caught:
        _up(tiny_llama, TWO_CORES, "--prefill", "4", "--decode", "4", "--prefill-tp", "2")
    message = str(caught.value)
    assert "12 engine ranks (prefill 4 x 2 + decode 4 x 1)" in message and "at most 4" in message
    for flag in ("--prefill", "--decode", "--prefill-tp", "--decode-tp", "--ray-address"):
        assert flag in message


def test_shares_given_by_the_operator_must_fit_as_given(tiny_llama):
    with pytest.raises(LayoutError, match=r"asks Ray for 3 CPUs .* --cpus-per-replica"):
        _up(tiny_llama, TWO_CORES, "--cpus-per-replica", "1")
    # on a cluster pdserve up joined, the shares are never resized
    with pytest.raises(LayoutError, match="the Ray cluster has 2"):
        _up(tiny_llama, Capacity(2.0, 0.0, None, "the Ray cluster"), "--prefill", "2", own_machine=False)


def test_memory_for_every_ranks_weights_and_kv_is_checked(tiny_llama):
    small = Capacity(cpus=2.0, gpus=0.0, memory_bytes=3 << 30, where="this machine (2 cores)", cores=2)
    with pytest.raises(LayoutError, match=r"needs about .* GiB .* --kv-cache-memory-gib"):
        _up(tiny_llama, small)  # two ranks with 1 GiB of KV each
    assert _up(tiny_llama, small, "--kv-cache-memory-gib", "0.1").prefill.num_cpus == 0.5


def test_gpus_one_a_rank_by_default_and_more_than_there_are_refused(tiny_llama):
    placed = _up(tiny_llama, EIGHT_GPUS, "--prefill", "3", "--decode", "5", own_machine=False)
    assert placed.prefill.num_gpus == placed.decode.num_gpus == 1.0  # --device auto on a GPU cluster
    with pytest.raises(LayoutError) as caught:
        _up(tiny_llama, EIGHT_GPUS, "--prefill", "5", "--decode", "4", own_machine=False)
    assert "asks for 9 GPUs (prefill 5 ranks x 1 + decode 4 ranks x 1)" in str(caught.value)
    assert "--gpus-per-replica" in str(caught.value) and "--prefill" in str(caught.value)
    # tensor parallel: a GPU per rank
    with pytest.raises(LayoutError, match="asks for 10 GPUs"):
        _up(tiny_llama, EIGHT_GPUS, "--prefill", "3", "--prefill-tp", "2", "--decode", "4", own_machine=False)
    # disaggregation on one GPU: half a GPU each
    one = Capacity(16.0, 1.0, None, "the Ray cluster")
    shared = _up(tiny_llama, one, "--gpus-per-replica", "0.5", own_machine=False)
    assert shared.prefill.num_gpus == shared.decode.num_gpus == 0.5
    # --device cpu on a GPU machine asks for none
    assert _up(tiny_llama, EIGHT_GPUS, "--device", "cpu", own_machine=False).prefill.num_gpus == 0


def test_a_cuda_engine_without_a_gpu_is_refused_by_flag_and_by_yaml_field(tiny_llama):
    with pytest.raises(ValueError, match="--device cuda needs a GPU in every replica: set --gpus-per-replica"):
        _up(tiny_llama, TWO_CORES, "--device", "cuda")
    with pytest.raises(ValueError) as caught:
        PDServeArgs.model_validate({"model": tiny_llama, "device": "cuda", "mode": "colocated"})
    assert "colocated pool asks Ray for none: set <pool>.num_gpus" in _reason(caught.value)
    with pytest.raises(ValueError, match="the decode pool asks"):
        PDServeArgs.model_validate({"model": tiny_llama, "device": "cuda", "prefill": {"num_gpus": 1}})
    PDServeArgs.model_validate(
        {"model": tiny_llama, "device": "cuda", "prefill": {"num_gpus": 1}, "decode": {"num_gpus": 1}}
    )


def test_yaml_layouts_name_the_yaml_fields(tiny_llama):
    args = PDServeArgs.model_validate(
        {"model": tiny_llama, "prefill": {"replicas": 6, "num_gpus": 1}, "decode": {"replicas": 4, "num_gpus": 1}}
    )
    with pytest.raises(LayoutError) as caught:
        check_gpus(args, EIGHT_GPUS, YAML)
    assert "prefill.replicas, decode.replicas" in str(caught.value) and "<pool>.num_gpus" in str(caught.value)
    assert plan_layout(args, Capacity(64.0, 10.0, None, "the Ray cluster"), YAML, own_machine=False, shares_given=True)


def test_the_pd_autoscalers_budget_counts_as_ranks(tiny_llama):
    args = PDServeArgs.model_validate(
        {
            "model": tiny_llama,
            "autoscaling": {"policy": "pd", "max_total_replicas": 6},
            "prefill": {"num_gpus": 1},
            "decode": {"num_gpus": 1},
        }
    )
    assert sum(engine_ranks(args).values()) == 6
    with pytest.raises(LayoutError, match="asks for 6 GPUs"):
        check_gpus(args, Capacity(64.0, 4.0, None, "the Ray cluster"), YAML)


SERVE_SAYS = (
    "Deployment 'prefill' in application 'pdserve' has 1 replicas that have taken more than 30s to be "
    "scheduled. This may be due to waiting for the cluster to auto-scale or for a runtime environment to be "
    'installed. Resources required for each replica: {"CPU": 2}, total resources available: {"CPU": 1.0}.'
)


def test_a_deployment_serve_cannot_schedule_is_said_once_then_stopped_after_the_bound():
    watch = SchedulingWatch(bound_s=60.0)
    assert watch.see("ingress", "", 0.0) is None
    line = watch.see("prefill", SERVE_SAYS, 10.0)
    assert line is not None and line.startswith("prefill: Ray cannot place its replicas yet")
    assert watch.see("prefill", SERVE_SAYS, 20.0) is None  # said once
    assert watch.expired(69.0) is None
    assert watch.expired(70.5) == "prefill"
    watch.see("prefill", "", 71.0)  # scheduled after all: no longer waiting
    assert watch.expired(200.0) is None
