"""Conversation reuse: time to first token of a chat's 4th turn, with and without reuse.

    python bench/conversation.py [--conversations 8] [--system-len 1024] [--user-len 48] [--answer-len 128]

Starts a local Ray and a managed redis-server (cluster.local.LocalCluster), deploys 1 prefill +
1 decode replica with ``conversation_reuse`` on, then again with it off, and runs the same N
4-turn conversations on each, one request at a time (each turn resends the whole history with
the answers received; answers run to ``--answer-len`` tokens, ``ignore_eos``). Reported, as
medians over the conversations:

- turn 4 with reuse: its history (prompts and answers) is cached on the decode replica;
- turn 4 without reuse: its text re-tokenized, the prefix cache still on (the last answer's
  re-tokenized ids part from the generated ones, so the blocks from there on are computed);
- turn 4 cold: the same messages under a fresh ``cache_salt`` (nothing cached; no recorded turn
  either, so the text is tokenized: a few more tokens than the reused prompt's ids).

TTFT is the time to the first SSE event, which the ingress sends once the first token exists.
The model is SmolLM2-135M-Instruct unless --model is given (`--model tiny`: the generated 6 x 512 random llama).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import MODEL_HELP, bench_model_dir  # noqa: E402
from deploy.ops.loadgen.workloads import PromptMaker  # noqa: E402

TURNS = 4


def bench_model(path: Path) -> Path:
    """6 layers x 512 hidden (~20M parameters besides embeddings): prefill of a long history
    clearly outweighs the HTTP and Ray overhead on a CPU."""
    from workers.models.tiny import make_tiny_model

    if not (path / "config.json").is_file():
        make_tiny_model(
            path,
            arch="llama",
            num_layers=6,
            hidden_size=512,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=1536,
            vocab_size=2048,
            max_position_embeddings=8192,
            seed=0,
        )
    return path


def timed_turn(client: httpx.Client, model: str, messages: list[dict], max_tokens: int, salt: str) -> dict:
    """One streamed chat turn: TTFT (first SSE event), the answer, and usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": salt,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, pieces, usage = None, [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - start
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                pieces.append((choice.get("delta") or {}).get("content") or "")
    return {
        "ttft_s": ttft,
        "answer": "".join(pieces),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }


def make_conversations(maker: PromptMaker, n: int, system_len: int, user_len: int, seed: int):
    rng = np.random.default_rng(seed)
    return [(maker.make(rng, system_len)[0], [maker.make(rng, user_len)[0] for _ in range(TURNS)]) for _ in range(n)]


def run_conversations(base: str, model: str, conversations, answer_len: int, label: str, cold: bool) -> list[dict]:
    """Each conversation's turn-4 figures (and, with ``cold``, turn 4 again under a fresh salt)."""
    rows = []
    with httpx.Client(base_url=base, timeout=600) as client:
        for i, (system, users) in enumerate(conversations):
            messages = [{"role": "system", "content": system}]
            for k, user in enumerate(users):
                messages.append({"role": "user", "content": user})
                last = k == TURNS - 1
                turn = timed_turn(client, model, messages, 1 if last else answer_len, salt=f"{label}-{i}")
                messages.append({"role": "assistant", "content": turn["answer"]})
                time.sleep(0.2)  # a user reads the answer
            row = {"turn4": turn}
            if cold:
                row["cold"] = timed_turn(client, model, messages[:-1], 1, salt=f"cold-{label}-{i}")
            rows.append(row)
            print(
                f"  {label} conversation {i}: turn 4 prompt {turn['prompt_tokens']} tokens, "
                f"{turn['cached_tokens']} cached, TTFT {turn['ttft_s'] * 1000:.0f} ms"
                + (f"; cold {row['cold']['ttft_s'] * 1000:.0f} ms" if cold else ""),
                flush=True,
            )
    return rows


