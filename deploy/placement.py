"""Where a deployment's replicas go, decided before anything is deployed: a layout that fits the
machine or cluster, or a refusal that names what to change.

Serve waits forever for a replica that no node can hold (it prints "taken more than 30s to be
scheduled" every 30 s), and an engine that asks for CUDA in a replica Ray gave no GPU either lands
on a GPU another replica holds or runs on the CPU. So the pools' demand is checked here against
what there is:

- **devices**: a CUDA engine needs ``num_gpus`` > 0 in every pool it runs in;
- **GPUs**: the pools' ranks times ``num_gpus`` fit the GPUs (a replica per GPU, a bundle per
  tensor-parallel rank; fractions share one GPU);
- **CPUs** (Ray's scheduling shares): on a machine ``pdserve up`` starts itself the shares are
  sized to fit (the ingress's included), since they only order scheduling there; elsewhere they
  must fit as given;
- **cores**: at most ``MAX_RANKS_PER_CORE`` engine ranks a core on a CPU-only machine;
- **memory** (a CPU-only machine): each rank's weights share, KV budget and process overhead fit
  the memory available.

``Naming`` says how the message names a setting: ``pdserve up``'s flags, or a Serve YAML's
``args`` fields (``build_app``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from deploy.args import Mode, PDServeArgs, PoolArgs

# Engine ranks on one core at most: each rank's OpenMP threads spin between ops, and past two
# ranks a core every rank's steps wait on the others' (no such layout serves faster than fewer).
MAX_RANKS_PER_CORE = 2
# Resident memory of an engine process besides its weights and KV: torch, Ray's worker, buffers.
PROCESS_OVERHEAD_BYTES = 3 << 28  # 0.75 GiB
INGRESS_BYTES = 1 << 29  # the ingress replica: tokenizer, FastAPI, Serve's replica
SHARE_STEP = 0.01  # Ray's CPU shares are rounded down to this


class LayoutError(ValueError):
    """A layout that cannot run where it was asked to; the message names the settings."""


@dataclass(frozen=True)
class Capacity:
    """What a layout must fit: Ray's CPUs and GPUs, and host memory (None: not checked)."""

    cpus: float
    gpus: float
    memory_bytes: int | None
    where: str  # "this machine (2 cores)" / "the Ray cluster"
    cores: int | None = None  # physical cores of a single machine (the ranks-per-core rule)

    @classmethod
    def this_machine(cls) -> Capacity:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        gpus = 0
        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:  # the CLI runs without torch for some commands
            pass
        return cls(float(cores), float(gpus), available_memory(), f"this machine ({cores} cores)", cores)

    @classmethod
    def ray_cluster(cls) -> Capacity:
        import ray

        total = ray.cluster_resources()
        return cls(float(total.get("CPU", 0.0)), float(total.get("GPU", 0.0)), None, "the Ray cluster")


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class Naming:
    """How messages name the settings."""

    replicas: dict[str, str]
    tensor_parallel: dict[str, str]
    num_cpus: str
    num_gpus: str
    kv_memory: str
    elsewhere: str  # how to use more machines

    def pool_flags(self, pools: list[str]) -> str:
        names = [self.replicas[p] for p in pools] + [self.tensor_parallel[p] for p in pools]
        return ", ".join(dict.fromkeys(names))


CLI = Naming(
    replicas={"prefill": "--prefill", "decode": "--decode", "colocated": "--colocated"},
    tensor_parallel={"prefill": "--prefill-tp", "decode": "--decode-tp", "colocated": "--tp"},
    num_cpus="--cpus-per-replica",
    num_gpus="--gpus-per-replica",
    kv_memory="--kv-cache-memory-gib",
    elsewhere="or join a larger cluster with --ray-address",
)
YAML = Naming(
    replicas={p: f"{p}.replicas" for p in ("prefill", "decode", "colocated")},
    tensor_parallel={p: f"{p}.tensor_parallel_size" for p in ("prefill", "decode", "colocated")},
    num_cpus="<pool>.num_cpus",
    num_gpus="<pool>.num_gpus",
    kv_memory="kv_cache_memory_gib",
    elsewhere="or add nodes to the cluster",
)


