"""Torch's CPU threads in a process that also runs helper threads.

torch parallelises CPU ops with OpenMP, and libgomp keeps a pool of worker threads for each OS
thread that starts a parallel region. Once it manages more threads than the process may use
CPUs, it stops spinning between parallel regions: its workers sleep and wake on every op, which
slows a decode step markedly (docs/decisions/0012-one-openmp-pool-per-engine.md). So an engine runs
all its CPU work on one thread (it is built on its loop's thread), and helper threads that touch
tensors start with ``one_torch_thread``.
"""

from __future__ import annotations

import torch


def one_torch_thread() -> None:
    """A helper thread's initializer: its torch ops run on it alone, so it never starts an
    OpenMP pool beside the engine thread's (a new thread otherwise takes the thread count last
    set anywhere in the process: the engine's)."""
    torch.set_num_threads(1)
