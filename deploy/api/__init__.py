"""The OpenAI-compatible surface: the Serve ingress (routes, request validation, errors,
responses, streaming, conversation reuse)."""