def active_pools(args: PDServeArgs) -> dict[str, PoolArgs]:
    if args.mode is Mode.COLOCATED:
        return {"colocated": args.colocated}
    return {"prefill": args.prefill, "decode": args.decode}


def _replicas(pool: PoolArgs) -> int:
    """The most replicas a pool runs at once (its autoscaling maximum when it has one)."""
    if pool.autoscaling_config:
        return int(pool.autoscaling_config.get("max_replicas", pool.replicas))
    return pool.replicas


def engine_ranks(args: PDServeArgs) -> dict[str, int]:
    """Engine ranks (processes) each active pool runs at most: replicas x tensor-parallel size."""
    ranks = {name: _replicas(pool) * pool.tensor_parallel_size for name, pool in active_pools(args).items()}
    if args.autoscaling is not None and args.mode is Mode.DISAGGREGATED:
        # the pd autoscaler moves replicas between the pools within its budget
        most = args.autoscaling.max_total_replicas or args.prefill.replicas + args.decode.replicas
        tp = max(args.prefill.tensor_parallel_size, args.decode.tensor_parallel_size)
        if most * tp > sum(ranks.values()):  # counted as the pool with the larger ranks
            big = "prefill" if args.prefill.tensor_parallel_size >= args.decode.tensor_parallel_size else "decode"
            ranks = {"prefill": 0, "decode": 0} | {big: most * tp}
    return ranks


def check_devices(args: PDServeArgs, naming: Naming) -> None:
    """A CUDA engine in a pool whose replicas Ray gives no GPU is refused."""
    if args.device != "cuda":
        return
    without = [name for name, pool in active_pools(args).items() if pool.num_gpus == 0]
    if without:
        raise LayoutError(
            f"device cuda needs a GPU in every replica, but the {' and '.join(without)} "
            f"{'pool asks' if len(without) == 1 else 'pools ask'} Ray for none: set {naming.num_gpus} "
            "(1 for a GPU a rank, a fraction to share one)"
        )


def check_gpus(args: PDServeArgs, capacity: Capacity, naming: Naming) -> None:
    """The pools' GPUs (ranks x num_gpus) fit the GPUs there are."""
    pools = active_pools(args)
    ranks = engine_ranks(args)
    need = sum(ranks[name] * pool.num_gpus for name, pool in pools.items())
    if need <= capacity.gpus + 1e-9:
        return
    parts = " + ".join(
        f"{name} {ranks[name]} rank{'s' if ranks[name] != 1 else ''} x {pool.num_gpus:g}"
        for name, pool in pools.items()
        if pool.num_gpus
    )
    raise LayoutError(
        f"the layout asks for {need:g} GPUs ({parts}) but {capacity.where} has {capacity.gpus:g}: "
        f"lower {naming.pool_flags(list(pools))} or {naming.num_gpus}, {naming.elsewhere}"
    )


def check_cpus(args: PDServeArgs, capacity: Capacity, naming: Naming, ingress_cpus: float) -> None:
    """Ray's CPU shares as given fit the CPUs there are."""
    need = _cpu_need(args, ingress_cpus)
    if need > capacity.cpus + 1e-9:
        raise LayoutError(
            f"the layout asks Ray for {need:g} CPUs (the ingress {args.ingress_replicas} x {ingress_cpus:g}, "
            f"engine ranks x {naming.num_cpus}) but {capacity.where} has {capacity.cpus:g}: lower "
            f"{naming.pool_flags(list(active_pools(args)))} or {naming.num_cpus}, {naming.elsewhere}"
        )


def _cpu_need(args: PDServeArgs, ingress_cpus: float) -> float:
    pools = active_pools(args)
    ranks = engine_ranks(args)
    return args.ingress_replicas * ingress_cpus + sum(ranks[n] * p.num_cpus for n, p in pools.items())


def weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's weights (its safetensors files)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def kv_bytes_per_rank(args: PDServeArgs) -> int:
    """Host memory one CPU engine rank gives its KV cache."""
    if args.num_kv_blocks is not None:
        import torch

        from workers.layers.kv_cache import bytes_per_block
        from workers.models.config import ModelConfig
        from workers.models.loader import resolve_dtype

        config = ModelConfig.from_dir(args.model)
        dtype = resolve_dtype(config, torch.device("cpu"), args.dtype)
        return args.num_kv_blocks * bytes_per_block(config, args.block_size, args.kv_cache_dtype, dtype)
    return int(args.kv_cache_memory_gib * 2**30)


