"""KV transfer across a host link: pdserve's pull between two testbed hosts (network namespaces
joined by a bridge, each link capped by `tc tbf`), side by side with raw gloo send/recv of one
contiguous tensor over the same link in the same run, as a fraction of the link rate (the
physical limit) and of raw gloo. Then (``--ttft``) TTFT and decode-start latency of a 2k-token
prompt through the whole app with prefill and decode on different hosts vs on the same host.

    python bench/link.py                                    # 1gbit and 100mbit, 16/64/256 MiB
    python bench/link.py --rates 1gbit --sizes-mib 16 64 --reps 2
    python bench/link.py --ttft --rates 1gbit               # + the app, cross-host vs same-host

Root on Linux (it makes its own testbed, prefix `pdtbl` on 10.231.2.0/24, and removes it at the
end, also on Ctrl-C). Transfer figures: the median of --reps timed repetitions after one warm-up,
timed on the receiving host from dispatching the request (one pipe hop, the same for the raw
baseline) until the data is in place, the two interleaved rep by rep; blocks scattered at random
on both sides, as in serving.
The rate counts every byte on the wire (Ethernet, IP and TCP headers too): with a 1500-byte MTU a
TCP stream's payload can reach at most ~95% of it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
PREFIX, SUBNET, STATE_DIR = "pdtbl", "10.231.2", "/tmp/pdtbl"
CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Move this process into network namespace `name` (what `ip netns exec` does)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{name}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name})")


# ---------------------------------------------------------------- the two hosts' processes


def sender_main(netns: str, ip: str, cfg: dict, parent, peer) -> None:
    """The prefill host: bench/transfer.py's sender, at the host's own address."""
    enter_netns(netns)
    from bench.transfer import sender_main as transfer_sender

    transfer_sender(parent, cfg, host=ip, node_id=netns, commands=peer)


def receiver_main(netns: str, ip: str, cfg: dict, hello: dict, parent, peer) -> None:
    """The decode host: pulls by block id (pdserve's client) and receives the raw baseline.
    Measures one size per command from the parent; replies with the medians."""
    enter_netns(netns)
    from bench.transfer import make_caches, raw_group, raw_tensor
    from workers.protocol import KVHandle, KVLayout, TransferAddress, decode, encode
    from workers.transfer import KVTransferClient, TransferConfig

    layout = KVLayout(**cfg["layout"])
    num_blocks = cfg["num_blocks"]
    caches = make_caches(layout, num_blocks, "cpu")
    address = decode(TransferAddress, hello["address"])
    client = KVTransferClient("link-decode", TransferConfig(transport="gloo", host=ip, node_id=netns))
    peer.send(("raw_init", cfg["max_bytes"]))
    raw_pg, _ = raw_group(address.host, hello["raw_port"], 1, "gloo", "cpu", bind_host=ip)
    dst_raw = raw_tensor(cfg["max_bytes"], "gloo", "cpu")
    rng = random.Random(0)
    parent.send("ready")
    while True:
        cmd, arg = parent.recv()
        if cmd == "stop":
            peer.send(("stop", None))
            return
        size, reps = arg
        nbytes = size * MIB
        n = nbytes // layout.bytes_per_block
        src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
        handle = KVHandle(
            f"link-{size}-{time.monotonic_ns()}",
            "link-prefill",
            address,
            tuple(src),
            n * layout.block_size,
            layout,
            time.time() + 3600,
        )

        # The closures bind this iteration's values (they run within it, but a late call would not).
        def raw(nbytes: int = nbytes) -> None:
            peer.send(("raw", nbytes))
            raw_pg.recv([dst_raw[:nbytes]], 0, 0).wait()

        def kv(handle: KVHandle = handle, dst: list[int] = dst) -> None:
            client.pull(handle, caches, dst, lambda req: peer.send(("kv", encode(req))), timeout_s=600)

        # Interleaved (raw, pdserve, raw, pdserve, ...) after one warm-up of each: on a shared
        # machine both see the same moments of load.
        raw(), kv()
        times: dict[str, list[float]] = {"raw_s": [], "kv_s": []}
        for _ in range(reps):
            for key, fn in (("raw_s", raw), ("kv_s", kv)):
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
        parent.send(
            {"size_mib": size, "blocks": n, **{k: statistics.median(v) for k, v in times.items()}, "samples": times}
        )


# ---------------------------------------------------------------- transfer throughput


def measure_link(tb, rates: list[str], sizes: list[int], reps: int, layout_args: dict, say) -> list[dict]:
    from dataclasses import asdict

    from workers.protocol import KVLayout

    layout = KVLayout(**layout_args)
    for size in sizes:
        if size * MIB % layout.bytes_per_block:
            raise SystemExit(f"{size} MiB is not a whole number of {layout.bytes_per_block}-byte blocks")
    max_blocks = max(sizes) * MIB // layout.bytes_per_block
    cfg = {
        "layout": asdict(layout),
        "num_blocks": max_blocks + max(max_blocks // 10, 4),
        "max_bytes": max(sizes) * MIB,
        "transport": "gloo",
        "sender_device": "cpu",
        "raw_backend": "gloo",
    }
    prefill, decode = tb.role("prefill")[0], tb.role("decode")[0]
    ctx = mp.get_context("spawn")
    to_sender, sender_end = ctx.Pipe()
    to_receiver, receiver_end = ctx.Pipe()
    peer_s, peer_r = ctx.Pipe()
    sender = ctx.Process(target=sender_main, args=(prefill.netns, prefill.ip, cfg, sender_end, peer_s), daemon=True)
    sender.start()
    hello = to_sender.recv()
    receiver = ctx.Process(
        target=receiver_main, args=(decode.netns, decode.ip, cfg, hello, receiver_end, peer_r), daemon=True
    )
    receiver.start()
    assert to_receiver.recv() == "ready"
    rows = []
    try:
        for rate in rates:
            for host in (prefill, decode):
                tb.set_rate(host, rate)
            for size in sizes:
                say(f"  {rate}: {size} MiB x {reps} (+1 warm-up), raw gloo then pdserve pull ...")
                to_receiver.send(("measure", (size, reps)))
                row = to_receiver.recv()
                row["rate"] = rate
                rows.append(row)
    finally:
        to_receiver.send(("stop", None))
        receiver.join(60)
        sender.join(60)
    return rows


def print_link(rows: list[dict], layout_args: dict, reps: int) -> None:
    from cluster.testbed import _rate_bits
    from workers.protocol import KVLayout

    layout = KVLayout(**layout_args)
    print(
        f"layout {layout} ({layout.bytes_per_block // 1024} KiB/block); median of {reps} after 1 warm-up; "
        "a link = tbf on both ends of one veth pair (MTU 1500)\n"
    )
    print(
        f"{'link':>8} {'MiB':>5} {'raw gloo Gbit/s':>16} {'pdserve Gbit/s':>15} {'pdserve/link':>13} "
        f"{'raw/link':>9} {'pdserve/raw':>12}"
    )
    for row in rows:
        link = _rate_bits(row["rate"]) / 1e9
        raw, kv = (row["size_mib"] * MIB * 8 / row[k] / 1e9 for k in ("raw_s", "kv_s"))
        row.update(raw_gbitps=raw, kv_gbitps=kv, kv_over_link=kv / link, raw_over_link=raw / link, kv_over_raw=kv / raw)
        print(
            f"{row['rate']:>8} {row['size_mib']:>5} {raw:>16.3f} {kv:>15.3f} {kv / link:>13.1%} "
            f"{raw / link:>9.1%} {kv / raw:>12.2f}"
        )


# ---------------------------------------------------------------- TTFT through the app


def ttft_run(tb, model: str, placement: str, prompts: list[list[int]], say) -> dict:
    """Deploy the app with decode on its own host (`cross`) or beside prefill (`same`), then
    stream each prompt: TTFT (request to first token) and decode start (first to second token:
    the hand-off, KV transfer included, and decode's first step)."""
    import httpx

    if placement == "cross":
        pools = {
            "prefill": {"replicas": 1, "num_cpus": 0.5, "resources": {"prefill": 1}},
            "decode": {"replicas": 1, "num_cpus": 0.5, "resources": {"decode": 1}},
        }
    else:  # both pools on the prefill host, which has 1 CPU: the same share each as above
        pools = {
            "prefill": {"replicas": 1, "num_cpus": 0.5, "resources": {"prefill": 0.5}},
            "decode": {"replicas": 1, "num_cpus": 0.5, "resources": {"prefill": 0.5}},
        }
    config = tb.serve_config(
        model, served_model_name="bench", num_kv_blocks=1024, transfer_timeout_s=30.0, max_model_len=4096, **pools
    )
    say(f"  deploying ({placement}: decode on {'its own host' if placement == 'cross' else 'the prefill host'}) ...")
    tb.deploy(config)
    base = tb.http_url
    rows = []
    for i, prompt in enumerate(prompts):
        # logprobs: every token's chunk goes out, even one whose text is still an incomplete character
        body = {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "return_timing": True,
            "stream_options": {"include_usage": True},
            "logprobs": 0,
        }
        times, timing = [], {}
        start = time.perf_counter()
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("logprobs"):
                    times += [time.perf_counter() - start] * len(chunk["choices"][0]["logprobs"]["tokens"])
                if chunk.get("usage"):
                    timing = chunk["usage"].get("timing") or {}
        if i == 0:
            continue  # warm-up: the pair group's first rendezvous
        rows.append(
            {
                "ttft_s": times[0],
                "decode_start_s": times[1] - times[0],
                "transfer_s": timing.get("transfer_s"),
                "transfer_bytes": timing.get("transfer_bytes"),
            }
        )
    med = {
        k: statistics.median(r[k] for r in rows if r[k] is not None)
        for k in rows[0]
        if any(r[k] is not None for r in rows)
    }
    return {"placement": placement, "runs": rows, **{f"median_{k}": v for k, v in med.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--no-transfer", action="store_true", help="skip the transfer throughput part")
    parser.add_argument("--ttft", action="store_true", help="also TTFT/decode start, cross-host vs same-host")
    parser.add_argument("--ttft-rate", default="1gbit")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=5, help="per placement, after one warm-up")
    parser.add_argument(
        "--model",
        help="model directory for --ttft (default: a tiny random llama with wide KV, "
        "4 layers x 8 KV heads x 32 dims fp32: 8 KiB a token)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from cluster.testbed import check_environment, down, up

    problem = check_environment()
    if problem:
        raise SystemExit(f"bench/link.py needs a testbed: {problem}")
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    layout_args = {
        "num_layers": args.layers,
        "block_size": args.block_size,
        "num_kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
    }
    result: dict = {"command": sys.argv}
    load_before = os.getloadavg()
    try:
        if not args.no_transfer:
            tb = up(PREFIX, SUBNET, 1, 1, rate=args.rates[0], state_dir=STATE_DIR, start_ray=False, sshd=False, say=say)
            result["link"] = measure_link(tb, args.rates, args.sizes_mib, args.reps, layout_args, say)
            down(PREFIX, STATE_DIR, say=say)
        if args.ttft:
            tb = up(
                PREFIX,
                SUBNET,
                1,
                1,
                rate=args.ttft_rate,
                state_dir=STATE_DIR,
                start_ray=True,
                sshd=False,
                timeout_s=300,
                say=say,
            )
            model = args.model
            if model is None:
                from workers.models.tiny import make_tiny_model

                model = str(
                    make_tiny_model(
                        Path(STATE_DIR) / "llama-wide",
                        arch="llama",
                        num_layers=4,
                        hidden_size=256,
                        num_heads=8,
                        num_kv_heads=8,
                        seed=0,
                        max_position_embeddings=4096,
                    )
                )
            rng = random.Random(1)
            prompts = [[rng.randrange(10, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.requests + 1)]
            result["ttft"] = [ttft_run(tb, model, placement, prompts, say) for placement in ("cross", "same")]
    finally:
        down(PREFIX, STATE_DIR, say=say)

    print(f"\ncommand: python {' '.join(sys.argv)}")
    print(
        f"host: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; load average before "
        f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}"
    )
    if "link" in result:
        print_link(result["link"], layout_args, args.reps)
    if "ttft" in result:
        print(
            f"\n{args.prompt_tokens}-token prompts, links {args.ttft_rate}, median of {args.requests} after 1 warm-up:"
        )
        print(f"{'placement':>10} {'TTFT s':>8} {'decode start s':>15} {'transfer s':>11} {'KV MiB':>7}")
        for run in result["ttft"]:
            mib = (run.get("median_transfer_bytes") or 0) / MIB
            transfer = run.get("median_transfer_s")
            print(
                f"{run['placement']:>10} {run['median_ttft_s']:>8.3f} {run['median_decode_start_s']:>15.3f} "
                f"{transfer if transfer is not None else float('nan'):>11.3f} {mib:>7.1f}"
            )
        cross, same = result["ttft"]
        print(
            f"cross/same: TTFT {cross['median_ttft_s'] / same['median_ttft_s']:.2f}x, decode start "
            f"{cross['median_decode_start_s'] / same['median_decode_start_s']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
