"""KV transfer benchmark: pulling scattered blocks between two processes, side by side with
(a) raw process-group send/recv of one contiguous tensor of the same size, (b) a local memcpy
(``dst.copy_(src)``), and (c) the Ray object-store fallback, all measured in one run; and the
block checksums' cost: the same pull without them (its own pair group), the two interleaved rep
by rep, and what a second pass of XXH3 over the buffer on each side would add (where the
``xxhash`` package is installed: the library alternative to checksums folded into the copies).

    python bench/transfer.py                              # CPU: gloo over loopback
    python bench/transfer.py --device cuda                # NCCL (2 GPUs) or gloo_staged (1 GPU)
    python bench/transfer.py --sizes-mib 1 16 --reps 3 --no-object-store

Each figure is the median of --reps timed repetitions after one warm-up, timed on the receiver
from dispatching the request (one pipe hop, the same for the raw baseline) until the data is in
place. Blocks are picked at random from a cache 10% larger than the payload, so source and
destination ids differ and are scattered, as in serving.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.protocol import KVHandle, KVLayout, TransferAddress, TransferRequest, decode, encode  # noqa: E402
from workers.transfer import (  # noqa: E402
    KVTransferClient,
    KVTransferServer,
    TransferConfig,
    Transport,
)
from workers.transfer.pair import new_process_group  # noqa: E402

MIB = 1 << 20


def make_caches(layout: KVLayout, num_blocks: int, device: str) -> list[torch.Tensor]:
    shape = (2, num_blocks) + layout.block_shape[1:]
    return [torch.randn(shape, device=device).to(getattr(torch, layout.dtype)) for _ in range(layout.num_layers)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def raw_group(host: str, port: int, rank: int, backend: str, device: str, bind_host: str | None = None):
    """A plain 2-rank group for the baseline (its store hosted by the sender at `host`; gloo binds
    to `bind_host`, default `host`): no gather, no scatter."""
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    pg = new_process_group(
        dist.PrefixStore("raw", store),
        rank,
        2,
        backend,
        datetime.timedelta(seconds=60),
        bind_host=bind_host or host,
        device=torch.device(device),
    )
    return pg, store


def raw_tensor(nbytes: int, backend: str, device: str) -> torch.Tensor:
    if backend == "nccl":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))


# ---------------------------------------------------------------- sender process (prefill)


def sender_main(conn, cfg: dict, host: str = "127.0.0.1", node_id: str = "", commands=None) -> None:
    """The prefill side: a KVTransferServer and the raw baseline's rank 0, both at `host`.
    Says hello on `conn`, then takes commands on `commands` (default: `conn`)."""
    layout = KVLayout(**cfg["layout"])
    device = cfg["sender_device"]
    caches = make_caches(layout, cfg["num_blocks"], device)
    server = KVTransferServer(
        "bench-prefill", TransferConfig(transport=cfg["transport"], host=host, node_id=node_id), device=device
    )
    raw_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    conn.send({"address": encode(server.address), "raw_port": raw_store.port})
    commands = commands or conn
    pg, raw_src = None, None
    while True:
        cmd, arg = commands.recv()
        if cmd == "stop":
            server.close()
            return
        if cmd == "raw_init":
            pg, _ = raw_group(host, raw_store.port, 0, cfg["raw_backend"], device)
            raw_src = raw_tensor(arg, cfg["raw_backend"], device).random_(0, 255)
        elif cmd == "raw":
            pg.send([raw_src[:arg]], 1, 0).wait()
            sync(device)
        elif cmd == "kv":
            server.send(decode(TransferRequest, arg), caches, timeout_s=600)


class ObjectStorePrefill:
    """The sender as a Ray actor, for the object-store fallback."""

    def __init__(self, cfg: dict) -> None:
        self.layout = KVLayout(**cfg["layout"])
        self.caches = make_caches(self.layout, cfg["num_blocks"], cfg["sender_device"])
        self.server = KVTransferServer(
            "bench-prefill-ray", TransferConfig(transport="object_store"), device=cfg["sender_device"]
        )

    def address(self) -> dict:
        return encode(self.server.address)

    def send(self, request: TransferRequest):
        return self.server.send(request, self.caches, timeout_s=120)


# ---------------------------------------------------------------- receiver (this process)


def timed(fn, reps: int, device: str) -> float:
    fn()  # warm-up: pair groups, buffers, page faults
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_pair(a, b, reps: int, device: str) -> tuple[float, float]:
    """Medians of ``a`` and ``b`` run alternately, in ABBA order (after a warm-up of each): a slow
    spell of the machine falls on both, and so does whatever one leaves running for the next (an
    OpenMP team spinning after aten's copies)."""
    a()
    b()
    sync(device)
    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(reps):
        order = ((a, times[0]), (b, times[1])) if rep % 2 == 0 else ((b, times[1]), (a, times[0]))
        for fn, out in order:
            start = time.perf_counter()
            fn()
            sync(device)
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def xxh3_pass_s(nbytes: int, reps: int) -> float | None:
    """One XXH3-64 pass over ``nbytes`` on the host (None without the xxhash package)."""
    try:
        import xxhash
    except ImportError:
        return None
    data = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255).numpy().tobytes()
    return timed(lambda: xxhash.xxh3_64_intdigest(data), reps, "cpu")


