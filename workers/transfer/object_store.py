"""Fallback transport through the Ray object store: ``ray.put`` on the sender, ``ray.get`` on the
receiver, the reference travelling back through the control plane.

For platforms with no working process group, and the baseline of the transfer benchmark. Ray is
imported only here, and only when this transport is used.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from workers.protocol import KVLayout
from workers.transfer.buffers import buffer_shape, gather_blocks


def put_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], layout: KVLayout) -> Any:
    """Gather the blocks into one host buffer and put it in the object store; returns the ref.

    The buffer is stored as a flat uint8 numpy array, which Ray stores and maps without pickling
    a tensor (and which works for dtypes numpy lacks, like bfloat16).
    """
    import ray

    gathered = torch.empty(buffer_shape(layout, len(block_ids)), dtype=kv_caches[0].dtype, device=kv_caches[0].device)
    gather_blocks(kv_caches, block_ids, gathered)
    host = gathered.cpu() if gathered.is_cuda else gathered
    return ray.put(host.view(-1).view(torch.uint8).numpy())


def fetch_blocks(payload: Any, layout: KVLayout, num_blocks: int, dtype: torch.dtype, deadline: float) -> torch.Tensor:
    """Resolve what the control plane returned into the transfer buffer, within ``deadline``.

    ``payload`` may be the buffer's ref, an object with an ``object_ref`` attribute (the sender's
    ``SendResult``), or a Ray ref resolving to either: refs are followed until the buffer.
    """
    import ray

    while True:
        if hasattr(payload, "object_ref"):
            payload = payload.object_ref
        elif isinstance(payload, ray.ObjectRef):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed waiting for the object store")
            payload = ray.get(payload, timeout=left)
        else:
            break
    expected = layout.bytes_per_block * num_blocks
    if getattr(payload, "nbytes", None) != expected:
        raise ValueError(
            f"object store payload is {getattr(payload, 'nbytes', type(payload).__name__)} bytes; "
            f"{num_blocks} blocks of this layout are {expected}"
        )
    with warnings.catch_warnings():  # the mapped array is read-only; we only read it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(payload)
    return flat.view(dtype).view(buffer_shape(layout, num_blocks))
