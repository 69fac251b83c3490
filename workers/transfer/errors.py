"""The one error a KV transfer raises, whatever went wrong underneath."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A transfer failed or missed its deadline; the pair group it used has been torn down.

    The caller still owns the destination blocks it allocated and must free them (decode then
    recomputes the prompt). ``peer_id`` is the other worker, ``request_id`` the request ("" for a
    connect).
    """

    def __init__(self, message: str, *, peer_id: str, request_id: str = "") -> None:
        super().__init__(message)
        self.peer_id = peer_id
        self.request_id = request_id


class KVCorruptError(KVTransferError):
    """Blocks arrived whose checksum differs from the sender's: ``blocks`` are their positions
    in the transfer's order. The bytes are in the destination blocks; the caller frees them."""

    def __init__(self, message: str, *, peer_id: str, request_id: str = "", blocks: tuple[int, ...] = ()) -> None:
        super().__init__(message, peer_id=peer_id, request_id=request_id)
        self.blocks = blocks
