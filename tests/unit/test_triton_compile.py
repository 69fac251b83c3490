"""pdserve's hand-written Triton kernels compile for an H100/H200 (sm_90) and fit its shared memory,
checked here without a GPU: Triton lowers them to a cubin with the ptxas its wheel carries. The
interpreter tests (test_triton_paged.py, test_triton_prefill.py, test_kv_checksum.py) check what
they compute; this checks what the interpreter cannot: Triton's typing and lowering, and the
resources a launch will ask for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
H100_SHARED = 232448  # bytes of shared memory one block may use on sm_90

pytest.importorskip("triton.backends.nvidia", reason="needs triton's NVIDIA backend (the test extra installs it)")


def test_every_triton_kernel_compiles_for_sm90_within_its_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "unit" / "triton_aot.py")],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kernels = {r["kernel"] for r in rows}
    assert {"prefill bf16 paged", "prefill fp16 dense", "prefill fp32 paged", "decode split bf16"} <= kernels
    assert {"decode split fp32", "decode combine bf16", "checksum"} <= kernels
    for r in rows:
        assert 0 <= r["shared"] <= H100_SHARED, r
