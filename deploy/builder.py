"""``build_app(args)``: the Serve application (an application builder, usable as
``import_path: deploy.builder:build_app`` in a Serve config).

Logging: every deployment gets a Serve ``LoggingConfig`` (``serve_logging``). Serve's per-call
access log ("CALL prefill OK 3.7ms", "POST /v1/completions 200", one line per internal call) is
off and Serve's own replica logger says only warnings, unless ``log_level`` is DEBUG or the
caller asks for the access log (``pdserve up --access-log``): INFO on the console is for state
changes.

P/D-aware autoscaling (``autoscaling: pd``): the pools start at their ``replicas`` and an
``autoscaler`` deployment (``deploy/pools/autoscaler.py``) sets both pools' counts through Serve's
external-scaler API, so the application must be deployed with ``external_scaler_enabled``
(``deploy_and_wait`` does; in a Serve config, ``external_scaler_enabled: true`` beside ``args``).

Shutdown: deleting the application stops every replica: the ingress's in-flight requests get
``INGRESS_DRAIN_S`` to finish, the pools a little longer (they serve those requests), then each
pool replica ends what still runs and leaves the prefix index. ``pdserve up`` first drains the
ingress itself (``OpenAIIngress.drain``) and only then deletes the application."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Deployment
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import LoggingConfig

from deploy.api.ingress import OpenAIIngress
from deploy.args import Mode, PDServeArgs, PoolArgs, check_redis_url_for_cluster
from deploy.compat import check_ray_version
from deploy.pools.autoscaler import PDAutoscaler
from deploy.pools.servers import ColocatedServer, DecodeServer, PrefillServer
from workers.engine.config import EngineConfig

PREFIX_ROUTER = "deploy.pools.routers:PrefixAwareRouter"
DECODE_ROUTER = "deploy.pools.routers:DecodeRouter"
INGRESS_DRAIN_S = 10.0  # in-flight requests may finish this long after a stop (then they are cut)
# Serve stops every deployment of a deleted application at once, and a stopping replica takes no
# new calls: the pools outlive the ingress's drain so that its in-flight requests can finish.
# (`pdserve up` drains the ingress first, see OpenAIIngress.drain, so the pools are idle by then.)
POOL_DRAIN_S = INGRESS_DRAIN_S + 5.0
DRAIN_CHECK_S = 0.5  # how often a stopping replica looks whether its requests are done


def serve_logging(log_level: str = "INFO", access_log: bool | None = None) -> LoggingConfig:
    """Serve's logging for pdserve's deployments (and, from ``pdserve up``, its controller and
    proxy): access log off unless asked for or at DEBUG; Serve's INFO chatter (a line per
    cancelled call, per handle started, per client that left) only then."""
    debug = str(log_level).upper() == "DEBUG"
    access = debug if access_log is None else access_log
    level = "DEBUG" if debug else "INFO" if access else "WARNING"  # access lines are INFO records
    return LoggingConfig(log_level=level, enable_access_log=access)


def _pool_options(
    pool: PoolArgs, router: str, router_kwargs: dict[str, Any], logging_config: LoggingConfig
) -> dict[str, Any]:
    sizing: dict[str, Any] = (
        {"autoscaling_config": pool.autoscaling_config} if pool.autoscaling_config else {"num_replicas": pool.replicas}
    )
    return dict(
        **sizing,
        **_placement_options(pool),
        max_ongoing_requests=pool.max_ongoing_requests,
        max_queued_requests=pool.max_queued_requests,
        # Ray annotates RequestRouterConfig(**kwargs) as dict[str, Any] values; they are its fields.
        request_router_config=RequestRouterConfig(
            request_router_class=router,  # type: ignore[arg-type]
            request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=1.0,  # type: ignore[arg-type]
            request_routing_stats_timeout_s=5.0,  # type: ignore[arg-type]
        ),
        health_check_period_s=5.0,
        logging_config=logging_config,
        graceful_shutdown_timeout_s=POOL_DRAIN_S,
        graceful_shutdown_wait_loop_s=DRAIN_CHECK_S,
    )


def _placement_options(pool: PoolArgs) -> dict[str, Any]:
    """A replica's resources. One rank: its ``ray_actor_options``. ``tensor_parallel_size`` N > 1:
    a placement group of N bundles of the pool's CPUs and GPUs (its custom resources on bundle 0
    only), the replica actor (rank 0) sized to fit bundle 0 as Serve requires; ranks 1..N-1 are
    actors the engine places in bundles 1..N-1 (workers/engine/tensor_parallel.py)."""
    actor = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus, "resources": dict(pool.resources)}
    if pool.tensor_parallel_size == 1:
        return {"ray_actor_options": actor}
    bundle: dict[str, float] = {"CPU": pool.num_cpus}
    if pool.num_gpus:
        bundle["GPU"] = pool.num_gpus
    first = {**bundle, **pool.resources}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": [first] + [dict(bundle) for _ in range(pool.tensor_parallel_size - 1)],
        "placement_group_strategy": pool.bundle_strategy,
    }


def _deployment(decorated: object) -> Deployment:
    """A ``@serve.deployment`` class as what it is at run time (mypy keeps a decorated class's
    own type: python/mypy#3135)."""
    if not isinstance(decorated, Deployment):
        raise TypeError(f"{decorated!r} is not a Serve deployment")
    return decorated


def build_app(args: dict[str, Any] | PDServeArgs) -> serve.Application:
    """The application builder (Serve calls it with the config's ``args``)."""
    return make_app(args)


def make_app(args: dict[str, Any] | PDServeArgs, access_log: bool | None = None) -> serve.Application:
    """``build_app`` with the access log chosen (None: on at log level DEBUG only)."""
    check_ray_version()  # an untested Ray fails here, saying what to install
    parsed = args if isinstance(args, PDServeArgs) else PDServeArgs.model_validate(args)
    check_redis_url_for_cluster(parsed.redis_url)  # a loopback Redis on a multi-node cluster fails here
    check_cluster_fit(parsed)  # more GPUs or CPUs than the cluster has fails here
    logs = serve_logging(parsed.log_level, access_log)
    if parsed.model_key is None:  # derived here, once: every replica and router gets the same key
        parsed = parsed.model_copy(update={"model_key": EngineConfig(model_dir=parsed.model).resolved_model_key})
    raw = parsed.model_dump(mode="json")
    router_kwargs = {
        "redis_url": parsed.redis_url,
        "model_key": parsed.model_key,
        "min_match_blocks": parsed.min_prefix_match_blocks,
        "imbalance_threshold": parsed.prefix_imbalance_threshold,
        "block_size": parsed.block_size,
    }
    ingress = _deployment(OpenAIIngress).options(
        num_replicas=parsed.ingress_replicas,
        ray_actor_options={"num_cpus": parsed.ingress_num_cpus},
        logging_config=logs,
        graceful_shutdown_timeout_s=INGRESS_DRAIN_S,
        graceful_shutdown_wait_loop_s=DRAIN_CHECK_S,
    )
    if parsed.mode is Mode.COLOCATED:
        colocated = (
            _deployment(ColocatedServer)
            .options(
                **_pool_options(
                    parsed.colocated,
                    PREFIX_ROUTER,
                    {**router_kwargs, "role": "colocated", "policy": parsed.prefill_routing},
                    logs,
                )
            )
            .bind(raw)
        )
        return ingress.bind(raw, colocated=colocated)
    prefill_kwargs = {**router_kwargs, "role": "prefill", "policy": parsed.prefill_routing}
    prefill = (
        _deployment(PrefillServer)
        .options(**_pool_options(parsed.prefill, PREFIX_ROUTER, prefill_kwargs, logs))
        .bind(raw)
    )
    decode = (
        _deployment(DecodeServer)
        .options(**_pool_options(parsed.decode, DECODE_ROUTER, {**router_kwargs, "role": "decode"}, logs))
        .bind(raw)
    )
    if parsed.autoscaling is None:
        return ingress.bind(raw, prefill=prefill, decode=decode)
    # INFO: its decision lines go through Serve's replica logger (access log as for the rest)
    autoscaler_logs = LoggingConfig(
        log_level="DEBUG" if logs.log_level == "DEBUG" else "INFO", enable_access_log=logs.enable_access_log
    )
    # a control loop that sleeps between decisions: no CPU share of its own, as Serve's controller
    autoscaler = (
        _deployment(PDAutoscaler).options(logging_config=autoscaler_logs, ray_actor_options={"num_cpus": 0}).bind(raw)
    )
    return ingress.bind(raw, prefill=prefill, decode=decode, autoscaler=autoscaler)


def check_cluster_fit(args: PDServeArgs) -> None:
    """In a Ray that is running (``serve deploy``, ``serve run``, ``pdserve up``): the pools' GPUs
    and CPU shares fit what the cluster has, unless it adds nodes on demand
    (``cluster_autoscales``: Ray's autoscaler, ``ray up``)."""
    import ray

    from deploy.placement import YAML, Capacity, check_cpus, check_gpus

    if args.cluster_autoscales or not ray.is_initialized():
        return
    capacity = Capacity.ray_cluster()
    check_gpus(args, capacity, YAML)
    check_cpus(args, capacity, YAML, args.ingress_num_cpus)


def needs_external_scaler(args: dict[str, Any] | PDServeArgs) -> bool:
    """True when the application sizes its pools itself (``autoscaling: pd``): deploy it with
    ``serve.run(..., external_scaler_enabled=True)``."""
    parsed = args if isinstance(args, PDServeArgs) else PDServeArgs.model_validate(args)
    return parsed.autoscaling is not None


def deploy_and_wait(
    args: dict[str, Any] | PDServeArgs, name: str, route_prefix: str, base_url: str, timeout_s: float = 240.0
) -> str:
    """Deploy ``build_app(args)`` without blocking and return ``base_url`` once its ``/health``
    answers 200, i.e. every pool has a replica the ingress reaches (it is 503 "starting" until
    then): the tests' and benchmarks' way to bring up an application."""
    import time
    import urllib.error
    import urllib.request

    serve.run(
        build_app(args),
        name=name,
        route_prefix=route_prefix,
        blocking=False,
        external_scaler_enabled=needs_external_scaler(args),
    )
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
