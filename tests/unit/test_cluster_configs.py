"""The shipped configs hold together: every `ray up` YAML passes Ray's own cluster schema (as
`ray up` prepares it), both Serve YAMLs pass Ray Serve's schema and `PDServeArgs`, and every
resource a pool of serve.gpu.yaml asks for (its custom resource, its GPUs, its CPUs) exists on
some node type of every cluster YAML, so a misspelt resource name fails here, not at 3 a.m.
with replicas pending forever."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")
import ray.autoscaler  # noqa: E402
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from deploy.args import PDServeArgs  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAMLS = sorted((REPO_ROOT / "cluster").glob("*.yaml"))
# The GPU clusters serve deploy/serve.gpu.yaml; testbed.yaml (namespaces on one machine, no GPUs)
# serves the CPU pools of `pdserve testbed serve-config` and is checked at the end of this file.
TESTBED_YAML = REPO_ROOT / "cluster" / "testbed.yaml"
GPU_CLUSTER_YAMLS = [p for p in CLUSTER_YAMLS if p != TESTBED_YAML]
SERVE_YAMLS = [
    REPO_ROOT / "deploy" / "serve.dev.yaml",
    REPO_ROOT / "deploy" / "serve.gpu.yaml",
    REPO_ROOT / "deploy" / "serve.gpu-node.yaml",
]
RAY_GCS_PORT = 6379
POOLS = ("prefill", "decode")


def _load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def _pdserve_app(serve_config: dict) -> dict:
    (app,) = [app for app in serve_config["applications"] if app["name"] == "pdserve"]
    return app


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from workers.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", num_layers=1))


@pytest.fixture(scope="module")
def ray_cluster_schema() -> dict:
    with open(Path(ray.autoscaler.__file__).parent / "ray-schema.json") as f:
        return json.load(f)


# -- node resources of each cluster YAML -------------------------------------------------------


def _onprem_node_resources(config: dict, gpus_per_node: int = 1) -> dict[str, dict[str, float]]:
    """Run worker_start_ray_commands for each worker IP with `hostname`, `nvidia-smi` and `ray`
    stubbed, and read the resources `ray start` would get (the local provider has one node type,
    so roles come from that script, not from available_node_types)."""
    script = "; ".join(config["worker_start_ray_commands"])
    stubs = (
        'hostname() { echo "$STUB_IP"; }; '
        f"nvidia-smi() {{ for i in $(seq {gpus_per_node}); do echo GPU; done; }}; "
        'ray() { printf "%s\\n" "$@"; }; '
    )
    nodes = {}
    for ip in config["provider"]["worker_ips"]:
        env = dict(os.environ, STUB_IP=ip, RAY_HEAD_IP=config["provider"]["head_ip"])
        result = subprocess.run(["bash", "-c", stubs + script], env=env, capture_output=True, text=True, timeout=10)
        assert result.returncode == 0, f"worker {ip}: {result.stderr}"
        # `ray stop` prints "stop"; `ray start ...` prints one argument per line.
        args = result.stdout.split("\n")
        resources: dict[str, float] = {}
        for arg in args:
            if arg.startswith("--resources="):
                resources.update(json.loads(arg.removeprefix("--resources=")))
            elif arg.startswith("--num-gpus="):
                resources["GPU"] = float(arg.removeprefix("--num-gpus="))
        nodes[f"worker {ip}"] = resources
    return nodes


def _node_resources(config: dict) -> dict[str, dict[str, float]]:
    if config["provider"]["type"] == "local":
        return _onprem_node_resources(config)
    return {name: dict(node_type["resources"]) for name, node_type in config["available_node_types"].items()}


def _pool_demand(pool: dict, with_cpus: bool) -> dict[str, float]:
    demand = {"GPU": pool["num_gpus"], **pool["resources"]}
    if with_cpus:
        demand["CPU"] = pool["num_cpus"]
    return demand


# -- cluster YAMLs -------------------------------------------------------------------------------


def test_the_cluster_yamls_are_shipped() -> None:
    assert [p.name for p in CLUSTER_YAMLS] == ["aws.yaml", "gcp.yaml", "onprem.yaml", "testbed.yaml"]


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_yaml_passes_ray_schema(path: Path, ray_cluster_schema: dict) -> None:
    config = _load(path)
    jsonschema.validate(config, ray_cluster_schema)  # as written: unknown top-level keys fail
    # As `ray up` sees it: merged with the provider's defaults (on-prem: turned into its single
    # node type), then validated again with Ray's extra checks (head type, min/max workers).
    validate_config(prepare_config(config))


@pytest.mark.parametrize("path", GPU_CLUSTER_YAMLS, ids=lambda p: p.name)
def test_every_gpu_pool_fits_some_node_type(path: Path) -> None:
    config = _load(path)
    nodes = _node_resources(config)
    args = _pdserve_app(_load(REPO_ROOT / "deploy" / "serve.gpu.yaml"))["args"]
    # On-prem, Ray detects CPUs itself: only GPUs and custom resources are known here.
    with_cpus = config["provider"]["type"] != "local"
    for pool_name in POOLS:
        demand = _pool_demand(args[pool_name], with_cpus)
        fitting = [
            name for name, have in nodes.items() if all(have.get(key, 0) >= need for key, need in demand.items())
        ]
        assert fitting, f"{path.name}: no node type has {demand} for the {pool_name} pool; nodes: {nodes}"


@pytest.mark.parametrize("path", GPU_CLUSTER_YAMLS, ids=lambda p: p.name)
def test_pool_resources_mark_gpu_nodes_only(path: Path) -> None:
    """A node's pool resource counts the replicas it can hold, one GPU each; the head has none."""
    config = _load(path)
    nodes = _node_resources(config)
    for name, have in nodes.items():
        pools = [pool for pool in POOLS if have.get(pool)]
        assert len(pools) <= 1, f"{path.name}: node {name} serves both pools: {have}"
        for pool in pools:
            assert have[pool] <= have.get("GPU", 0), f"{path.name}: {name} has {pool} > GPU: {have}"
    if "available_node_types" in config:
        head = nodes[config["head_node_type"]]
        assert not any(head.get(pool) for pool in POOLS), f"{path.name}: the head carries a pool: {head}"
        for pool in POOLS:
            assert any(have.get(pool) for have in nodes.values()), f"{path.name}: no {pool} node type"
    else:
        roles = {pool: sum(1 for have in nodes.values() if have.get(pool)) for pool in POOLS}
        assert all(roles.values()), f"{path.name}: every pool needs a worker: {roles}"


