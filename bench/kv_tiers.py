"""KV tiers: prefixes larger than the device KV pool, served with host/disk tiers and without.

    python bench/kv_tiers.py [--tenants 32] [--system-len 1024] [--device-room 8] [--requests 96]

Two workloads on one engine process (LLMEngine, no HTTP: what is measured is the engine and its
tiers), each run with tiers off, a host tier, and a disk tier only, in the same run:

- **many tenants**: ``--tenants`` system prompts of ``--system-len`` tokens, each computed once
  before the measured requests (a service that has run a while); the device pool has room for
  ``--device-room`` of them (plus the running requests' own tokens). Each request is a
  tenant's system prompt plus ``--user-len`` fresh tokens, the tenant drawn from a Zipf law
  (``--zipf``); ``--concurrency`` requests in flight, each generating ``--max-tokens`` tokens
  (ignore_eos); or, with ``--rate``, Poisson arrivals at that rate (open loop: the same offered
  load for every setting, TTFT from each arrival). Reported: TTFT p50/p99, output tokens/s, and
  prompt tokens served from a tier or the device cache.
- **returning conversations**: ``--users`` conversations of ``--history-len`` tokens each run
  one turn, one after another (so each evicts earlier ones from the device pool), then each user
  comes back with the history, the answer and ``--user-len`` new tokens. Reported: the returning
  turn's TTFT (median) with each setting as a fraction of the same turn computed cold.

The tiers are sized to hold every prefix; the disk tier writes under a temporary directory.
``--settings ... bigger`` adds a run without tiers whose KV cache gets the host tier's memory
instead (on a CPU both are the same RAM: the question a CPU default answers).
Model: SmolLM2-135M-Instruct unless --model is given. Prompts are random token ids.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import bench_model_dir  # noqa: E402

BLOCK = 16


def _engine(model: str, num_blocks: int, setting: str, tier_gib: float, tmp: str, max_tokens_budget: int):
    from workers.engine import LLMEngine

    tiers: dict = {}
    if setting == "bigger":  # no tier: the host tier's memory added to the KV cache instead
        num_blocks += int(tier_gib * 2**30 // _block_bytes(model))
    elif setting == "host":
        tiers = {"host_kv_gib": tier_gib}
    elif setting == "disk":
        tiers = {"disk_kv_gib": tier_gib, "disk_kv_path": tempfile.mkdtemp(dir=tmp)}
    return LLMEngine(
        model,
        num_kv_blocks=num_blocks,
        block_size=BLOCK,
        max_num_batched_tokens=max_tokens_budget,
        load_progress=False,
        **tiers,
    )


def _run(engine, requests: list[list[int]], max_tokens: int, concurrency: int, rate: float | None = None) -> dict:
    """Closed loop (``concurrency`` requests in flight), or open loop with ``rate`` (Poisson
    arrivals a second, TTFT counted from the arrival); TTFT per request, output tokens/s."""
    from workers.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    pending = list(enumerate(requests))
    started: dict[str, float] = {}
    ttft: dict[str, float] = {}
    cached: dict[str, int] = {}
    out_tokens = 0
    t0 = time.monotonic()
    arrivals = random.Random(1)
    due = t0
    while pending or engine.has_unfinished():
        while pending and (
            (rate is None and len(started) - len(cached) < concurrency)
            or (rate is not None and time.monotonic() >= due)
        ):
            i, prompt = pending.pop(0)
            rid = f"r{i}"
            engine.add_request(rid, prompt, params)
            started[rid] = due if rate is not None else time.monotonic()
            if rate is not None:
                due += arrivals.expovariate(rate)
        if rate is not None and not engine.has_unfinished() and pending:
            time.sleep(max(0.0, due - time.monotonic()))
        for out in engine.step():
            out_tokens += len(out.new_token_ids)
            if out.request_id not in ttft and out.token_ids:
                ttft[out.request_id] = time.monotonic() - started[out.request_id]
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    wall = time.monotonic() - t0
    times = sorted(ttft.values())
    return {
        "ttft_p50": statistics.median(times),
        "ttft_p99": times[min(len(times) - 1, int(0.99 * len(times)))],
        "tok_s": out_tokens / wall,
        "cached": sum(cached.values()) / sum(len(p) for p in requests),
        "wall": wall,
    }


def many_tenants(args, model: str, tmp: str) -> dict[str, dict]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(100, 40000) for _ in range(args.system_len)] for _ in range(args.tenants)]
    weights = [1 / (k + 1) ** args.zipf for k in range(args.tenants)]
    order = list(range(args.tenants))
    rng.shuffle(order)  # which tenant is popular is not its index
    tenants = rng.choices(order, weights=weights, k=args.requests)
    requests = [systems[t] + [rng.randrange(100, 40000) for _ in range(args.user_len)] for t in tenants]
    warm_order = rng.sample(range(args.tenants), args.tenants)
    per_request = -(-(args.system_len + args.user_len + args.max_tokens) // BLOCK)
    num_blocks = args.device_room * (args.system_len // BLOCK) + args.concurrency * per_request
    tier_gib = 1.2 * args.tenants * per_request * _block_bytes(model) / 2**30
    results = {}
    for setting in args.settings:
        engine = _engine(model, num_blocks, setting, tier_gib, tmp, args.budget)
        try:
            # A service that has run a while: every tenant's prompt was computed once (in random
            # order; the device pool keeps the last ones, a tier all of them).
            _run(engine, [systems[t] + [7] for t in warm_order], 1, 1)
            if engine.kv_tiers is not None:
                engine.kv_tiers.wait_idle()
            results[setting] = _run(engine, requests, args.max_tokens, args.concurrency, args.rate)
            results[setting]["stats"] = engine.stats()
        finally:
            engine.close()
        r = results[setting]
        print(
            f"  many tenants, tiers {setting:>6}: TTFT p50 {r['ttft_p50'] * 1e3:7.0f} ms, p99 "
            f"{r['ttft_p99'] * 1e3:7.0f} ms, {r['tok_s']:6.1f} output tok/s, {r['cached']:.0%} of prompt "
            f"tokens cached ({r['stats'].host_hits + r['stats'].disk_hits} blocks from a tier), {r['wall']:.0f} s",
            flush=True,
        )
    return results


def returning(args, model: str, tmp: str) -> dict[str, float]:
    from workers.engine import SamplingParams

    rng = random.Random(args.seed + 1)
    histories = [[rng.randrange(100, 40000) for _ in range(args.history_len)] for _ in range(args.users)]
    per_user = -(-(args.history_len + args.user_len + 2 * args.max_tokens) // BLOCK)
    num_blocks = max(args.users // 4, 1) * per_user + per_user
    tier_gib = 1.2 * args.users * per_user * 2 * _block_bytes(model) / 2**30
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    medians = {}
    for setting in args.settings:
        engine = _engine(model, num_blocks, setting, tier_gib, tmp, args.budget)
        try:
            _run(engine, [histories[0][:64]], 1, 1)
            engine.block_manager.reset_prefix_cache()
            answers = [o.token_ids for o in (engine.generate([h], params)[0] for h in histories)]
            if engine.kv_tiers is not None:
                engine.kv_tiers.wait_idle()
            times = []
            for h, a in zip(histories, answers):
                turn = h + a + [rng.randrange(100, 40000) for _ in range(args.user_len)]
                times.append(_run(engine, [turn], 1, 1)["ttft_p50"])
        finally:
            engine.close()
        medians[setting] = statistics.median(times)
        print(f"  returning users, tiers {setting:>6}: turn-2 TTFT median {medians[setting] * 1e3:7.0f} ms", flush=True)
    return medians


def _block_bytes(model: str) -> int:
    from workers.models.config import ModelConfig

    config = ModelConfig.from_dir(model)
    return BLOCK * config.kv_bytes_per_token(4)  # fp32 cache on CPU


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir, .gguf file or 'smollm2' (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--device-room", type=int, default=8, help="system prompts the device pool holds")
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4, help="closed loop: requests in flight")
    ap.add_argument("--rate", type=float, default=None, help="open loop instead: requests a second (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--history-len", type=int, default=1536)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--settings", nargs="+", default=["off", "host", "disk"], choices=["off", "host", "disk", "bigger"])
    ap.add_argument("--workloads", nargs="+", default=["tenants", "returning"], choices=["tenants", "returning"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model = bench_model_dir(args.model, lambda p: p, Path("."))
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tiers-") as tmp:
        if "tenants" in args.workloads:
            res = many_tenants(args, model, tmp)
            if "off" in res:
                for setting in ("host", "disk", "bigger"):
                    if setting in res:
                        r, off = res[setting], res["off"]
                        print(
                            f"many tenants, {setting} vs off: TTFT p50 {r['ttft_p50'] / off['ttft_p50']:.2f}x, "
                            f"output throughput {r['tok_s'] / off['tok_s']:.2f}x"
                        )
        if "returning" in args.workloads:
            med = returning(args, model, tmp)
            if "off" in med:
                for setting in ("host", "disk", "bigger"):
                    if setting in med:
                        print(f"returning users, {setting}: turn-2 TTFT {med[setting] / med['off']:.1%} of cold")


if __name__ == "__main__":
    main()
