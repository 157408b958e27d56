"""The global scheduler: which replica serves each request.

Knows: replicas' load and (approximately) cached prefixes, trajectories, groups,
health, retries and shared draft history. Does not know how a replica computes
(``war.backends`` reaches them).
"""
