"""Autoscaling on CPU, one run: the pd policy against a static prefill:decode split and per-pool
queue-length autoscaling (Serve's autoscaling_config on each pool), on the same replica budget
and the same workload:

    python bench/autoscale.py                      # shifting: prompt-heavy -> output-heavy -> prompt-heavy
    python bench/autoscale.py --workload steady    # one mixed phase, pd vs static
    python bench/autoscale.py --phase-s 60 --png BENCHMARKS-autoscale.png --json autoscale.json

Prompt-heavy requests have 2048-token prompts and 16-token outputs, output-heavy ones 64-token
prompts and 512-token outputs (random token ids, so no request is a prefix-cache hit); each
phase sends Poisson arrivals at its own rate. The budget is a Ray resource (``pd_slot``, one per
worker replica, ``--budget`` of them on the node), so no policy can run more worker replicas
than it, as with one GPU per replica. Goodput counts requests that meet both the TTFT and the
TPOT target (the pd policy's own targets). Each pool's RUNNING replicas (``serve.status()``) are
sampled every 2 s and drawn as a timeline (PNG, matplotlib: the ``bench`` extra); the pd
policy's changes, with their signals, come from ``/v1/cluster/status``.
The model is a generated random llama (``pdserve tiny-model``'s maker), 4 layers x 256.

``--emulate-device``: on a CPU every replica shares the same cores, so a fourth replica adds KV
memory and a share of the cores, not compute, and moving a replica between the pools moves
almost nothing (the real runs in BENCHMARKS.md show it). With this flag each engine step lasts
at least ``STEP + PREFILL_TOKEN x prefill tokens + CONTEXT_TOKEN x decode context tokens``
seconds, the engine thread sleeping the rest (``emulated_step_s``), as each replica had an
accelerator of its own: prefill time grows with its tokens, a decode step with the KV it reads.
The model is then a 1-layer x 64 llama, whose own CPU time is small next to the emulated time.
Everything else is real: Serve, the policy, the KV blocks, their transfers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import bench_model  # noqa: E402
from deploy.ops.loadgen import COMPLETIONS, RequestResult, send_request  # noqa: E402

APP = "bench"
EMULATED_DEVICE = (0.05, 0.0006, 0.000002)  # s per step, per prefill token, per decode context token


@dataclass(frozen=True)
class Phase:
    name: str
    prompt_len: int
    output_len: int
    rate: float  # requests per second (Poisson)
    seconds: float


@dataclass
class Run:
    label: str
    results: list[tuple[str, RequestResult]] = field(default_factory=list)  # (phase, result)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (s since start, prefill, decode)
    phase_starts: list[tuple[float, str]] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    # the pd policy's last round at each sample: s since start, prefill need, decode need, held,
    # prefill arrivals/s, mean prompt, tokens/s per replica, decode running, waiting, KV usage,
    # the pools not read that round (why)
    rounds: list[tuple] = field(default_factory=list)
    duration_s: float = 0.0


def workload(kind: str, phase_s: float, prompt_rate: float, output_rate: float) -> list[Phase]:
    prompt_heavy = Phase("prompt-heavy", 2048, 16, prompt_rate, phase_s)
    output_heavy = Phase("output-heavy", 64, 512, output_rate, phase_s)
    if kind == "shifting":
        return [prompt_heavy, output_heavy, Phase("prompt-heavy again", 2048, 16, prompt_rate, phase_s)]
    # steady: the same mix all along (half the rate of each kind, interleaved), three phases' time
    return [Phase("mixed", 0, 0, (prompt_rate + output_rate) / 2, 3 * phase_s)]


def _request(phase: Phase, rng: random.Random, vocab: int) -> tuple[int, int]:
    if phase.prompt_len:
        return phase.prompt_len, phase.output_len
    return (2048, 16) if rng.random() < 0.5 else (64, 512)


def running_replicas(app: str) -> tuple[int, int]:
    """RUNNING replicas of each pool as Serve's controller counts them (``serve.status()``; a
    busy replica that is slow to answer a stats call still counts). Blocking."""
    from ray import serve

    deployments = serve.status().applications[app].deployments
    return tuple(deployments[name].replica_states.get("RUNNING", 0) for name in ("prefill", "decode"))


async def _sample(base: str, run: Run, start: float, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=15) as client:
        while not stop.is_set():
            try:
                prefill, decode = await asyncio.to_thread(running_replicas, APP)
                run.timeline.append((time.time() - start, prefill, decode))
                status = (await client.get(f"{base}/v1/cluster/status")).json()
                auto = status.get("autoscaling") or {}
                last = auto.get("last")
                if last:
                    needs = round(last["prefill_need"], 2), round(last["decode_need"], 2)
                    p, d = last.get("prefill") or {}, last.get("decode") or {}
                    seen = (
                        round(p.get("arrivals_per_s", 0.0), 2),
                        round(p.get("mean_prompt_tokens", 0.0)),
                        round(p.get("tokens_per_s_per_replica") or 0.0),
                        d.get("running_seqs", 0),
                        d.get("waiting_seqs", 0),
                        round(d.get("kv_usage", 0.0), 2),
                        round(d.get("kv_usage_ahead", d.get("kv_usage", 0.0)), 2),
                    )
                    t = round(last["time"] - start, 1)
                    run.rounds.append((t, *needs, last["held"], *seen, last.get("unread") or None))
                for change in auto.get("decisions") or []:
                    line = f"{change['time'] - start:7.1f} s  {change['line']}"
                    if line not in run.decisions:
                        run.decisions.append(line)
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # the timeline has its sample; the decisions come next time
            try:
                await asyncio.wait_for(stop.wait(), 2.0)
            except asyncio.TimeoutError:
                pass


def schedule(phases: list[Phase], seed: int, vocab: int) -> list[tuple[float, str, list[int], int]]:
    """Every request of a run, drawn up front from ``seed``: (seconds from the start, phase,
    prompt token ids, max_tokens). Each configuration gets the same list (drawing arrivals and
    prompts while requests run would make the draws depend on the tasks' interleaving)."""
    rng = random.Random(seed)
    plan: list[tuple[float, str, list[int], int]] = []
    phase_start = 0.0
    for phase in phases:
        t = phase_start
        while True:
            t += rng.expovariate(phase.rate)
            if t >= phase_start + phase.seconds:
                break
            prompt_len, output_len = _request(phase, rng, vocab)
            plan.append((t, phase.name, [rng.randrange(10, vocab - 10) for _ in range(prompt_len)], output_len))
        phase_start += phase.seconds
    return plan


def completion_body(model: str, prompt: list[int], output_len: int, stream: bool = False) -> dict:
    """A greedy completion of exactly ``output_len`` tokens (``ignore_eos``); streamed with usage."""
    body: dict = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def drive(base: str, model: str, phases: list[Phase], label: str, seed: int, vocab: int, timeout_s: float) -> Run:
    run = Run(label)
    plan = schedule(phases, seed, vocab)
    stop = asyncio.Event()
    start = time.time()
    sampler = asyncio.create_task(_sample(base, run, start, stop))
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=limits) as client:

        async def one(phase_name: str, prompt: list[int], output_len: int) -> None:
            body = completion_body(model, prompt, output_len, stream=True)
            result = await send_request(client, COMPLETIONS, body, timeout_s)
            run.results.append((phase_name, result))

        offset = 0.0
        for phase in phases:
            run.phase_starts.append((offset, phase.name))
            offset += phase.seconds
        for at, phase_name, prompt, output_len in plan:
            await asyncio.sleep(max(0.0, start + at - time.time()))  # on the schedule, however late the loop
            tasks.append(asyncio.create_task(one(phase_name, prompt, output_len)))
        await asyncio.sleep(max(0.0, start + offset - time.time()))
        await asyncio.gather(*tasks)
    run.duration_s = time.time() - start
    stop.set()
    await sampler
    return run


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(run: Run, ttft_s: float, tpot_s: float, phase: str | None = None) -> dict:
    rows = [r for p, r in run.results if phase is None or p == phase]
    ok = [r for r in rows if r.success]
    good = [r for r in ok if r.ttft_s <= ttft_s and (r.tpot_s or 0.0) <= tpot_s]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    return {
        "requests": len(rows),
        "ok": len(ok),
        "failed": len(rows) - len(ok),
        "good": len(good),
        "goodput_fraction": len(good) / len(rows) if rows else None,
        "goodput_req_s": len(good) / run.duration_s if phase is None and run.duration_s else None,
        "ttft_p90_s": percentile(ttft, 90),
        "tpot_p90_s": percentile(tpot, 90),
    }


