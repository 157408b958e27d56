"""Cluster-scale simulator: WAR's router policies and speculator over simulated replicas.

Knows: virtual time, cost models of accelerators (``costs``, ``profile``), simulated
replicas (``settings``, ``replica``: continuous batching, KV blocks with a radix
prefix cache; ``speculation``: the engine's load-aware speculation budget), drafting
from the real suffix speculator (``drafter``, ``acceptance``, ``fastpath``), trace and
synthetic workloads of synchronous RL steps (``workload``, ``synthetic``), the event
loop (``simulator``), metrics and the lower bound of a step's makespan (``metrics``),
experiments from YAML, their targets and plots (``experiment``, ``report``, ``plots``).
Does not know real models: a step's duration comes from a cost model, a response's
tokens from a trace. docs/sim.md describes the model and its approximations.
"""
