"""`pdserve up` layouts on this machine, as a new user tries them: tensor-parallel pools that fit
two cores come up and serve transformers' greedy text through the openai client; a layout that
cannot fit is refused before anything starts, naming the flags; and on a Ray cluster with (fake)
GPUs every replica gets its own GPU, while more replicas than GPUs are refused by name."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile

import httpx
import openai
import pytest

from tests.integration.test_cli_up import Up, _check_clean, _until
from tests.integration.test_faults import expected_text
from tests.redis_server import find_redis_server, free_port

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed"),
]
PROMPT = list(range(5, 45))
NEW_TOKENS = 12


@pytest.mark.parametrize(
    "flags",
    [("--prefill-tp", "2", "--decode-tp", "1"), ("--prefill-tp", "1", "--decode-tp", "2")],
    ids=["p2d1", "p1d2"],
)
def test_tensor_parallel_pools_fit_this_machine_and_serve_exact_text(tiny_llama, flags):
    port = free_port()
    up = Up("--model", tiny_llama, "--served-model-name", "tiny", "--port", str(port), *flags)
    try:
        layout = up.wait_for("layout:", 120)
        assert "ingress x1" in layout and "x 2 ranks" in layout
        up.wait_for("pdserve is up", 300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
        assert out.choices[0].text == expected_text(tiny_llama, PROMPT, NEW_TOKENS)
        assert up.ctrl_c() == 0, up.output
    finally:
        up.close()
    assert not [line for line in up.lines if "to be scheduled" in line], up.output
    _check_clean(up)


def test_a_layout_this_machine_cannot_hold_is_refused_before_anything_starts(tiny_llama):
    cores = len(os.sched_getaffinity(0))
    replicas = str(cores + 2)  # prefill (cores + 2) x 2 ranks + decode (cores + 2): over 2 ranks a core
    up = Up("--model", tiny_llama, "--prefill", replicas, "--decode", replicas, "--prefill-tp", "2")
    try:
        assert up.proc.wait(timeout=120) == 2, up.output
    finally:
        up.close()
    refusal = up.wait_for("pdserve up:", 1)
    assert "engine ranks" in refusal and f"at most {2 * cores}" in refusal
    for flag in ("--prefill", "--decode", "--prefill-tp", "--decode-tp"):
        assert flag in refusal
    assert not [line for line in up.lines if "Ray started" in line or "Redis started" in line], up.output


@pytest.fixture
def fake_gpu_cluster(monkeypatch):
    """A Ray head of its own with 8 GPUs it does not have (Ray assigns their ids and sets
    CUDA_VISIBLE_DEVICES per replica all the same), on loopback, without token authentication
    (a token another test's Ray wrote would not be this head's). ``ray start --block`` in its
    own session: stopping it stops this head alone (``ray stop`` would stop every Ray here)."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="pdserve-fakegpu-")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # for the head and for the pdserve up runs
    env = {**os.environ, "RAY_ADDRESS": ""}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
         "--num-cpus=4", "--num-gpus=8", f"--temp-dir={temp}", "--include-dashboard=false"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        address = f"127.0.0.1:{port}"
        assert _until(lambda: _gcs_answers(address), 120), "the fake-GPU Ray head did not start"
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)


def _gcs_answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def test_replicas_get_their_own_gpus_and_more_than_there_are_is_refused(tiny_llama, fake_gpu_cluster):
    refused = Up("--model", tiny_llama, "--ray-address", fake_gpu_cluster, "--device", "cpu",
                 "--gpus-per-replica", "1", "--prefill", "5", "--decode", "4")  # fmt: skip
    try:
        assert refused.proc.wait(timeout=180) == 2, refused.output
    finally:
        refused.close()
    message = refused.wait_for("pdserve up:", 1)
    assert "asks for 9 GPUs" in message and "has 8" in message and "--gpus-per-replica" in message

    port = free_port()
    up = Up("--model", tiny_llama, "--served-model-name", "tiny", "--port", str(port),
            "--ray-address", fake_gpu_cluster, "--device", "cpu", "--gpus-per-replica", "1",
            "--prefill", "2", "--decode", "2")  # fmt: skip
    try:
        up.wait_for("pdserve is up", 300)  # a replica of each pool; the others may still start

        def replicas() -> list[dict]:
            status = httpx.get(f"http://127.0.0.1:{port}/v1/cluster/status", timeout=30).json()
            return [r for pool in ("prefill", "decode") for r in status["pools"][pool]]

        assert _until(lambda: len(found := replicas()) == 4 and all(r["healthy"] for r in found), 180), replicas()
        found = replicas()
        ids = [tuple(r["gpu_ids"]) for r in found]
        assert all(len(i) == 1 for i in ids) and len(set(ids)) == 4, ids  # one GPU each, all different
        out = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0},
            timeout=120,
        ).json()
        assert out["choices"][0]["text"] == expected_text(tiny_llama, PROMPT, NEW_TOKENS)
        assert up.ctrl_c() == 0, up.output
    finally:
        up.close()
