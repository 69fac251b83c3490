"""glibc's malloc, set for an engine's CPU tensors.

torch takes CPU tensors from malloc. glibc serves a block over its mmap threshold (128 KiB at
first, raised as such blocks are freed, never past 32 MiB) with a fresh ``mmap`` and unmaps it
on free, and it gives the top of its heap back to the kernel once more than the trim threshold
is free there. A prefill's activations are MiBs each (8 x 256 tokens: the MLP's input to the
down projection is 12.5 MB), made and dropped 30 times a step, so either path means the kernel
faults in and zeroes the same pages again on every layer, a sizeable share of a prefill step's
time (docs/decisions/0013-glibc-malloc-thresholds.md).

``keep_freed_memory`` sets both thresholds once per process, as vLLM's CPU images get the same
effect from tcmalloc: blocks up to 32 MiB come from the heap and freed memory stays mapped for
the next step. What stays is the largest step's working set, small beside the KV cache. An
operator who sets glibc's malloc variables or preloads another allocator keeps that choice.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2); a larger value is refused
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: in effect, never trim
_OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the thresholds above (once per process); True when they are in force."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in os.environ for name in _OPERATOR_SETTINGS) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        logger.info("malloc: glibc's malloc settings come from the environment; left as they are")
        return False
    if "malloc" in preload:  # jemalloc, tcmalloc: their own reuse, no glibc thresholds to set
        logger.info("malloc: %s is preloaded; left as it is", preload)
        return False
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        logger.warning("malloc: glibc refused the thresholds; big CPU tensors page-fault on every allocation")
        return False
    logger.info(
        "malloc: CPU tensors up to %d MiB reuse freed memory (no mmap or trim per allocation)", MMAP_THRESHOLD >> 20
    )
    return True
