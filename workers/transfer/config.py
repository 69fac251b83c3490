"""Transfer configuration: which transport moves KV blocks, where to listen, and deadlines."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from workers.protocol import Transport


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Per-worker transfer settings; both kinds of worker take the same config.

    ``host`` is the address this worker is reachable at: the prefill side hosts its rendezvous
    store there, and both sides bind their gloo sockets to it. On a multi-node cluster set it to
    the node IP. ``node_id`` names the machine (Ray node id; hostname when empty) so ``AUTO`` can
    tell that two ranks share a GPU. CPU gather buffers up to ``buffer_cache_bytes`` are kept per
    pair and reused (fresh pages cost as much as the copy). ``checksum``: the decode side asks for
    every transferred block's checksum and verifies it on receipt (``checksum.py``); a mismatch
    fails the transfer, which decode then recomputes. ``fault_corrupt_bytes`` (tests only): the
    sending side flips this many random bytes of each message after checksumming it.
    """

    transport: Transport = Transport.AUTO
    host: str = "127.0.0.1"
    port: int = 0
    node_id: str = ""
    connect_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    buffer_cache_bytes: int = 512 << 20
    checksum: bool = True
    fault_corrupt_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "transport", Transport(self.transport))
        if not self.node_id:
            object.__setattr__(self, "node_id", socket.gethostname())
        for name in ("connect_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"TransferConfig.port {self.port} is not a TCP port (0 picks a free one)")
