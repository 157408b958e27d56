"""Bounds of a rollout run's settings that ``war rollout``/``war demo`` check while
parsing their arguments and ``RunConfig`` checks for a config file (no torch import).

``MAX_REPLICAS``: local replicas of one run, each an engine with its own KV cache in
this process; more is a typo (or a missing unit), not a run. ``MAX_TORCH_THREADS``:
torch's CPU threads; a constant rather than a multiple of this machine's cores, so
that a config file valid on one machine is valid on every other.
"""

from __future__ import annotations

MAX_REPLICAS = 256
MAX_TORCH_THREADS = 1024
