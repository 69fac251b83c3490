"""The CUDA backend (``backend.py``) and its Triton kernels (``triton_*.py``)."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (asked once: the kernels' callers ask on every step)."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True
