"""``build_app(args)``: the Serve application (an application builder, usable as
``import_path: deploy.builder:build_app`` in a Serve config)."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from deploy.args import Mode, PDServeArgs, PoolArgs
from deploy.ingress import OpenAIIngress
from deploy.servers import ColocatedServer, DecodeServer, PrefillServer
from workers.engine.config import EngineConfig

PREFIX_ROUTER = "deploy.routers:PrefixAwareRouter"
DECODE_ROUTER = "deploy.routers:DecodeRouter"


def _pool_options(pool: PoolArgs, router: str, router_kwargs: dict[str, Any]) -> dict[str, Any]:
    return dict(
        num_replicas=pool.replicas,
        max_ongoing_requests=pool.max_ongoing_requests,
        max_queued_requests=pool.max_queued_requests,
        ray_actor_options={"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus, "resources": dict(pool.resources)},
        request_router_config=RequestRouterConfig(
            request_router_class=router, request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0,
        ),
        health_check_period_s=5.0,
    )


def build_app(args: dict[str, Any] | PDServeArgs) -> serve.Application:
    parsed = args if isinstance(args, PDServeArgs) else PDServeArgs.model_validate(args)
    raw = parsed.model_dump(mode="json")
    router_kwargs = {
        "redis_url": parsed.redis_url,
        "model_key": EngineConfig(model_dir=parsed.model).resolved_model_key,
        "min_match_blocks": parsed.min_prefix_match_blocks,
        "imbalance_threshold": parsed.prefix_imbalance_threshold,
        "block_size": parsed.block_size,
    }
    ingress = OpenAIIngress.options(num_replicas=parsed.ingress_replicas)
    if parsed.mode is Mode.COLOCATED:
        colocated = ColocatedServer.options(
            **_pool_options(parsed.colocated, PREFIX_ROUTER,
                            {**router_kwargs, "role": "colocated", "policy": parsed.prefill_routing})).bind(raw)
        return ingress.bind(raw, colocated=colocated)
    prefill_kwargs = {**router_kwargs, "role": "prefill", "policy": parsed.prefill_routing}
    prefill = PrefillServer.options(**_pool_options(parsed.prefill, PREFIX_ROUTER, prefill_kwargs)).bind(raw)
    decode = DecodeServer.options(
        **_pool_options(parsed.decode, DECODE_ROUTER, {**router_kwargs, "role": "decode"})).bind(raw, prefill)
    return ingress.bind(raw, prefill=prefill, decode=decode)


def deploy_and_wait(args: dict[str, Any] | PDServeArgs, name: str, route_prefix: str, base_url: str,
                    timeout_s: float = 240.0) -> str:
    """Deploy ``build_app(args)`` without blocking and return ``base_url`` once its ``/health``
    answers (the tests' and benchmarks' way to bring up an application)."""
    import time
    import urllib.error
    import urllib.request

    serve.run(build_app(args), name=name, route_prefix=route_prefix, blocking=False)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return base_url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"application {name} did not come up within {timeout_s:.0f}s")