def check_memory(args: PDServeArgs, capacity: Capacity, naming: Naming) -> None:
    """CPU engines: every rank's weights share, KV budget and process overhead fit the memory
    available (GPU engines keep weights and KV on their devices)."""
    pools = active_pools(args)
    if capacity.memory_bytes is None or any(pool.num_gpus for pool in pools.values()):
        return
    ranks = engine_ranks(args)
    weights = weight_bytes(args.model)
    kv = kv_bytes_per_rank(args)
    need = args.ingress_replicas * INGRESS_BYTES
    for name, pool in pools.items():
        host_tier = int(pool.host_kv_gib * 2**30)  # each replica's host KV tier, beside its cache
        need += ranks[name] * (weights // pool.tensor_parallel_size + kv + PROCESS_OVERHEAD_BYTES) + host_tier * (
            _replicas(pool)
        )
    if need > capacity.memory_bytes:
        gib = 2**30
        raise LayoutError(
            f"the layout needs about {need / gib:.1f} GiB ({sum(ranks.values())} engine ranks, each with its "
            f"share of {weights / gib:.2f} GiB of weights, {kv / gib:.2f} GiB of KV and "
            f"{PROCESS_OVERHEAD_BYTES / gib:.2f} GiB for the process, plus host KV tiers) but {capacity.where} has "
            f"{capacity.memory_bytes / gib:.1f} GiB available: lower {naming.pool_flags(list(pools))} "
            f"or {naming.kv_memory}, {naming.elsewhere}"
        )


def check_cores(args: PDServeArgs, capacity: Capacity, naming: Naming) -> None:
    """CPU engines on one machine: at most ``MAX_RANKS_PER_CORE`` engine ranks a core."""
    pools = active_pools(args)
    if capacity.cores is None or any(pool.num_gpus for pool in pools.values()):
        return
    ranks = engine_ranks(args)
    total = sum(ranks.values())
    most = MAX_RANKS_PER_CORE * capacity.cores
    if total > most:
        parts = " + ".join(
            f"{name} {_replicas(pool)} x {pool.tensor_parallel_size}" for name, pool in pools.items() if ranks[name]
        )
        raise LayoutError(
            f"the layout runs {total} engine ranks ({parts}) but {capacity.where} runs at most {most} "
            f"({MAX_RANKS_PER_CORE} a core): lower {naming.pool_flags(list(pools))}, {naming.elsewhere}"
        )


def fit_shares(args: PDServeArgs, capacity: Capacity, ingress_cpus: float) -> tuple[PDServeArgs, float]:
    """On a machine ``pdserve up`` started: the engines' and the ingress's CPU shares scaled down
    together, in steps of ``SHARE_STEP``, until they fit (they only order scheduling there).
    Returns the args and the ingress's share."""
    need = _cpu_need(args, ingress_cpus)
    if need <= capacity.cpus + 1e-9:
        return args, ingress_cpus
    factor = capacity.cpus / need

    def scaled(share: float) -> float:
        return max(SHARE_STEP, math.floor(share * factor / SHARE_STEP) * SHARE_STEP)

    pools = {
        name: pool.model_copy(update={"num_cpus": round(scaled(pool.num_cpus), 4)})
        for name, pool in active_pools(args).items()
    }
    return args.model_copy(update=pools), round(scaled(ingress_cpus), 4)


def plan_layout(
    args: PDServeArgs, capacity: Capacity, naming: Naming, *, own_machine: bool, shares_given: bool
) -> PDServeArgs:
    """``args`` with CPU shares that fit ``capacity`` (``own_machine``: a Ray ``pdserve up``
    started here, whose shares it may size, unless ``shares_given``), or LayoutError."""
    check_devices(args, naming)
    check_gpus(args, capacity, naming)
    check_cores(args, capacity, naming)
    check_memory(args, capacity, naming)
    ingress_cpus = args.ingress_num_cpus
    if own_machine and not shares_given:
        args, ingress_cpus = fit_shares(args, capacity, ingress_cpus)
        args = args.model_copy(update={"ingress_num_cpus": ingress_cpus})
    check_cpus(args, capacity, naming, ingress_cpus)
    return args