@pytest.mark.parametrize("path", GPU_CLUSTER_YAMLS, ids=lambda p: p.name)
def test_head_redis_is_the_one_serve_gpu_yaml_uses_and_not_the_gcs_port(path: Path) -> None:
    config = _load(path)
    start = " ".join(config["head_start_ray_commands"])
    redis_ports = {int(p) for p in re.findall(r"redis-server\s+--port\s+(\d+)", start)}
    gcs_ports = {int(p) for p in re.findall(r"ray start --head.*?--port=(\d+)", start)}
    assert gcs_ports == {RAY_GCS_PORT}
    redis_url = _pdserve_app(_load(REPO_ROOT / "deploy" / "serve.gpu.yaml"))["args"]["redis_url"]
    assert redis_ports == {urlsplit(redis_url).port}
    assert not redis_ports & gcs_ports
    setup = " ".join(config["head_setup_commands"])
    assert "systemctl disable --now redis-server" in setup  # the distro's Redis would take 6379


@pytest.mark.parametrize("path", GPU_CLUSTER_YAMLS, ids=lambda p: p.name)
def test_setup_installs_pdserve_from_the_mounted_repo(path: Path) -> None:
    config = _load(path)
    mount = next(remote for remote, local in config["file_mounts"].items() if local == ".")
    installs = [shlex.split(cmd) for cmd in config["setup_commands"] if cmd.startswith("pip install")]
    assert any(["-e", mount] == cmd[i : i + 2] for cmd in installs for i in range(len(cmd))), installs
    assert any(f"ray[default,serve]=={ray.__version__}" in cmd for cmd in installs), installs


# -- Serve YAMLs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SERVE_YAMLS, ids=lambda p: p.name)
def test_serve_yaml_passes_serve_schema_and_pdserve_args(path: Path, tiny_model_dir: str) -> None:
    serve_config = _load(path)
    ServeDeploySchema.model_validate(serve_config)
    app = _pdserve_app(serve_config)
    assert app["import_path"] == "deploy.builder:build_app"
    assert app["route_prefix"] == "/"
    assert "deployments" not in app  # pools are sized by args only: one source of truth
    args = PDServeArgs.model_validate({**app["args"], "model": tiny_model_dir})
    assert args.model == str(Path(tiny_model_dir).resolve())


def test_serve_dev_yaml_is_cpu_with_the_default_model(tiny_model_dir: str) -> None:
    app = _pdserve_app(_load(REPO_ROOT / "deploy" / "serve.dev.yaml"))
    assert app["args"]["model"] == "smollm2"  # resolved (pulled once) by PDServeArgs
    args = PDServeArgs.model_validate({**app["args"], "model": tiny_model_dir})
    assert args.device == "cpu"
    assert (args.prefill.replicas, args.decode.replicas) == (1, 1)
    assert args.prefill.num_gpus == args.decode.num_gpus == 0
    assert urlsplit(args.redis_url).port != RAY_GCS_PORT