def warm_up(base: str, model: str, vocab: int, seed: int, timeout_s: float) -> None:
    """Two requests of each shape, one at a time: every code path (prefill, KV transfer, decode)
    has run once, without a burst the pd policy would read as load (a Poisson warm-up of 2k-token
    prompts moved the pools to 3:1 before the run began: runs u6 and u8)."""
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=timeout_s) as client:
        for prompt_len, output_len in ((2048, 16), (64, 32), (2048, 16), (64, 32)):
            prompt = [rng.randrange(10, vocab - 10) for _ in range(prompt_len)]
            client.post(COMPLETIONS, json=completion_body(model, prompt, output_len)).raise_for_status()


def settle(split: tuple[int, int], quiet_s: float, timeout_s: float) -> bool:
    """Wait until each pool's RUNNING replicas equal ``split`` and have stayed so for ``quiet_s``
    (the pd policy's look-back and rates then hold no warm-up). False if that did not happen in
    ``timeout_s``: the run still goes, flagged as not a clean start."""
    deadline = time.monotonic() + timeout_s
    since: float | None = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if running_replicas(APP) == split:
            since = now if since is None else since
            if now - since >= quiet_s:
                return True
        else:
            since = None
        time.sleep(1.0)
    return False


def app_args(kind: str, model: str, redis_url: str, opts) -> dict:
    pool = {"num_cpus": opts.cpus_per_replica, "resources": {"pd_slot": 1}}
    half = opts.budget // 2
    args = {
        "model": model,
        "redis_url": redis_url,
        "device": "cpu",
        "num_kv_blocks": opts.kv_blocks,
        "max_model_len": 2048 + 512,
        "emulated_step_s": opts.emulate_device,
        "prefill": {**pool, "replicas": half},
        "decode": {**pool, "replicas": opts.budget - half},
    }
    if kind == "pd":
        args["autoscaling"] = {
            "policy": "pd",
            "max_total_replicas": opts.budget,
            "ttft_target_s": opts.ttft_s,
            "tpot_target_s": opts.tpot_s,
            "interval_s": 2.0,
            "upscale_delay_s": 4.0,
            "downscale_delay_s": 30.0,
            "cooldown_s": 10.0,
        }
    elif kind == "queue":
        for name, target in (("prefill", opts.queue_target_prefill), ("decode", opts.queue_target_decode)):
            args[name] = {
                **pool,
                "autoscaling_config": {
                    "min_replicas": 1,
                    "max_replicas": opts.budget - 1,
                    "initial_replicas": args[name]["replicas"],
                    "target_ongoing_requests": target,
                    "upscale_delay_s": 4.0,
                    "downscale_delay_s": 30.0,
                    "metrics_interval_s": 1.0,
                    "look_back_period_s": 6.0,
                },
            }
    return args


