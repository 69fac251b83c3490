"""Moving KV blocks from a prefill worker to a decode worker.

``KVTransferServer`` (prefill side) hosts a rendezvous store and sends blocks; ``KVTransferClient``
(decode side) pulls them into blocks it allocated, over a 2-rank process group per worker pair
(gloo for CPU tensors, NCCL or gloo-over-pinned-memory for CUDA), or through the Ray object store.
``LeaseTable`` holds a request's prefill blocks until decode claims them or the lease expires.
This package never imports the engine; Ray only for the object-store transport.
"""

from workers.transfer.buffers import gather_blocks, layout_of, scatter_blocks
from workers.transfer.client import KVTransferClient, transfer_tag
from workers.transfer.config import TransferConfig, Transport
from workers.transfer.errors import KVCorruptError, KVTransferError
from workers.transfer.lease import Lease, LeaseTable
from workers.transfer.server import KVTransferServer, SendResult

__all__ = [
    "KVCorruptError",
    "KVTransferClient",
    "KVTransferError",
    "KVTransferServer",
    "Lease",
    "LeaseTable",
    "SendResult",
    "TransferConfig",
    "Transport",
    "gather_blocks",
    "layout_of",
    "scatter_blocks",
    "transfer_tag",
]
