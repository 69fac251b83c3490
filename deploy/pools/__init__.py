"""The worker pools' control plane: the pools as Serve deployments, their routers, how the
ingress calls them, the worker directory and autoscaling."""