LABELS = {"pd": "pd policy", "static": "static 2:2", "queue": "per-pool queue-length"}


def plot(runs: list[Run], path: Path, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 1.9 * len(runs) + 0.6), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        t = [x[0] for x in run.timeline]
        # drawn 0.04 apart so that equal counts stay visible as two lines
        ax.step(t, [x[1] + 0.04 for x in run.timeline], where="post", label="prefill", color="tab:blue")
        ax.step(t, [x[2] - 0.04 for x in run.timeline], where="post", label="decode", color="tab:orange")
        for start, name in run.phase_starts:
            ax.axvline(start, color="grey", lw=0.6, ls="--")
            ax.text(start + 1, budget - 0.35, name, fontsize=7, color="grey")
        ax.set_ylim(0, budget)
        ax.set_yticks(range(budget + 1))
        ax.set_ylabel("replicas")
        ax.set_title(run.label, fontsize=9, loc="left")
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("shifting", "steady"), default="shifting")
    ap.add_argument(
        "--configs",
        default=None,
        help="comma-separated of pd,static,queue (default: all three shifting, pd,static steady)",
    )
    ap.add_argument("--phase-s", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--prompt-rate", type=float, default=1.2, help="prompt-heavy requests/s")
    ap.add_argument("--output-rate", type=float, default=0.8, help="output-heavy requests/s")
    ap.add_argument("--budget", type=int, default=4, help="worker replicas (prefill + decode)")
    ap.add_argument("--ttft-s", type=float, default=2.0, help="TTFT target (goodput and the pd policy)")
    ap.add_argument("--tpot-s", type=float, default=0.1, help="TPOT target (goodput and the pd policy)")
    ap.add_argument("--queue-target-prefill", type=float, default=2.0, help="queue-length: target_ongoing_requests")
    ap.add_argument("--queue-target-decode", type=float, default=8.0, help="queue-length: target_ongoing_requests")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=448,
        help="KV blocks per replica (its memory: 12 output-heavy or 3 prompt-heavy sequences)",
    )
    ap.add_argument("--cpus-per-replica", type=float, default=0.5)
    ap.add_argument(
        "--emulate-device",
        nargs="?",
        const=",".join(map(str, EMULATED_DEVICE)),
        default=None,
        type=lambda v: tuple(float(x) for x in v.split(",")),
        metavar="STEP,PREFILL_TOKEN,CONTEXT_TOKEN",
        help="each engine step lasts at least this long, as on an accelerator per replica "
        f"(default when given without a value: {','.join(map(str, EMULATED_DEVICE))} s: a prefill step 50 ms "
        "+ 0.6 ms per token, a decode step 50 ms + 2 ms per 1000 context tokens it reads)",
    )
    ap.add_argument(
        "--settle-s",
        type=float,
        default=20.0,
        help="after the warm-up, the pools must sit at the starting split this long, unchanged, before the run",
    )
    ap.add_argument(
        "--settle-timeout-s", type=float, default=150.0, help="give up waiting for a settled start (the run is flagged)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--png", type=Path, default=Path("autoscale.png"))
    ap.add_argument("--json", type=Path, default=None)
    opts = ap.parse_args(argv)
    configs = (opts.configs or ("pd,static,queue" if opts.workload == "shifting" else "pd,static")).split(",")
    phases = workload(opts.workload, opts.phase_s, opts.prompt_rate, opts.output_rate)

    from cluster.local import LocalCluster, find_free_port
    from workers.models.config import ModelConfig

    if opts.emulate_device is not None:
        from workers.models.tiny import make_tiny_model

        model = str(Path(".cache/bench-emulated-llama"))
        if not (Path(model) / "config.json").is_file():
            make_tiny_model(model, num_layers=1, hidden_size=64, vocab_size=1024, max_position_embeddings=4096)
    else:
        model = str(bench_model(Path(".cache/bench-serve-llama")))
    vocab = ModelConfig.from_dir(model).vocab_size
    port = find_free_port()
    runs: list[Run] = []
    starts: list[bool] = []  # per configuration: did its run start at the initial split, settled
    load = [os.getloadavg()]
    ray_init = {"resources": {"pd_slot": opts.budget}, "log_to_driver": False}
    with LocalCluster(num_cpus=8, ray_init_kwargs=ray_init) as local:
        from ray import serve

        from deploy.builder import deploy_and_wait

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for kind in configs:
            base = deploy_and_wait(
                app_args(kind, model, local.redis_url, opts), APP, "/", f"http://127.0.0.1:{port}", timeout_s=300
            )
            model_id = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
            warm_up(base, model_id, vocab, opts.seed + 99, opts.timeout_s)
            split = (opts.budget // 2, opts.budget - opts.budget // 2)
            clean = settle(split, opts.settle_s, opts.settle_timeout_s)
            starts.append(clean)
            if not clean:
                print(f"--- {LABELS[kind]}: pools not back at {split[0]}:{split[1]}; NOT a clean start", flush=True)
            print(f"--- {LABELS[kind]}: running {sum(p.seconds for p in phases):.0f} s", flush=True)
            runs.append(asyncio.run(drive(base, model_id, phases, LABELS[kind], opts.seed, vocab, opts.timeout_s)))
            load.append(os.getloadavg())
            serve.delete(APP)
        serve.shutdown()

    report = {
        "workload": opts.workload,
        "phases": [p.__dict__ for p in phases],
        "budget": opts.budget,
        "ttft_target_s": opts.ttft_s,
        "tpot_target_s": opts.tpot_s,
        "emulated_step_s": opts.emulate_device,
        "load_average": load,
        "runs": [],
    }
    print(
        f"\n{opts.workload} workload, budget {opts.budget}, TTFT target {opts.ttft_s:g} s, "
        f"TPOT target {opts.tpot_s * 1000:g} ms"
        + (f"; emulated device {opts.emulate_device}" if opts.emulate_device else "; real CPU compute")
        + "; load average (1/5/15 min) before and after each run: "
        + "; ".join("/".join(f"{x:.1f}" for x in la) for la in load)
    )
    header = f"{'config':<24}{'requests':>9}{'good':>6}{'goodput':>9}{'good/s':>8}{'p90 TTFT':>10}{'p90 TPOT':>10}"
    print(header)
    for run, clean_start in zip(runs, starts, strict=True):
        s = summarize(run, opts.ttft_s, opts.tpot_s)
        phases = dict.fromkeys(p for p, _ in run.results)  # in order of first appearance
        per_phase = {name: summarize(run, opts.ttft_s, opts.tpot_s, name) for name in phases}
        report["runs"].append(
            {
                "label": run.label,
                **s,
                "phases": per_phase,
                "timeline": run.timeline,
                "phase_starts": run.phase_starts,
                "decisions": run.decisions,
                "rounds": run.rounds,
                "duration_s": run.duration_s,
                "clean_start": clean_start,
            }
        )
        print(
            f"{run.label:<24}{s['requests']:>9}{s['good']:>6}{s['goodput_fraction']:>9.1%}{s['goodput_req_s']:>8.2f}"
            f"{s['ttft_p90_s'] or 0:>9.2f}s{(s['tpot_p90_s'] or 0) * 1000:>8.0f}ms"
            + ("" if clean_start else "  (not a clean start)")
        )
        for name, ps in per_phase.items():
            print(
                f"  {name:<22}{ps['requests']:>9}{ps['good']:>6}{ps['goodput_fraction'] or 0:>9.1%}{'':>8}"
                f"{ps['ttft_p90_s'] or 0:>9.2f}s{(ps['tpot_p90_s'] or 0) * 1000:>8.0f}ms"
            )
        for line in run.decisions:
            print(f"    {line}")
    by_label = {r["label"]: r for r in report["runs"]}
    if "pd policy" in by_label and "static 2:2" in by_label and by_label["static 2:2"]["good"]:
        print(f"pd goodput / static goodput: {by_label['pd policy']['good'] / by_label['static 2:2']['good']:.2f}x")
    if opts.json:  # first: a run's figures outlive a failed plot
        opts.json.write_text(json.dumps(report, indent=2))
    if opts.png:
        try:
            plot(runs, opts.png, opts.budget)
        except ImportError as exc:
            print(f"no timeline drawn ({exc}): pip install -e '.[bench]' installs matplotlib")
        else:
            print(f"timeline: {opts.png} ({opts.png.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
