"""One turn of a trajectory being served by a simulated replica.

Knows: the turn's tokens (the whole context it was sent with, the response the trace
says the policy generates), its progress (tokens generated, tokens whose KV is
computed), the KV it holds (a locked cached prefix and a count of private blocks),
its place in the replica's queue (priority, then arrival) and its counters (decode
passes, verified and accepted draft tokens, cached prompt tokens). Does not know
scheduling or memory policy: ``war.sim.replica`` moves it along.
"""

from __future__ import annotations

from war.sim.kvcache import Match, Node
from war.sim.workload import SimTrajectory, Tokens
from war.types import GenRequest


class SimSeq:
    """A request in a replica (attributes documented inline)."""

    __slots__ = (
        "accepted", "budget", "cached", "cached_prompt", "computed", "context", "context_sum",
        "draft", "drafted", "generated", "key", "mark", "match", "node", "nprompt", "order",
        "passes", "preemptions", "priority", "private", "request", "response", "rlen",
        "spec_id", "started", "traj", "turn",
    )

    def __init__(self, request: GenRequest, traj: SimTrajectory, turn: int, context: Tokens,
                 priority: float, order: int) -> None:
        self.request = request
        self.traj = traj
        self.turn = turn
        self.context = context  # the prompt sent: every token before this response
        self.response: Tokens = traj.turns[turn].response
        self.priority = priority  # higher first
        self.order = order  # arrival order on the replica (ties)
        self.key = (-priority, order)  # queue order
        self.nprompt = len(context)
        self.rlen = len(self.response)
        self.generated = 0  # response tokens emitted
        self.computed = 0  # tokens whose KV is computed
        self.node: Node | None = None  # end of the locked cached prefix
        self.match: Match | None = None  # its last prefix-cache lookup (``PrefixKV.match``)
        self.cached = 0  # tokens of the locked cached prefix (whole blocks)
        self.private = 0  # private KV blocks held
        self.spec_id: int | None = None  # the drafter's id of the trajectory
        self.draft: object = None  # the drafter's own state for this turn
        self.budget = -1  # draft tokens last chosen for it (-1: not yet)
        self.mark = -1  # the replica step that last scheduled it
        self.started = False  # admitted once (prefix-hit statistics count only then)
        self.cached_prompt = 0  # prompt tokens served from the prefix cache at first admission
        self.passes = 0  # forward passes that sampled tokens for it
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # draft tokens accepted
        self.context_sum = 0  # sum of its context length over its sampling passes
        self.preemptions = 0

    @property
    def num_prompt(self) -> int:
        return len(self.context)

    @property
    def num_tokens(self) -> int:
        return len(self.context) + self.generated

    @property
    def remaining(self) -> int:
        return len(self.response) - self.generated

    @property
    def prefill_target(self) -> int:
        """Tokens whose KV must exist before it decodes: the whole prompt for a new
        turn (that step samples its first token), all but the pending token after a
        preemption."""
        return self.num_tokens if self.generated == 0 else self.num_tokens - 1

    @property
    def decoding(self) -> bool:
        return self.generated > 0 and self.computed >= self.num_tokens - 1

    def tokens(self, n: int) -> Tokens:
        """The first ``n`` tokens of its context followed by its response."""
        if n == len(self.context):
            return self.context
        if n < len(self.context):
            return self.context[:n]
        return self.context + self.response[:n - len(self.context)]

    def sort_key(self) -> tuple[float, int]:
        return self.key
