"""Consecutive decode steps of a lone sequence, without the general planner.

Knows: the arithmetic of one decode step of a replica that runs a single sequence
whose drafts come from an ``AcceptanceTable`` (or that does not speculate) and whose
spec policy is not due to decide (``Speculation.interval``): the draft is the
recorded one at the sequence's position, cut to its budget and to the step's room;
``min(accepted, k)`` of it is accepted; a KV block is taken when the sequence grows
into one; the step's duration is the cost model's. This is exactly what
``SimReplica._plan`` / ``_apply`` compute for such a step (the tests check that runs
with and without it agree), in a tight loop: at cluster scale most steps are of the
long tail's lone sequences. Does not know queues, events or routing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from war.sim.acceptance import RecordedTurn
from war.sim.drafter import CachedDrafter

if TYPE_CHECKING:
    from war.sim.replica import SimReplica


def eligible(replica: SimReplica) -> bool:
    """True when the replica's drafts (if any) come from a table."""
    return replica.drafter is None or isinstance(replica.drafter, CachedDrafter)


def lone_steps(replica: SimReplica, now: float, dt: float, steps: int
               ) -> tuple[float, int, bool]:
    """Runs and applies steps of ``replica``'s only running sequence, which is decoding,
    from ``now + dt`` while ``steps`` < ``max_coalesced_steps``, the spec policy is not
    due and blocks are free; returns the new ``dt`` and ``steps`` and whether the
    sequence's turn is complete."""
    cfg, kv, spec, cost, st = replica.config, replica.kv, replica.spec, replica.cost, replica.stats
    seq = replica.running[0]
    bs, limit = cfg.block_size, cfg.max_coalesced_steps
    room = cfg.max_num_batched_tokens - 1
    mode, cap = spec.mode, spec.cap
    table: RecordedTurn | None = seq.draft if spec.drafter is not None else None  # type: ignore[assignment]
    max_tokens = seq.request.sampling.max_tokens
    g, rlen, nprompt = seq.generated, seq.rlen, seq.nprompt
    while steps < limit:
        if mode == "auto" and (spec._since + 1 >= spec.interval or seq.budget < 0):
            break  # the policy decides this step: the general planner does it
        ntok = nprompt + g
        k = a = 0
        if table is not None and g < len(table.accepted):
            n = table.offsets[g + 1] - table.offsets[g]
            k = min(n, max_tokens - g - 1, cap, room, seq.budget if mode == "auto" else n)
            a = table.accepted[g]
        want = -(-(ntok + max(k, 0)) // bs) - seq.cached // bs - seq.private
        if want > 0:
            if not kv.allocate(want):
                break  # short of blocks: the general planner handles it
            seq.private += want
        k = max(k, 0)
        a = min(a, k)
        if mode == "auto":
            spec._since += 1
        t = cost.step_time(1, 1 + k, ntok + k, k)
        dt += t
        steps += 1
        st.steps += 1
        st.busy_s += t
        st.last_drafted += k
        st.last_decodes += 1
        e = min(a + 1, rlen - g)
        seq.context_sum += ntok
        g += e
        ntok += e
        seq.generated = g
        seq.computed = ntok - 1
        seq.passes += 1
        seq.drafted += k
        seq.accepted += a
        st.passes += 1
        st.generated += e
        st.drafted += k
        st.accepted += a
        keep = -(-ntok // bs) - seq.cached // bs
        if seq.private > keep:
            kv.free(seq.private - keep)
            seq.private = keep
        if g == rlen:
            return dt, steps, True
    return dt, steps, False
