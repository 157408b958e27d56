"""The replica engine: a model, paged KV cache with a radix prefix cache,
continuous batching, lossless verification of suffix drafts and sampling.

Knows: models, KV blocks, batching, verification, sampling, load. Does not know:
routing, environments, HTTP (``war.engine.server`` is the HTTP edge).
"""
