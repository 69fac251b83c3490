"""Child-process bodies for the KV transfer tests: a prefill peer, a decode peer, and the relay
(the test process) that plays the control plane between them over multiprocessing pipes.

Each peer fills its KV cache from a seed, so the test process can recompute any peer's blocks and
compare SHA-256 digests of the transferred bytes with the source's.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

from workers.protocol import KVHandle, KVLayout, TransferAddress, TransferRequest, decode, encode
from workers.transfer import KVCorruptError, KVTransferClient, KVTransferError, KVTransferServer, TransferConfig

NUM_BLOCKS = 1100
LAYOUTS = {
    "float32": KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32"),
    "bfloat16": KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16"),
    # Quantized caches: 17 rows per block (16 tokens + the scale row), one byte per element.
    "int8": KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="int8"),
    "float8_e4m3fn": KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float8_e4m3fn"),
}


def make_kv_caches(layout: KVLayout, num_blocks: int, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks) + layout.block_shape[1:]
    dtype = getattr(torch, layout.dtype)
    if layout.quantized:  # random bytes, scale rows included
        return [
            torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype).to(device)
            for _ in range(layout.num_layers)
        ]
    return [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(layout.num_layers)]


def block_digest(kv_caches: list[torch.Tensor], block_ids) -> str:
    """SHA-256 of the blocks' bytes, layer by layer, in the order given.

    Reads each block by plain indexing, not through the transfer layer's gather, so a bug there
    cannot cancel out between source and destination.
    """
    digest = hashlib.sha256()
    for cache in kv_caches:
        for block_id in block_ids:
            digest.update(cache[:, block_id].contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- prefill peer (rank 0)


def prefill_main(conn, worker_id: str, seed: int, config: dict, device: str = "cpu") -> None:
    caches = {name: make_kv_caches(layout, NUM_BLOCKS, seed, device) for name, layout in LAYOUTS.items()}
    server = KVTransferServer(worker_id, TransferConfig(**config), device=device)
    conn.send(encode(server.address))
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            server.close()
            return
        if cmd == "connect":
            server.connect(args["decode_worker_id"], args["epoch"], args["transport"], timeout_s=args["timeout_s"])
            conn.send(("connected", args["epoch"]))
            continue
        request = decode(TransferRequest, args["request"])
        if cmd == "connect_then_die":
            # Pair group up, then SIGKILL before the payload goes out.
            server.connect(request.decode_worker_id, request.epoch, request.transport, timeout_s=args["timeout_s"])
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.get("stall_s", 0.0))
        try:
            result = server.send(request, caches[request.layout.dtype], timeout_s=args["timeout_s"])
            conn.send(("sent", encode(result.stats)))
        except KVTransferError as exc:
            conn.send(("send_failed", str(exc)))


# ---------------------------------------------------------------- decode peer (rank 1)


def decode_main(conn, worker_id: str, seed: int, config: dict, device: str = "cpu") -> None:
    caches = {name: make_kv_caches(layout, NUM_BLOCKS, seed, device) for name, layout in LAYOUTS.items()}
    client = KVTransferClient(worker_id, TransferConfig(**config), device=device)
    free_blocks = set(range(NUM_BLOCKS))  # stands in for the decode engine's block manager
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            client.close()
            return
        if cmd == "connect":
            address = decode(TransferAddress, args["address"])
            epoch = client.connect(
                address,
                lambda worker, epoch, transport: conn.send(
                    ("connect_request", {"decode_worker_id": worker, "epoch": epoch, "transport": transport})
                ),
                timeout_s=args["timeout_s"],
            )
            conn.send(("connected", epoch))
            continue
        handle = decode(KVHandle, args["handle"])
        kv = caches[handle.layout.dtype]
        dst = list(args["dst"])
        others = sorted(set(range(NUM_BLOCKS)) - set(dst))
        before = block_digest(kv, others)
        assert set(dst) <= free_blocks
        free_blocks -= set(dst)  # allocate
        started = time.monotonic()
        try:
            stats = client.pull(
                handle,
                kv,
                dst,
                lambda req: conn.send(("send_request", encode(req))),
                src_block_ids=args.get("src"),
                timeout_s=args["timeout_s"],
            )
        except (KVTransferError, ValueError) as exc:
            elapsed = time.monotonic() - started
            free_blocks |= set(dst)  # the failure path frees every block it allocated
            kind = "pull_failed" if isinstance(exc, KVTransferError) else "rejected"
            failure = {"error": str(exc), "elapsed": elapsed, "freed": dst, "num_free": len(free_blocks)}
            if isinstance(exc, KVCorruptError):
                failure["corrupt_blocks"] = list(exc.blocks)
            conn.send((kind, failure))
            continue
        result = {
            "stats": encode(stats),
            "digest": block_digest(kv, dst),
            "others_untouched": block_digest(kv, others) == before,
        }
        free_blocks |= set(dst)  # the request finished
        result["num_free"] = len(free_blocks)
        conn.send(("pulled", result))


# ---------------------------------------------------------------- the test process side


@dataclass
class Peer:
    worker_id: str
    process: Any
    conn: Any
    address: TransferAddress | None = None

    def recv(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.worker_id} sent nothing for {timeout_s}s")
        return self.conn.recv()

    def request_stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass

    def stop(self) -> None:
        self.request_stop()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def start_peer(
    role: str, worker_id: str, seed: int, config: dict | None = None, device: str = "cpu", visible: str | None = None
) -> Peer:
    """``visible``: the peer's CUDA_VISIBLE_DEVICES (each peer then sees only its own GPUs, as Ray
    runs replicas); None: the parent's."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = prefill_main if role == "prefill" else decode_main
    process = ctx.Process(
        target=target, args=(child, worker_id, seed, config or {}, device), name=worker_id, daemon=True
    )
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # a spawned child starts with this environment
    try:
        process.start()
    finally:
        if visible is not None:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before
    child.close()
    return Peer(worker_id, process, parent)