def test_serve_gpu_yaml_pins_one_gpu_per_replica_to_its_pool(tiny_model_dir: str) -> None:
    args = PDServeArgs.model_validate(
        {**_pdserve_app(_load(REPO_ROOT / "deploy" / "serve.gpu.yaml"))["args"], "model": tiny_model_dir}
    )
    assert (args.prefill.num_gpus, args.decode.num_gpus) == (1, 1)
    assert args.prefill.resources == {"prefill": 1} and args.decode.resources == {"decode": 1}
    assert (args.dtype, args.transport, args.device) == ("bfloat16", "auto", "cuda")


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_serve_gpu_node_yaml_puts_both_pools_on_one_8_gpu_node_type(name: str, tiny_model_dir: str) -> None:
    """Both pools ask for the `pd` resource of the 8-GPU node type, a GPU a replica, and all
    their replicas fit one such node (deploy/placement.py's GPU count on that node)."""
    from deploy.placement import YAML, Capacity, check_gpus

    app = _pdserve_app(_load(REPO_ROOT / "deploy" / "serve.gpu-node.yaml"))
    args = PDServeArgs.model_validate({**app["args"], "model": tiny_model_dir})
    assert args.prefill.resources == args.decode.resources == {"pd": 1}
    nodes = _node_resources(_load(REPO_ROOT / "cluster" / name))
    (node,) = [have for have in nodes.values() if have.get("pd")]
    assert node["pd"] == node["GPU"] == 8
    assert args.prefill.replicas + args.decode.replicas == node["pd"]
    check_gpus(args, Capacity(node["CPU"], node["GPU"], None, f"a {name} gpu8 node"), YAML)
    cpus = args.prefill.replicas * args.prefill.num_cpus + args.decode.replicas * args.decode.num_cpus
    assert cpus <= node["CPU"]


# -- the testbed (cluster/testbed/: hosts as network namespaces on this machine) ----------------


def _run_testbed_commands(config: dict, kind: str, ip: str, home: Path) -> list[list[str]]:
    """Run `<kind>_start_ray_commands` as on host `ip`, with `hostname`, `ray`, `serve`, `redis-*`
    stubbed to print their arguments; returns each stubbed call's argv."""
    script = "; ".join(config[f"{kind}_start_ray_commands"])
    stubs = (
        'hostname() { echo "$STUB_IP "; }; '
        "for tool in ray serve redis-server; do "
        'eval "$tool() { printf CALL; printf \\" %q\\" $tool \\"\\$@\\"; echo; }"; done; '
        "redis-cli() { return 1; }; ulimit() { :; }; mkdir() { :; }; "
    )
    env = dict(os.environ, STUB_IP=ip, RAY_HEAD_IP=config["provider"]["head_ip"], PDTB_DIR="/tmp/pdtb", HOME=str(home))
    result = subprocess.run(["bash", "-c", stubs + script], env=env, capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, f"{kind} {ip}: {result.stderr}"
    return [shlex.split(line)[1:] for line in result.stdout.splitlines() if line.startswith("CALL ")]


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)


def test_testbed_yaml_addresses_are_the_testbeds_plan() -> None:
    from cluster.testbed import DEFAULT_PREFIX, DEFAULT_STATE_DIR, DEFAULT_SUBNET, plan_hosts

    config = _load(TESTBED_YAML)
    hosts = plan_hosts(DEFAULT_PREFIX, DEFAULT_SUBNET, 1, 1)
    assert config["provider"]["head_ip"] == hosts[0].ip
    assert config["provider"]["worker_ips"] == [h.ip for h in hosts[1:]]
    assert config["auth"]["ssh_private_key"] == f"{DEFAULT_STATE_DIR}/ssh/id_ed25519"
    assert config["file_mounts"] == {}  # one filesystem: nothing is copied, nothing reinstalled
    assert not any("pip install" in cmd for cmd in config["setup_commands"])  # never touch the shared venv


