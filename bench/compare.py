"""Side-by-side serving comparisons, each pair measured in one run on the same machine:

    python bench/compare.py routing   # cache-aware vs round-robin prefill routing, 2 prefill + 1 decode
    python bench/compare.py modes     # disaggregated (1 prefill + 1 decode) vs colocated (2 replicas)

Starts a local Ray and a managed redis-server (cluster.local.LocalCluster), deploys each
configuration in turn through ``build_app``, drives it with ``bench/serve.py`` on the same
workload, and prints the figures and their ratios. The model is SmolLM2-135M-Instruct
unless --model is given (`--model tiny`: the generated 4 x 256 random llama the earlier figures used).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import MODEL_HELP, bench_model_dir  # noqa: E402
from deploy.ops.loadgen import BenchConfig, WorkloadSpec, format_result, run_benchmark  # noqa: E402


def bench_model(path: Path) -> Path:
    from workers.models.tiny import make_tiny_model

    if not (path / "config.json").is_file():
        make_tiny_model(
            path,
            arch="llama",
            num_layers=4,
            hidden_size=256,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=768,
            vocab_size=2048,
            max_position_embeddings=4096,
            seed=0,
        )
    return path


def run_one(label: str, app_args: dict, config: BenchConfig, port: int) -> dict:
    from ray import serve

    from deploy.builder import deploy_and_wait

    base = deploy_and_wait(app_args, "bench", "/", f"http://127.0.0.1:{port}", timeout_s=300)
    warm = replace(
        config, base_url=base, workload=replace(config.workload, seed=config.workload.seed + 1000), progress=False
    )
    asyncio.run(
        run_benchmark(
            replace(warm, workload=replace(warm.workload, num_prompts=4, gsp_num_groups=1, gsp_prompts_per_group=2))
        )
    )
    result = asyncio.run(run_benchmark(replace(config, base_url=base)))
    status = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()
    serve.delete("bench")
    print(f"\n### {label}")
    print(format_result(result))
    s = result.summary
    return {
        "label": label,
        "completed": s.completed,
        "failed": s.failed,
        "output_throughput": s.output_throughput,
        "request_throughput": s.request_throughput,
        "ttft_p50_ms": s.ttft.median_ms,
        "ttft_p90_ms": s.ttft.percentiles_ms.get("p90"),
        "ttft_p99_ms": s.ttft.percentiles_ms.get("p99"),
        "tpot_median_ms": s.tpot.median_ms,
        "itl_p99_ms": s.itl.percentiles_ms.get("p99"),
        "cache_hit_rate": s.cache_hit_rate,
        "ideal_cache_hit_rate": s.ideal_cache_hit_rate,
        "skipped_prefills": status["routing"]["skipped_prefills"],
        "per_replica_requests": {p: [r.get("requests") for r in rs] for p, rs in status["pools"].items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("routing", "modes"))
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--random-prompts", type=int, default=48, help="modes: random-dataset requests")
    ap.add_argument("--input-len", type=int, default=512, help="modes: random prompt length")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per replica (cache pressure)")
    ap.add_argument("--cpus-per-replica", type=float, default=0.5)
    ap.add_argument("--json", type=Path, default=None)
    opts = ap.parse_args(argv)

    from cluster.local import LocalCluster, find_free_port

    model = bench_model_dir(opts.model, bench_model, Path(".cache/bench-serve-llama"))
    port = find_free_port()
    results = []
    with LocalCluster(num_cpus=8) as local:
        from ray import serve

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        pool = {"num_cpus": opts.cpus_per_replica}
        base_args = {
            "model": model,
            "redis_url": local.redis_url,
            "device": "cpu",
            "num_kv_blocks": opts.kv_blocks,
            "prefill": {**pool, "replicas": 1},
            "decode": {**pool, "replicas": 1},
        }
        if opts.what == "routing":
            workload = WorkloadSpec(
                dataset="shared-prefix",
                tokenizer=model,
                gsp_num_groups=opts.groups,
                gsp_prompts_per_group=opts.prompts_per_group,
                gsp_system_prompt_len=opts.system_len,
                gsp_question_len=opts.question_len,
                gsp_output_len=opts.output_len,
            )
            config = BenchConfig(workload=workload, max_concurrency=opts.concurrency, ignore_eos=True)
            for policy in ("cache_aware", "round_robin"):
                app_args = {**base_args, "prefill": {**pool, "replicas": 2}, "prefill_routing": policy}
                results.append(run_one(f"prefill routing {policy} (2 prefill + 1 decode)", app_args, config, port))
        else:
            workload = WorkloadSpec(
                dataset="random",
                tokenizer=model,
                num_prompts=opts.random_prompts,
                random_input_len=opts.input_len,
                random_output_len=opts.output_len * 4,
            )
            config = BenchConfig(workload=workload, max_concurrency=opts.concurrency, ignore_eos=True)
            results.append(run_one("disaggregated (1 prefill + 1 decode)", base_args, config, port))
            colo = {**base_args, "mode": "colocated", "colocated": {**pool, "replicas": 2}}
            results.append(run_one("colocated (2 replicas)", colo, config, port))
        serve.shutdown()

    a, b = results
    print(f"\n### {a['label']}  vs  {b['label']}")
    for key in ("output_throughput", "ttft_p50_ms", "ttft_p90_ms", "tpot_median_ms", "itl_p99_ms", "cache_hit_rate"):
        va, vb = a[key], b[key]
        ratio = f"{va / vb:.2f}x" if va and vb else "-"
        print(f"{key:<20} {va!s:>12.12} {vb!s:>12.12}  ratio {ratio}")
    if opts.what == "routing" and a["ideal_cache_hit_rate"]:
        print(
            f"cluster hit rate vs ideal: {a['cache_hit_rate'] / a['ideal_cache_hit_rate']:.1%} (cache-aware), "
            f"{b['cache_hit_rate'] / b['ideal_cache_hit_rate']:.1%} (round-robin)"
        )
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
