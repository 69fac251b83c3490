"""pdserve deployment: Ray Serve application, routers and the CLI."""
