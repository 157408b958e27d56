"""A replica stand-in for the rollout tests that records its starts and closes."""

from __future__ import annotations


class RecordingReplica:
    """Appends "start NAME" / "close NAME" to ``events``; ``start`` raises if ``fails``."""

    def __init__(self, name: str, fails: bool, events: list[str]) -> None:
        self.name, self.fails, self.events = name, fails, events

    def start(self) -> None:
        if self.fails:
            raise RuntimeError(f"{self.name} cannot start")
        self.events.append(f"start {self.name}")

    async def close(self) -> None:
        self.events.append(f"close {self.name}")
