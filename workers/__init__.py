"""pdserve workers: the engine, models, KV transfer and the prefill/decode workers."""
