"""Moving a running stream between decode replicas: the pause a client sees, live vs recompute.

    python bench/migrate.py [--model smollm2] [--prompt-len 1024] [--max-tokens 128] [--move-at 48] [--trials 4]

Starts a local Ray and a managed redis-server, deploys 1 prefill + 2 decode replicas, and streams
one request at a time (greedy, ``ignore_eos``). At the ``--move-at``-th SSE event another thread
asks the ingress to move the stream (``POST /v1/cluster/migrate``): live (its KV pulled by the
other decode replica) or ``recompute`` (today's hand-over: the other replica computes prompt +
tokens so far). Modes alternate A B B A over the trials on the same prompts. Reported per mode,
as medians over the trials:

- pause: the longest gap between two SSE events from the move on (the event before the move and
  the first after it);
- ITL: the stream's median gap between events, the pause excepted;
- pause / ITL, and live's pause / recompute's.

Every run has its own ``cache_salt``, so no replica holds its blocks beforehand. Every moved
stream's text is checked against an unmoved run of the same prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import MODEL_HELP, bench_model_dir  # noqa: E402
from deploy.ops.loadgen.workloads import PromptMaker  # noqa: E402


def tiny_model(path: Path) -> Path:
    from workers.models.tiny import make_tiny_model

    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="llama", num_layers=6, hidden_size=512, num_heads=8, num_kv_heads=4,
                        intermediate_size=1536, vocab_size=2048, max_position_embeddings=8192, seed=0)  # fmt: skip
    return path


def two_decode_app(model_dir: str, redis_url: str, kv_blocks: int, cpus_per_replica: float) -> dict:
    """The app both benchmarks deploy: 1 prefill + 2 decode replicas on CPU."""
    pool = {"num_cpus": cpus_per_replica, "replicas": 1}
    return {
        "model": model_dir,
        "redis_url": redis_url,
        "device": "cpu",
        "num_kv_blocks": kv_blocks,
        "prefill": pool,
        "decode": {**pool, "replicas": 2},
    }


def ask_move(base: str, body: dict, answers: list) -> None:
    answers.append(httpx.post(f"{base}/v1/cluster/migrate", json=body, timeout=30))


def stream(
    base: str, model: str, prompt: str, max_tokens: int, move_at: int | None, recompute: bool, salt: str
) -> dict:
    """One streamed completion; with ``move_at``, moved at that event. Its text and event times."""
    payload = {
        "cache_salt": salt,
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times, text, answers = [], [], []
    with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event)
            times.append(time.perf_counter())
            text.extend(c["text"] for c in event.get("choices", []))
            if move_at is not None and len(times) == move_at:
                body = {"request_id": event["id"], "recompute": recompute}
                threading.Thread(target=ask_move, args=(base, body, answers), daemon=True).start()
    if move_at is not None and (not answers or answers[0].status_code != 200):
        raise RuntimeError(f"the move was not made: {answers[0].text if answers else 'no answer'}")
    gaps = np.diff(times)
    out = {"text": "".join(text), "events": len(times)}
    if move_at is not None:
        after = gaps[move_at - 1 :]
        pause_index = move_at - 1 + int(np.argmax(after))
        out["pause_s"] = float(gaps[pause_index])
        out["itl_s"] = float(np.median(np.delete(gaps, pause_index)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--move-at", type=int, default=48, help="the SSE event at which the move is asked for")
    ap.add_argument("--trials", type=int, default=4, help="per mode")
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--cpus-per-replica", type=float, default=0.5)
    ap.add_argument("--json", type=Path, default=None)
    opts = ap.parse_args(argv)

    from cluster.local import LocalCluster, find_free_port

    model_dir = bench_model_dir(opts.model, tiny_model, Path(".cache/bench-migrate-llama"))
    maker = PromptMaker(model_dir)
    rng = np.random.default_rng(0)
    prompts = [maker.make(rng, opts.prompt_len)[0] for _ in range(opts.trials * 2 + 1)]
    port = find_free_port()
    rows: dict[str, list[dict]] = {"live": [], "recompute": []}
    with LocalCluster(num_cpus=8) as local:
        from ray import serve

        from deploy.builder import deploy_and_wait

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app_args = two_decode_app(model_dir, local.redis_url, opts.kv_blocks, opts.cpus_per_replica)
        base = deploy_and_wait(app_args, "bench", "/", f"http://127.0.0.1:{port}", timeout_s=300)
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        stream(base, model, prompts[-1], opts.max_tokens, opts.move_at, False, "warm-live")  # warm-up: both paths
        stream(base, model, prompts[-1], opts.max_tokens, opts.move_at, True, "warm-recompute")
        order = ["live", "recompute", "recompute", "live"]
        for trial in range(opts.trials * 2):
            mode = order[trial % 4]
            prompt = prompts[trial // 2]
            # Each run under its own cache salt: no replica holds any of its blocks beforehand, so
            # the move's receiver pulls (live) or computes (recompute) the whole context.
            reference = stream(base, model, prompt, opts.max_tokens, None, False, f"ref-{trial}")["text"]
            row = stream(base, model, prompt, opts.max_tokens, opts.move_at, mode == "recompute", f"move-{trial}")
            if row["text"] != reference:
                raise RuntimeError(f"{mode} move changed the text of trial {trial}")
            rows[mode].append(row)
            print(
                f"  {mode:<9} trial {trial}: pause {row['pause_s'] * 1000:7.1f} ms, ITL {row['itl_s'] * 1000:5.1f} ms",
                flush=True,
            )
        status = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
        serve.delete("bench")
        serve.shutdown()

    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("pause_s", "itl_s")} for m, rs in rows.items()}
    print(
        f"\n### Moving a stream mid-decode: prompt {opts.prompt_len} tokens, moved at event {opts.move_at} "
        f"of {opts.max_tokens}, {opts.trials} trials per mode (median)"
    )
    print(f"{'':<12}{'pause ms':>10}{'ITL ms':>9}{'pause/ITL':>11}")
    for mode, m in med.items():
        print(f"{mode:<12}{m['pause_s'] * 1000:>10.1f}{m['itl_s'] * 1000:>9.1f}{m['pause_s'] / m['itl_s']:>11.2f}")
    print(f"live pause / recompute pause: {med['live']['pause_s'] / med['recompute']['pause_s']:.2f}")
    print(f"routing: {status['routing']}")
    if opts.json:
        opts.json.write_text(json.dumps({"median": med, "rows": rows, "options": vars(opts)}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