def await_address(peer: Peer, timeout_s: float = 60.0) -> Peer:
    peer.address = decode(TransferAddress, peer.recv(timeout_s))
    return peer


def make_handle(
    prefill: Peer, request_id: str, src: list[int], dtype: str = "float32", lease_s: float = 60.0
) -> KVHandle:
    layout = LAYOUTS[dtype]
    return KVHandle(
        request_id,
        prefill.worker_id,
        prefill.address,
        tuple(src),
        len(src) * layout.block_size,
        layout,
        time.time() + lease_s,
    )


def relay_connect(prefill: Peer, decode: Peer, timeout_s: float = 10.0) -> tuple[int, int]:
    """Play the control plane for an eager connect; returns the epoch each side reports."""
    decode.conn.send(("connect", {"address": encode(prefill.address), "timeout_s": timeout_s}))
    kind, request = decode.recv(timeout_s + 30)
    assert kind == "connect_request", request
    prefill.conn.send(("connect", {**request, "timeout_s": timeout_s}))
    return decode.recv(timeout_s + 30)[1], prefill.recv(timeout_s + 30)[1]


def relay_pull(
    prefill: Peer,
    decode: Peer,
    handle: KVHandle,
    dst: list[int],
    *,
    timeout_s: float = 10.0,
    prefill_cmd: str = "send",
    stall_s: float = 0.0,
    wait_sender: bool = True,
) -> tuple[tuple[str, Any], tuple[str, Any] | None]:
    """Play the control plane for one pull; returns (decode's outcome, prefill's outcome)."""
    decode.conn.send(("pull", {"handle": encode(handle), "dst": dst, "timeout_s": timeout_s}))
    kind, request = decode.recv(timeout_s + 30)
    if kind != "send_request":
        return (kind, request), None
    prefill.conn.send((prefill_cmd, {"request": request, "timeout_s": timeout_s, "stall_s": stall_s}))
    outcome = decode.recv(timeout_s + 30)
    sender = prefill.recv(timeout_s + stall_s + 30) if wait_sender else None
    return outcome, sender


class ObjectStorePrefill:
    """The prefill side as a Ray actor, for the object-store fallback (wrap with ray.remote)."""

    def __init__(self, worker_id: str, seed: int) -> None:
        self.caches = {name: make_kv_caches(layout, NUM_BLOCKS, seed) for name, layout in LAYOUTS.items()}
        self.server = KVTransferServer(worker_id, TransferConfig(transport="object_store"))

    def address(self) -> TransferAddress:
        return self.server.address

    def send(self, request: TransferRequest):
        return self.server.send(request, self.caches[request.layout.dtype])
