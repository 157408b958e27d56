"""One replica's speculation in a step: drafts, the load-aware budget, verification.

Knows: the replica's drafter, its ``SpecPolicy`` (the engine's, unchanged: in
``"auto"`` mode it chooses each sequence's draft tokens from the drafts' probabilities
and its time model, which it learns from the cost model's step times), the mode
(``"always"``: whole drafts, what ``SpecPolicy.choose`` returns then, without asking
it; ``"off"``: no drafting at all) and how often the policy decides
(``interval``: every step, as in the engine, or every ``interval`` steps at cluster
scale: in between, a sequence keeps its last budget, cut to its current draft, and
the policy learns only from the deciding steps). Draft tokens get KV slots only when
blocks are free (no preemption for a draft). Does not know scheduling or time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from war.engine.spec_policy import SpecPolicy
from war.sim.drafter import Drafter, FloatArray
from war.sim.kvcache import PrefixKV
from war.sim.sequence import SimSeq


class Speculation:
    """Draft budgets and outcomes of a replica's steps (module docstring)."""

    def __init__(self, drafter: Drafter | None, policy: SpecPolicy, mode: str,
                 max_spec_tokens: int, interval: int = 1) -> None:
        self.drafter = drafter if mode != "off" else None
        self.policy = policy
        self.mode = mode
        self.cap = max_spec_tokens
        self.interval = interval
        self.decided = False  # the last step's budgets were chosen by the policy
        self._since = 0

    def plan(self, decodes: Sequence[SimSeq], base: int, context: int, room: int,
             kv: PrefixKV) -> tuple[list[int], list[int]]:
        """Draft tokens each decoding sequence verifies this step and how many of them
        are accepted; ``base`` and ``context``: the step's tokens and context without
        drafts; ``room``: tokens left in the step's budget."""
        self.decided = False
        n = len(decodes)
        drafter = self.drafter
        if drafter is None or n == 0:
            return [0] * n, [0] * n
        lens = drafter.propose(decodes, [s.request.sampling.max_tokens - s.generated - 1
                                         for s in decodes])
        probs: list[FloatArray] = []
        if self.mode == "always":
            counts = lens
        else:
            counts = [s.budget for s in decodes]
            self._since += 1
            if self._since >= self.interval or min(counts) < 0:
                self.decided, self._since = True, 0
                probs = [drafter.probs(i) for i in range(n)]
                counts = self.policy.choose(probs, base, context).tolist()
                for s, k in zip(decodes, counts, strict=True):
                    s.budget = k
        cap, bs = self.cap, kv.block_size
        ks: list[int] = []
        accs: list[int] = []
        seen_p, seen_a = [], []
        for i, seq in enumerate(decodes):
            k = min(counts[i], lens[i], cap, room)
            if k > 0:
                ntok = seq.nprompt + seq.generated
                need = -(-(ntok + k) // bs) - seq.cached // bs - seq.private
                if need > 0:
                    if kv.allocate(need):
                        seq.private += need
                    else:
                        k = max(0, min(k, (seq.cached // bs + seq.private) * bs - ntok))
            if k > 0:
                room -= k
                a = drafter.verify(i, k)
                if self.decided:
                    mask = np.zeros(k, dtype=bool)
                    mask[list(drafter.last_path)] = True
                    seen_p.append(probs[i][:k])
                    seen_a.append(mask)
                ks.append(k)
                accs.append(a)
            else:
                ks.append(0)
                accs.append(0)
        if seen_p:
            self.policy.observe_verification(np.concatenate(seen_p), np.concatenate(seen_a))
        return ks, accs

    def observe_step(self, batch_tokens: int, context_tokens: int, seconds: float) -> None:
        """The step's duration, for the policy's time model (deciding steps only)."""
        if self.decided:
            self.policy.observe_step(batch_tokens, context_tokens, seconds)
