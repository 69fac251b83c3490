"""glibc's malloc thresholds for CPU tensors (``workers.cpu_memory``): a big tensor comes from
the heap once they are set, from a fresh mmap without them, and an operator's own malloc
settings are left alone. Each case runs in a fresh interpreter: the thresholds are per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

PROBE = r"""
import ctypes, json, sys
import torch
from workers.backends.cpu.memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory() if sys.argv[1] == "apply" else None
again = keep_freed_memory() if sys.argv[1] == "apply" else None
before = libc.mallinfo2().hblkhd
t = torch.empty(20 << 20, dtype=torch.uint8)  # 20 MiB: over glibc's first mmap threshold
mapped = libc.mallinfo2().hblkhd - before
del t

kept = {}
def step_on_a_thread():  # an engine steps on a thread of its own, which malloc gives its own arena
    arena = lambda: libc.mallinfo2().arena  # bytes in the arenas' heaps (mmapped blocks apart)
    start = arena()
    tensors = [torch.ones(24 << 20, dtype=torch.uint8) for _ in range(4)]  # 96 MiB: over one 64 MiB heap
    grown = arena() - start
    del tensors
    kept.update(grown=grown, kept=arena() - start)
import threading
worker = threading.Thread(target=step_on_a_thread)
worker.start()
worker.join()
print(json.dumps({"applied": applied, "again": again, "mapped": mapped, **kept}))
"""


def probe(mode: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_big_tensor_comes_from_the_heap_once_the_thresholds_are_set():
    result = probe("apply")
    assert (result["applied"], result["again"], result["mapped"]) == (True, True, 0)


def test_a_threads_freed_heaps_stay_mapped_for_the_next_step():
    result = probe("apply")
    assert result["grown"] >= 80 << 20  # 96 MiB from the thread's heaps (some was free there), not mmap
    assert result["kept"] >= result["grown"]  # freed and still mapped: the next step faults nothing in


def test_without_them_the_same_tensors_are_fresh_mappings():
    result = probe("none")
    assert result["mapped"] >= 20 << 20 and result["grown"] < 24 << 20


def test_an_operators_own_malloc_settings_are_kept():
    result = probe("apply", MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    assert result["applied"] is False and result["mapped"] >= 20 << 20  # still glibc's 1 MiB rule
