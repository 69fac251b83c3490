"""``pdserve status``: /v1/cluster/status as a table for a terminal.

Every column names its unit on the line under its title (``%``, ``blocks``, ``seqs``, ``MiB``,
``ms``); counts have none. Fields an older server does not send are shown as ``-``.
"""

from __future__ import annotations


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _rate(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _table(columns: list[tuple[str, str, int, str]], rows: list[list[str]]) -> list[str]:
    """columns: (title, unit, width, '<' or '>'); rows: cells already as text."""

    def line(cells: list[str]) -> str:
        return " ".join(f"{c:{align}{width}}" for c, (_, _, width, align) in zip(cells, columns)).rstrip()

    out = [line([c[0] for c in columns]), line([c[1] for c in columns])]
    out.append("-" * max(len(out[0]), len(out[1])))
    out += [line(r) if len(r) == len(columns) else " ".join(r) for r in rows]
    return out


REPLICA_COLUMNS = [
    ("pool", "", 10, "<"),
    ("replica", "", 12, "<"),
    ("node", "", 15, "<"),
    ("health", "", 7, "<"),
    ("KV used", "%", 8, ">"),
    ("free/total", "blocks", 12, ">"),
    ("run", "seqs", 5, ">"),
    ("wait", "seqs", 5, ">"),
    ("requests", "", 9, ">"),
    ("hit rate", "% tokens", 9, ">"),
    ("moved", "MiB", 9, ">"),
    ("xfer fail", "", 9, ">"),
    ("recomp", "prompts", 8, ">"),
    ("tiers", "host/disk", 11, ">"),
]

PAIR_COLUMNS = [
    ("prefill", "", 12, "<"),
    ("decode", "", 12, "<"),
    ("transfers", "", 9, ">"),
    ("moved", "MiB", 9, ">"),
    ("p50", "ms", 7, ">"),
    ("p99", "ms", 7, ">"),
    ("failures", "", 8, ">"),
    ("recomp", "prompts", 8, ">"),
]


def _replica_row(pool: str, r: dict) -> list[str]:
    if not r.get("healthy"):
        return [f"{pool:<10}", f"{r['worker_id']:<12}", f"{'-':<15}", f"{'DOWN':<7}", r.get("error", "")[:60]]
    hit = r["cached_prompt_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
    return [
        pool,
        r["worker_id"],
        r.get("node_ip", "-"),
        "ok",
        f"{r['kv_usage']:.1%}",
        f"{r['free_blocks']}/{r['total_blocks']}",
        str(r["num_running"]),
        str(r["num_waiting"]),
        str(r["requests"]),
        f"{hit:.1%}",
        f"{r['transfer_bytes'] / 2**20:.1f}",
        _failures(r["transfer_failures"], r.get("transfer_corrupt", 0)),
        str(r["recomputed_prefills"]),
        _tiers(r),
    ]


def _tiers(r: dict) -> str:
    """Blocks held in the host and disk KV tiers ("-": the replica has none)."""
    if not r.get("host_capacity") and not r.get("disk_capacity"):
        return "-"
    return f"{r.get('host_blocks', 0)}/{r.get('disk_blocks', 0)}"


def _failures(failures: int, corrupt: int) -> str:
    """Failed transfers, and how many of them arrived corrupt (checksums differed)."""
    return f"{failures} ({corrupt} corrupt)" if corrupt else str(failures)


def _pair_row(p: dict) -> list[str]:
    prefill = p["prefill"] if p.get("prefill_live", True) else f"{p['prefill']} (gone)"
    return [
        prefill,
        p["decode"],
        str(p["transfers"]),
        f"{p['transfer_bytes'] / 2**20:.1f}",
        _ms(p.get("transfer_p50_s")),
        _ms(p.get("transfer_p99_s")),
        str(p["transfer_failures"]),
        str(p["recomputed_prefills"]),
    ]


def format_status(status: dict) -> str:
    lines = [f"model {status['model']}  mode {status['mode']}  block size {status['block_size']} tokens"]
    if status.get("model_weights"):
        lines.append(f"weights: {status['model_weights']}")
    lines.append("")
    lines += _table(
        REPLICA_COLUMNS, [_replica_row(pool, r) for pool, replicas in status["pools"].items() for r in replicas]
    )
    pairs = status.get("pairs")
    if pairs is not None and "decode" in status["pools"]:
        lines += ["", "KV transfers by pair (prefill -> decode, as the decode replica counts them)"]
        if pairs:
            lines += _table(PAIR_COLUMNS, [_pair_row(p) for p in pairs])
        else:
            lines.append("  none yet")
    req = status["requests"]
    aborted = f", {req['aborted']} aborted" if req.get("aborted") is not None else ""
    lines += [
        "",
        f"requests: {req['finished']} finished, {req['active']} active, {req['failed']} failed{aborted}; "
        f"cluster prefix hit rate {req['cluster_prefix_hit_rate']:.1%}",
    ]
    http = status.get("http")
    if http:
        lines.append(
            f"  HTTP answers: {http['ok']} ok, {http['refused']} refused (503/429), "
            f"{http['client_errors']} client errors (4xx), {http['server_errors']} server errors (5xx)"
        )
    rates = status.get("throughput")
    if rates:
        window = f"last {rates['window_s']:.0f} s" if rates.get("window_s") else "no window yet"
        aborted = rates.get("aborted_per_s")
        aborted_rate = f", {_rate(aborted, 2)} aborted/s" if aborted is not None else ""
        lines.append(
            f"  throughput ({window}): {_rate(rates['output_tokens_per_s'])} output tokens/s, "
            f"{_rate(rates['requests_per_s'], 2)} requests/s"
        )
        lines.append(
            f"  errors ({window}): {_pct(rates.get('error_fraction'))} of requests failed, "
            f"{_rate(rates['failed_per_s'], 2)} failed/s, {_rate(rates['refused_per_s'], 2)} refused/s"
            f"{aborted_rate}"
        )
    for name in ("ttft_s", "itl_s", "e2e_s"):
        p = req[name]
        lines.append(
            f"  {name[:-2].upper():<5} p50 {_ms(p['p50'])} ms  p90 {_ms(p['p90'])} ms  p99 {_ms(p['p99'])} ms"
            f"  (last {req['window_s'] / 60:.0f} min)"
        )
    index = status["index"]
    if not index.get("configured"):
        lines.append("index: not configured (routing by load)")
    else:
        state = "healthy" if index.get("healthy") else "UNREACHABLE (routing by load)"
        lines.append(f"index: {state}, {index.get('live_workers')} live workers")
    routing = status.get("routing") or {}
    if routing:
        failed = routing.get("failed_migrations")
        lines.append(
            f"routing: {routing.get('skipped_prefills', 0)} prefills skipped (decode held the prompt), "
            f"{routing.get('prefill_retries', 0)} prefills retried after their replica died, "
            f"{routing.get('migrations', 0)} decode streams resumed on another replica"
            + (f" ({retired} handed over by retiring replicas)" if (retired := routing.get("retired_streams")) else "")
            + f", {routing.get('live_migrations', 0)} moved live with their KV"
            + (f", {failed} ended after max_migrations" if failed else "")
        )
    lines += _autoscaling_lines(status.get("autoscaling"), status.get("time"))
    conversations = status.get("conversations")
    if conversations:
        lines.append(
            f"conversations: {conversations['hits']} of {conversations['lookups']} follow-up turns "
            f"reused a recorded turn ({conversations['reused_tokens']} tokens), "
            f"{conversations['recorded']} turns recorded"
        )
    return "\n".join(lines)


def _autoscaling_lines(a: dict | None, now: float | None) -> list[str]:
    """``autoscaling: pd``: the targets within their bounds and budget, what the last round saw,
    and the most recent changes (each with the signals that caused it)."""
    if not a:
        return []
    if "targets" not in a:
        return [f"autoscaling (pd): {a.get('error', 'no state')}"]
    bounds, targets = a["bounds"], a["targets"]
    lines = [
        f"autoscaling (pd): budget {a['budget']} replicas; prefill {targets['prefill']} "
        f"(bounds {bounds['prefill'][0]}..{bounds['prefill'][1]}), decode {targets['decode']} "
        f"(bounds {bounds['decode'][0]}..{bounds['decode'][1]}); targets TTFT {_ms(a['ttft_target_s'])} ms, "
        f"TPOT {_ms(a['tpot_target_s'])} ms"
    ]
    if a.get("error"):
        lines.append(f"  ERROR: {a['error']}")
    last = a.get("last")
    if last:
        p, d = last["prefill"], last["decode"]
        tpot = "-" if d["tpot_s"] is None else f"{d['tpot_s'] * 1000:.0f} ms"
        lines.append(
            f"  now: prefill {p['queued_prompt_tokens']} queued prompt tokens, need "
            f"{last['prefill_need']:.2f}; decode {d['running_seqs']} running, {d['waiting_seqs']} waiting, "
            f"KV {d['kv_usage']:.0%}, TPOT {tpot}, need {last['decode_need']:.2f}"
            + (f"; waiting: {last['held']}" if last.get("held") else "")
        )
    decisions = a.get("decisions") or []
    if not decisions:
        lines.append("  no change yet")
    for change in decisions[-5:]:
        ago = f"{now - change['time']:.0f} s ago" if now is not None else ""
        lines.append(f"  {ago}: {change['line']}")
    return lines
