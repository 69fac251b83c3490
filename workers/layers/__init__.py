"""Layers a model is built from that the engine also drives: paged attention over the paged KV
cache. The models and the engine both import these; neither imports the other for them."""
