"""Benchmarks: engine, prefix index, KV transfer and serving (``bench/serve.py``)."""