def pick_transport(args) -> tuple[str, str, str]:
    """(transport, sender device, raw baseline backend)."""
    if args.device == "cpu":
        return "gloo", "cpu", "gloo"
    if torch.cuda.device_count() >= 2 and args.transport != "gloo_staged":
        return "nccl", "cuda:1", "nccl"
    return "gloo_staged", "cuda:0", "gloo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--transport",
        choices=["auto", "gloo_staged"],
        default="auto",
        help="on CUDA: auto = NCCL across two GPUs, gloo_staged on one",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--no-object-store", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    layout = KVLayout(args.layers, args.block_size, args.kv_heads, args.head_dim, args.dtype)
    for size in args.sizes_mib:
        if size * MIB % layout.bytes_per_block:
            parser.error(f"{size} MiB is not a whole number of {layout.bytes_per_block}-byte blocks")
    max_blocks = max(args.sizes_mib) * MIB // layout.bytes_per_block
    num_blocks = max_blocks + max(max_blocks // 10, 4)
    transport, sender_device, raw_backend = pick_transport(args)
    receiver_device = "cuda:0" if args.device == "cuda" else "cpu"
    cfg = {
        "layout": asdict(layout),
        "num_blocks": num_blocks,
        "transport": transport,
        "sender_device": sender_device,
        "raw_backend": raw_backend,
    }

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    sender = ctx.Process(target=sender_main, args=(child_conn, cfg), daemon=True)
    sender.start()
    hello = conn.recv()
    address = decode(TransferAddress, hello["address"])
    caches = make_caches(layout, num_blocks, receiver_device)
    client = KVTransferClient("bench-decode", TransferConfig(transport=transport), device=receiver_device)
    plain = KVTransferClient(
        "bench-decode-plain", TransferConfig(transport=transport, checksum=False), device=receiver_device
    )
    rng = random.Random(0)

    conn.send(("raw_init", max(args.sizes_mib) * MIB))
    raw_pg, _ = raw_group("127.0.0.1", hello["raw_port"], 1, raw_backend, receiver_device)
    raw_dst = raw_tensor(max(args.sizes_mib) * MIB, raw_backend, receiver_device)

    rows = []
    for size in args.sizes_mib:
        nbytes = size * MIB
        n = nbytes // layout.bytes_per_block
        src = rng.sample(range(num_blocks), n)
        dst = rng.sample(range(num_blocks), n)
        handle = KVHandle(
            f"bench-{size}", "bench-prefill", address, tuple(src), n * layout.block_size, layout, time.time() + 3600
        )
        memcpy_src = torch.empty(nbytes, dtype=torch.uint8, device=receiver_device).random_(0, 255)
        memcpy_dst = torch.empty_like(memcpy_src)

        # The closures bind this iteration's values (they run within it, but a late call would not).
        def raw(nbytes: int = nbytes) -> None:
            conn.send(("raw", nbytes))
            raw_pg.recv([raw_dst[:nbytes]], 0, 0).wait()

        def kv(handle: KVHandle = handle, dst: list[int] = dst, client: KVTransferClient = client) -> None:
            client.pull(handle, caches, dst, lambda req: conn.send(("kv", encode(req))), timeout_s=120)

        plain_s, kv_s = timed_pair(lambda: kv(client=plain), kv, args.reps, receiver_device)
        row = {
            "size_mib": size,
            "blocks": n,
            "memcpy_s": timed(lambda d=memcpy_dst, s=memcpy_src: d.copy_(s), args.reps, receiver_device),
            "raw_s": timed(raw, args.reps, receiver_device),
            "kv_s": kv_s,
            "kv_plain_s": plain_s,
            "xxh3_s": xxh3_pass_s(nbytes, args.reps),
        }
        rows.append(row)
        print(f"  measured {size} MiB", file=sys.stderr, flush=True)
    conn.send(("stop", None))
    sender.join(30)

    if not args.no_object_store:
        import ray

        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
        actor = ray.remote(ObjectStorePrefill).remote(cfg)
        obj_address = decode(TransferAddress, ray.get(actor.address.remote()))
        obj_client = KVTransferClient(
            "bench-decode-ray", TransferConfig(transport=Transport.OBJECT_STORE), device=receiver_device
        )
        for row in rows:
            n = row["blocks"]
            src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
            handle = KVHandle(
                f"bench-obj-{n}",
                "bench-prefill-ray",
                obj_address,
                tuple(src),
                n * layout.block_size,
                layout,
                time.time() + 3600,
            )
            row["object_store_s"] = timed(
                lambda handle=handle, dst=dst: obj_client.pull(
                    handle, caches, dst, lambda req: actor.send.remote(req), timeout_s=120
                ),
                args.reps,
                receiver_device,
            )
        ray.shutdown()

    print(f"\ncommand: python {' '.join(sys.argv)}")
    print(
        f"host: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
        f"device {args.device}, transport {transport}, raw baseline {raw_backend}; layout {layout} "
        f"({layout.bytes_per_block // 1024} KiB/block); median of {args.reps} after 1 warm-up\n"
    )
    header = (
        f"{'MiB':>5} {'blocks':>6} {'memcpy GB/s':>12} {'raw GB/s':>9} {'kv GB/s':>8} {'kv/raw':>7} {'kv/memcpy':>9}"
        f" {'no-sum GB/s':>11} {'checksums':>9} {'xxh3 x2':>8}"
    )
    if not args.no_object_store:
        header += f" {'objstore GB/s':>14} {'obj/raw':>8}"
    print(header)
    for row in rows:
        gbps = {
            k: row["size_mib"] * MIB / row[f"{k}_s"] / 1e9
            for k in ("memcpy", "raw", "kv", "kv_plain", "object_store")
            if f"{k}_s" in row
        }
        line = (
            f"{row['size_mib']:>5} {row['blocks']:>6} {gbps['memcpy']:>12.2f} {gbps['raw']:>9.2f} "
            f"{gbps['kv']:>8.2f} {gbps['kv'] / gbps['raw']:>7.2f} {gbps['kv'] / gbps['memcpy']:>9.2f}"
            f" {gbps['kv_plain']:>11.2f} {row['kv_s'] / row['kv_plain_s'] - 1:>+9.1%}"
        )
        # a second pass on each side, against the pull without checksums
        line += f" {2 * row['xxh3_s'] / row['kv_plain_s']:>+8.1%}" if row["xxh3_s"] else f" {'-':>8}"
        if "object_store" in gbps:
            line += f" {gbps['object_store']:>14.2f} {gbps['object_store'] / gbps['raw']:>8.2f}"
        print(line)
        row.update({f"{k}_gbps": v for k, v in gbps.items()})
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "transport": transport, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