def run_app(app_args: dict, port: int, conversations, answer_len: int, label: str, cold: bool) -> dict:
    from ray import serve

    from deploy.builder import deploy_and_wait

    base = deploy_and_wait(app_args, "bench", "/", f"http://127.0.0.1:{port}", timeout_s=300)
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    run_conversations(base, model, conversations[:1], answer_len, f"warmup-{label}", cold=False)
    before = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()["routing"]["skipped_prefills"]
    rows = run_conversations(base, model, conversations[1:], answer_len, label, cold)
    skipped = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()["routing"]["skipped_prefills"] - before
    serve.delete("bench")
    median = lambda key, field: statistics.median(r[key][field] for r in rows)  # noqa: E731
    result = {
        "ttft_ms": median("turn4", "ttft_s") * 1000,
        "prompt_tokens": median("turn4", "prompt_tokens"),
        "cached_tokens": median("turn4", "cached_tokens"),
        "skipped_prefills": skipped,
    }
    if cold:
        result["cold_ttft_ms"] = median("cold", "ttft_s") * 1000
        result["cold_cached_tokens"] = median("cold", "cached_tokens")
        result["cold_prompt_tokens"] = median("cold", "prompt_tokens")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--conversations", type=int, default=8, help="measured, plus one warm-up")
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=48)
    ap.add_argument("--answer-len", type=int, default=128)
    ap.add_argument("--kv-blocks", type=int, default=2048)
    ap.add_argument("--cpus-per-replica", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    opts = ap.parse_args(argv)

    from cluster.local import LocalCluster, find_free_port

    model = bench_model_dir(opts.model, bench_model, Path(".cache/bench-conversation-llama"))
    conversations = make_conversations(
        PromptMaker(model), opts.conversations + 1, opts.system_len, opts.user_len, opts.seed
    )
    port = find_free_port()
    with LocalCluster(num_cpus=8) as local:
        from ray import serve

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        pool = {"num_cpus": opts.cpus_per_replica, "replicas": 1}
        base_args = {
            "model": model,
            "redis_url": local.redis_url,
            "device": "cpu",
            "num_kv_blocks": opts.kv_blocks,
            "prefill": pool,
            "decode": pool,
        }
        on = run_app(
            {**base_args, "conversation_reuse": True}, port, conversations, opts.answer_len, "reuse", cold=True
        )
        off = run_app(
            {**base_args, "conversation_reuse": False}, port, conversations, opts.answer_len, "no-reuse", cold=False
        )
        serve.shutdown()

    print(
        f"\n### Turn 4 of {opts.conversations} conversations (median): system {opts.system_len} tokens, "
        f"user turns {opts.user_len}, answers {opts.answer_len}"
    )
    print(f"{'':<22}{'TTFT ms':>10}{'prompt':>9}{'cached':>9}{'skipped prefills':>18}")
    print(
        f"{'with reuse':<22}{on['ttft_ms']:>10.0f}{on['prompt_tokens']:>9.0f}{on['cached_tokens']:>9.0f}"
        f"{on['skipped_prefills']:>18}"
    )
    print(
        f"{'without reuse':<22}{off['ttft_ms']:>10.0f}{off['prompt_tokens']:>9.0f}{off['cached_tokens']:>9.0f}"
        f"{off['skipped_prefills']:>18}"
    )
    print(
        f"{'cold (nothing cached)':<22}{on['cold_ttft_ms']:>10.0f}{on['cold_prompt_tokens']:>9.0f}"
        f"{on['cold_cached_tokens']:>9.0f}"
    )
    print(
        f"with reuse / cold: {on['ttft_ms'] / on['cold_ttft_ms']:.1%}   "
        f"with reuse / without reuse: {on['ttft_ms'] / off['ttft_ms']:.1%}"
    )
    if opts.json:
        opts.json.write_text(
            json.dumps({"with_reuse": on, "without_reuse": off, "options": vars(opts)}, indent=2, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
