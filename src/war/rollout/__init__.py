"""Synchronous agentic rollout: agent loop, environments, trajectories."""