def test_testbed_head_runs_ray_redis_and_the_proxy_on_its_own_address(tmp_path: Path) -> None:
    from cluster.testbed import Testbed, plan_hosts

    config = _load(TESTBED_YAML)
    head = config["provider"]["head_ip"]
    calls = _run_testbed_commands(config, "head", head, tmp_path)
    assert calls[0] == ["ray", "stop"]  # the testbed's wrapper: this host's Ray only
    (redis,) = [c for c in calls if c[0] == "redis-server"]
    (ray_start,) = [c for c in calls if c[:3] == ["ray", "start", "--head"]]
    (serve_start,) = [c for c in calls if c[:2] == ["serve", "start"]]
    assert redis[redis.index("--port") + 1] == "6380" and redis[redis.index("--bind") + 1] == head
    flags = _flags(ray_start)
    assert flags["node-ip-address"] == head and int(flags["port"]) == RAY_GCS_PORT
    assert flags["temp-dir"] == f"/tmp/pdtb/ray/{head}"
    assert "autoscaling-config" not in flags  # no ~/ray_bootstrap_config.yaml: the testbed's own start
    (tmp_path / "ray_bootstrap_config.yaml").write_text("{}")  # as `ray up` leaves it
    again = [c for c in _run_testbed_commands(config, "head", head, tmp_path) if c[:3] == ["ray", "start", "--head"]]
    assert _flags(again[0])["autoscaling-config"] == f"{tmp_path}/ray_bootstrap_config.yaml"
    assert _flags(serve_start) == {
        "address": f"{head}:{RAY_GCS_PORT}",
        "http-host": head,
        "http-port": "8000",
        "proxy-location": "HeadOnly",
    }
    tb = Testbed(
        prefix="pdtb",
        subnet=head.rsplit(".", 1)[0],
        state_dir="/tmp/pdtb",
        rate="1gbit",
        venv="/v",
        hosts=plan_hosts("pdtb", head.rsplit(".", 1)[0], 1, 1),
        bridge="pdtb-br",
    )
    assert urlsplit(tb.redis_url).hostname == head and urlsplit(tb.redis_url).port == 6380


def test_testbed_workers_carry_their_pool_and_the_serve_config_fits_them(tmp_path: Path, tiny_model_dir: str) -> None:
    from cluster.testbed import Testbed, plan_hosts

    config = _load(TESTBED_YAML)
    head = config["provider"]["head_ip"]
    subnet = head.rsplit(".", 1)[0]
    tb = Testbed(
        prefix="pdtb",
        subnet=subnet,
        state_dir="/tmp/pdtb",
        rate="1gbit",
        venv="/v",
        hosts=plan_hosts("pdtb", subnet, 2, 2),
        bridge="pdtb-br",
    )
    serve_config = tb.serve_config(tiny_model_dir)
    ServeDeploySchema.model_validate(serve_config)
    args = PDServeArgs.model_validate(_pdserve_app(serve_config)["args"])
    assert (args.prefill.replicas, args.decode.replicas) == (2, 2) and args.redis_url == tb.redis_url
    for host in tb.hosts[1:]:
        commands = _run_testbed_commands(config, "worker", host.ip, tmp_path)
        (ray_start,) = [c for c in commands if c[:2] == ["ray", "start"]]
        flags = _flags(ray_start)
        assert flags["address"] == f"{head}:{RAY_GCS_PORT}" and flags["node-ip-address"] == host.ip
        resources = json.loads(flags["resources"])
        assert resources == {host.role: 1}, (host, resources)
        pool = getattr(args, host.role)
        assert pool.resources == resources and pool.num_cpus <= float(flags["num-cpus"]) and pool.num_gpus == 0
    stray = subprocess.run(
        [
            "bash",
            "-c",
            "hostname() { echo 10.231.0.30; }; ray() { :; }; " + "; ".join(config["worker_start_ray_commands"]),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, RAY_HEAD_IP=head, PDTB_DIR="/tmp/pdtb"),
        timeout=10,
    )
    assert stray.returncode == 1 and "not a testbed prefill" in stray.stderr


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_every_ray_start_runs_workers_at_niceness_0_and_serve_and_ray_at_pdserve_periods(path: Path) -> None:
    """Ray's raylet starts its workers at niceness 15 unless told: the engines would yield the CPU
    to Ray's own daemons (cluster/local.py's RAY_WORKER_NICENESS, the same for `pdserve up`).
    Serve's controller loop and metrics export run at cluster/local.py's SERVE_PERIODS_ENV, and
    Ray's own periodic work at its RAY_IDLE_CONFIG and LOG_MONITOR_ENV, as under `pdserve up`:
    every `ray start` carries exactly those assignments."""
    from cluster.local import LOG_MONITOR_ENV, RAY_WORKER_NICENESS, SERVE_PERIODS_ENV, ray_config_env

    config = _load(path)
    starts = [
        line
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for command in config.get(key, [])
        for line in command.split(";")
        if re.search(r"\bray start\b", line)
    ]
    assert len(starts) >= 2, starts  # the head's and the workers'
    expected = {
        "RAY_worker_niceness": str(RAY_WORKER_NICENESS),
        **SERVE_PERIODS_ENV,
        **ray_config_env(),
        **LOG_MONITOR_ENV,
    }
    for line in starts:
        prefix = re.match(r"\s*((?:\w+=\S+\s+)*)ray start\b", line)
        assert prefix is not None, line
        assignments = dict(word.split("=", 1) for word in prefix.group(1).split())
        assert assignments == expected, line
