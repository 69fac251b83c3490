"""Ray Serve with pdserve's shape and nothing in it: the idle floor that any server built on Ray
Serve starts from.

    python bench/serve_floor.py --port 8011          # serves until Ctrl-C
    python bench/idle.py --server serve-floor        # its idle CPU by process, as for pdserve
    python bench/idle.py --server serve-floor --pdserve-arg=--ray-defaults   # plain ray.init instead

Ray is started exactly as `pdserve up` starts it (`cluster.local.LocalCluster`: the same
`_system_config`, worker niceness, Serve and log-monitor periods, Ray's dashboard off), and Serve
runs the two deployments a colocated pdserve runs (an HTTP ingress that calls one backend replica
through a deployment handle) with a fixed answer instead of a model: Serve's controller and proxy,
two replicas, the GCS, the raylet and Ray's agents. No Redis is started. The routes are the ones
`bench/peer.py`'s readiness check and `bench/idle.py`'s warm-up request use. With
``--ray-defaults`` Ray is a plain ``ray.init(include_dashboard=False)`` instead: Ray Serve as a user
gets it out of the box, with no periods changed.
"""

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A Redis URL nothing answers on: LocalCluster then starts no redis-server (the floor has none).
NO_REDIS = "redis://127.0.0.1:9/0"


def build_app(model: str) -> Any:
    from fastapi import FastAPI, Request
    from ray import serve
    from ray.serve.handle import DeploymentHandle

    api = FastAPI()

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Backend:
        async def complete(self, prompt: str) -> str:
            return " Paris."

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Ingress:
        def __init__(self, backend: DeploymentHandle) -> None:
            self.backend = backend

        @api.get("/health")
        async def health(self) -> dict[str, str]:
            return {"status": "ok"}

        @api.get("/v1/models")
        async def models(self) -> dict[str, Any]:
            return {"object": "list", "data": [{"id": model, "object": "model"}]}

        @api.post("/v1/completions")
        async def completions(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            text = await self.backend.complete.remote(str(body.get("prompt", "")))
            return {"object": "text_completion", "model": model, "choices": [{"index": 0, "text": text}]}

    return Ingress.bind(Backend.bind())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--ray-defaults", action="store_true", help="plain ray.init, Ray's and Serve's own periods")
    args = ap.parse_args(argv)

    import contextlib
    import logging

    import ray
    from ray import serve

    from cluster.local import LocalCluster

    def say(line: str) -> None:
        print(f"serve-floor: {line}", flush=True)

    with contextlib.ExitStack() as stack:
        if args.ray_defaults:
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
            stack.callback(ray.shutdown)
            say("Ray started: plain ray.init, Ray's and Serve's defaults")
        else:
            quiet = {"logging_level": logging.WARNING}
            cluster = LocalCluster(redis_url=NO_REDIS, on_phase=say, ray_init_kwargs=quiet, ray_dashboard=False)
            stack.enter_context(cluster)
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(args.served_model_name), name="floor", route_prefix="/")
        say(f"ready on http://127.0.0.1:{args.port} (Ctrl-C stops)")
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            say("stopping")
        finally:
            serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
