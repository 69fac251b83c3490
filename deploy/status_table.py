"""``pdserve status``: /v1/cluster/status as a table for a terminal."""

from __future__ import annotations


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def format_status(status: dict) -> str:
    lines = [f"model {status['model']}  mode {status['mode']}  block size {status['block_size']}"]
    header = f"{'pool':<10} {'replica':<12} {'health':<8} {'KV used':>8} {'free/total':>12} {'run':>4} {'wait':>5} " \
             f"{'requests':>9} {'hit rate':>9} {'xfer MiB':>9} {'fail':>5} {'recomp':>7}"
    lines += ["", header, "-" * len(header)]
    for pool, replicas in status["pools"].items():
        for r in replicas:
            if not r.get("healthy"):
                lines.append(f"{pool:<10} {r['worker_id']:<12} {'DOWN':<8} {r.get('error', '')[:60]}")
                continue
            hit = r["cached_prompt_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
            lines.append(
                f"{pool:<10} {r['worker_id']:<12} {'ok':<8} {r['kv_usage']:>7.1%} "
                f"{r['free_blocks']:>5}/{r['total_blocks']:<6} {r['num_running']:>4} {r['num_waiting']:>5} "
                f"{r['requests']:>9} {hit:>8.1%} {r['transfer_bytes'] / 2**20:>9.1f} "
                f"{r['transfer_failures']:>5} {r['recomputed_prefills']:>7}")
    req = status["requests"]
    lines += ["", f"requests: {req['finished']} finished, {req['active']} active, {req['failed']} failed; "
                  f"cluster prefix hit rate {req['cluster_prefix_hit_rate']:.1%}"]
    for name in ("ttft_s", "itl_s", "e2e_s"):
        p = req[name]
        lines.append(f"  {name[:-2].upper():<5} p50 {_ms(p['p50'])} ms  p90 {_ms(p['p90'])} ms  p99 {_ms(p['p99'])} ms"
                     f"  (last {req['window_s'] / 60:.0f} min)")
    index = status["index"]
    if not index.get("configured"):
        lines.append("index: not configured (routing by load)")
    else:
        state = "healthy" if index.get("healthy") else "UNREACHABLE (routing by load)"
        lines.append(f"index: {state}, {index.get('live_workers')} live workers")
    conversations = status.get("conversations")
    if conversations:
        lines.append(f"conversations: {conversations['hits']} of {conversations['lookups']} follow-up turns "
                     f"reused a recorded turn ({conversations['reused_tokens']} tokens), "
                     f"{conversations['recorded']} turns recorded")
    return "\n".join(lines)
