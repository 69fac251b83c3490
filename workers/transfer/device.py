"""Which device a worker's KV cache lives on, and which transport a pair of workers must use."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.protocol import TransferAddress
from workers.transfer.config import Transport


def nccl_available() -> bool:
    return hasattr(dist, "ProcessGroupNCCL") and torch.cuda.is_available()


def device_address(host: str, port: int, worker_id: str, node_id: str, device: torch.device) -> TransferAddress:
    """The address a prefill worker advertises, with the identity of the GPU it sends from."""
    if device.type != "cuda":
        return TransferAddress(host, port, worker_id, node_id, "cpu", 0, "")
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return TransferAddress(host, port, worker_id, node_id, "cuda", index, uuid)


def same_gpu(local: TransferAddress, peer: TransferAddress) -> bool:
    if local.device_type != "cuda" or peer.device_type != "cuda" or local.node_id != peer.node_id:
        return False
    if local.device_uuid and peer.device_uuid:
        return local.device_uuid == peer.device_uuid
    return local.device_index == peer.device_index


def resolve_transport(requested: Transport, local: TransferAddress, peer: TransferAddress) -> Transport:
    """The concrete transport for one pair; the decode side decides and the request carries it.

    Both ranks must hold tensors of the same kind: gloo moves CPU tensors, NCCL CUDA tensors.
    """
    if local.device_type != peer.device_type:
        raise ValueError(
            f"KV cache on {local.device_type} here but on {peer.device_type} on worker "
            f"{peer.worker_id}: run prefill and decode pools on the same kind of device"
        )
    if requested is Transport.OBJECT_STORE:
        return requested
    if local.device_type == "cpu":
        if requested is Transport.NCCL:
            raise ValueError("transport 'nccl' needs CUDA KV caches; use 'gloo' or 'auto' on CPU")
        return Transport.GLOO
    if requested in (Transport.GLOO, Transport.GLOO_STAGED):
        return Transport.GLOO_STAGED
    shared = same_gpu(local, peer)
    if requested is Transport.NCCL:
        if shared:
            raise ValueError(
                f"transport 'nccl' between two ranks on one GPU ({local.device_uuid or local.device_index}"
                f" on {local.node_id}) is refused by NCCL: use 'gloo_staged' or 'auto'"
            )
        if not nccl_available():
            raise ValueError("transport 'nccl' requested but this torch build has no NCCL")
        return requested
    return Transport.GLOO_STAGED if shared or not nccl_available() else Transport.NCCL
