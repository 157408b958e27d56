"""The replay harness's accounting, driven by a scripted fake speculator."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from war.spec.config import SpecConfig
from war.spec.replay import (
    MODES,
    ReplayReport,
    accepted_len,
    baseline_config,
    mode_config,
    ratios,
    replay,
    replay_by_file,
    rl_steps,
)
from war.spec.traces import TokenArray, Trajectory, Turn


@dataclass(frozen=True)
class FakeDraft:
    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    source: str = "none"


def chain(*tokens: int, source: str = "local") -> FakeDraft:
    return FakeDraft(tokens, tuple(range(-1, len(tokens) - 1)), source)


@dataclass
class FakeSpeculator:
    """Returns, for each sequence, the drafts of `script[seq_id]` in order (then empty
    drafts), and records every call."""

    script: dict[int, list[FakeDraft]]
    calls: list[tuple[object, ...]] = field(default_factory=list)
    proposed: dict[int, int] = field(default_factory=dict)

    def start(self, seq_id: int, prompt_ids: TokenArray, group_id: Hashable | None = None) -> None:
        self.calls.append(("start", seq_id, tuple(prompt_ids.tolist()), group_id))

    def extend(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self.calls.append(("extend", seq_id, tuple(token_ids)))

    def end_response(self, seq_id: int) -> None:
        self.calls.append(("end_response", seq_id))

    def new_turn(self, seq_id: int, new_prompt_ids: TokenArray) -> None:
        self.calls.append(("new_turn", seq_id, tuple(new_prompt_ids.tolist())))

    def finish(self, seq_id: int, commit: bool = True) -> None:
        self.calls.append(("finish", seq_id))

    def observe_step(self, rl_step: int) -> None:
        self.calls.append(("observe_step", rl_step))

    def propose(self, seq_ids: Sequence[int], budgets: int | None = None) -> list[FakeDraft]:
        self.calls.append(("propose", tuple(seq_ids), budgets))
        out = []
        for seq_id in seq_ids:
            i = self.proposed.get(seq_id, 0)
            self.proposed[seq_id] = i + 1
            drafts = self.script.get(seq_id, [])
            out.append(drafts[i] if i < len(drafts) else FakeDraft())
        return out

    def memory_bytes(self) -> int:
        return 1000

    @property
    def num_cached_tokens(self) -> int:
        return 40


def arr(*tokens: int) -> TokenArray:
    return np.array(tokens, dtype=np.int32)


def traj(
    task_id: str, trial: int, turns: list[tuple[list[int], list[int]]], file: str = "a"
) -> Trajectory:
    return Trajectory(
        task_id=task_id,
        trial=trial,
        source="test",
        file=file,
        reward=None,
        turns=tuple(Turn(arr(*p), arr(*r)) for p, r in turns),
    )


# Trajectory 0: responses [10..14] and [20, 21]; the script below is worked out by hand.
TRAJ0 = traj("t", 0, [([1, 2], [10, 11, 12, 13, 14]), ([3], [20, 21])])
SCRIPT0 = [
    # 10, 11 accepted, 99 rejected; bonus 12 -> emits [10, 11, 12]
    chain(10, 11, 99, source="group"),
    # tree: root children 50 (0) and 13 (1); 13's children 14 (2) and 60 (3).
    # 13, 14 accepted; the response ends there, so no bonus token -> emits [13, 14]
    FakeDraft((50, 13, 14, 60), (-1, -1, 1, 1), "local"),
    # empty draft: only the bonus token -> emits [20]
    FakeDraft(),
    # 21 accepted, then the response ends: 22, 23 cannot be verified -> emits [21]
    chain(21, 22, 23, source="global"),
]


def test_accepted_len_chain() -> None:
    target = [5, 6, 7, 8]
    assert accepted_len(*_c(5, 6, 7), target, 0) == 3
    assert accepted_len(*_c(5, 6, 9, 8), target, 0) == 2
    assert accepted_len(*_c(9, 6), target, 0) == 0
    assert accepted_len(*_c(), target, 0) == 0
    assert accepted_len(*_c(7, 8, 9), target, 2) == 2  # bounded by the end of target
    assert accepted_len(*_c(7), target, 4) == 0


def _c(*tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    d = chain(*tokens)
    return d.token_ids, d.parents


def test_accepted_len_tree() -> None:
    target = [1, 2, 3, 4]
    # root -> 9 (0), 1 (1); 1 -> 7 (2), 2 (3); 9 -> 2 (4); 2(3) -> 3 (5); 2(4) -> 3 (6)
    tokens, parents = (9, 1, 7, 2, 2, 3, 3), (-1, -1, 1, 1, 0, 3, 4)
    assert accepted_len(tokens, parents, target, 0) == 3
    assert accepted_len(tokens, parents, target, 1) == 0  # no 2 among the root's children
    assert accepted_len(tokens, parents, [9, 2, 3], 0) == 3
    assert accepted_len(tokens, parents, [1, 7, 3], 0) == 2  # 7 is a leaf
    # duplicate siblings: the first in emission order is taken, its subtree decides
    assert accepted_len((1, 1, 2), (-1, -1, 1), target, 0) == 1


def test_accepted_len_rejects_malformed_drafts() -> None:
    with pytest.raises(ValueError, match="parents"):
        accepted_len((1, 2), (-1,), [1, 2], 0)
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        accepted_len((1, 2), (-1, 1), [1, 2], 0)
    with pytest.raises(ValueError, match=r"parents\[0\] = -2"):
        accepted_len((1,), (-2,), [1], 0)
    with pytest.raises(ValueError, match="start 3"):
        accepted_len((1,), (-1,), [1, 2], 3)
    assert accepted_len((1,), (-1,), [1, 2], 2) == 0


def test_sequential_calls_and_accounting() -> None:
    fakes: list[FakeSpeculator] = []

    def make() -> FakeSpeculator:
        fakes.append(FakeSpeculator({0: list(SCRIPT0)}))
        return fakes[-1]

    report = replay([TRAJ0], make, budget=7)
    seq = [c for c in fakes[0].calls if c[0] != "propose"]
    assert seq == [
        ("start", 0, (1, 2), "t"),
        ("extend", 0, (10, 11, 12)),
        ("extend", 0, (13, 14)),
        ("end_response", 0),
        ("new_turn", 0, (3,)),
        ("extend", 0, (20,)),
        ("extend", 0, (21,)),
        ("end_response", 0),
        ("finish", 0),
    ]
    assert [c for c in fakes[0].calls if c[0] == "propose"] == [("propose", (0,), 7)] * 4
    assert report.num_trajectories == 1
    assert report.num_turns == 2
    assert report.num_steps == 4
    assert report.num_prompt_tokens == 3
    assert report.num_generated_tokens == 7
    assert report.num_proposed_tokens == 3 + 4 + 0 + 3
    assert report.num_accepted_tokens == 2 + 2 + 0 + 1
    assert report.tokens_per_step == 7 / 4
    assert report.acceptance_rate == 5 / 10
    assert report.mean_draft_len == 10 / 4
    assert report.source_steps == {"global": 1, "group": 1, "local": 1, "none": 1}
    assert report.source_accepted == {"global": 1, "group": 2, "local": 2, "none": 0}
    assert report.memory_bytes == 1000 and report.num_cached_tokens == 40
    assert report.bytes_per_cached_token == 25.0
    # the batched pass sees the same drafts
    assert report.tokens_per_step_batched == 7 / 4
    assert report.acceptance_rate_batched == 5 / 10
    assert report.mean_batch == 1.0
    for name in (
        "propose_us_p50", "append_us_p99", "response_end_us_p50", "turn_start_us_p50",
        "finish_us_p50",
    ):
        assert getattr(report, name) > 0.0


def test_batched_pass_is_lockstep_in_groups() -> None:
    trajs = [
        traj("a", 0, [([1], [5, 6, 7])]),  # 3 steps with empty drafts
        traj("b", 0, [([1], [5]), ([2], [6])]),  # 2 steps
        traj("a", 1, [([1], [5, 6])]),  # 2 steps
    ]
    fakes: list[FakeSpeculator] = []

    def make() -> FakeSpeculator:
        fakes.append(FakeSpeculator({}))
        return fakes[-1]

    report = replay(trajs, make, batch_size=2)
    batched = fakes[1].calls
    assert [c[1] for c in batched if c[0] == "propose"] == [
        (0, 1),
        (0, 1),
        (0,),
        (2,),
        (2,),
    ]
    assert batched[:2] == [("start", 0, (1,), "a"), ("start", 1, (1,), "b")]
    assert ("new_turn", 1, (2,)) in batched
    i = batched.index(("new_turn", 1, (2,)))
    assert ("end_response", 1) in batched[:i]  # the response ended before the next turn
    # "a" trial 1 is the task's second trajectory: RL step 1, announced before its start
    i = batched.index(("observe_step", 1))
    assert batched[i + 1] == ("start", 2, (1,), "a")
    assert [c for c in fakes[0].calls if c[0] == "observe_step"] == [("observe_step", 1)]
    assert fakes[0].calls[fakes[0].calls.index(("observe_step", 1)) + 1][:2] == ("start", 2)
    assert report.mean_batch == (2 + 2 + 1 + 1 + 1) / 5
    assert report.num_steps == 7 and report.tokens_per_step == 1.0
    assert report.batch_size == 2 and report.num_full_batch_calls == 2
    d = report.to_dict()
    assert "propose_us_p50_batched2" in d and "propose_us_p50_batched" not in d


def test_zero_draft_run_and_empty_input() -> None:
    report = replay([], lambda: FakeSpeculator({}))
    assert report.num_steps == 0 and report.tokens_per_step == 0.0
    assert report.propose_us_p50 == 0.0
    assert replay([TRAJ0], lambda: FakeSpeculator({})).acceptance_rate == 0.0


def test_replay_by_file_sums_the_files() -> None:
    t_a = traj("t", 0, [([1], [5, 6])], file="a.jsonl")
    t_b = traj("u", 0, [([1], [7, 8, 9])], file="b.jsonl")
    report = replay_by_file([t_a, t_b], lambda: FakeSpeculator({0: [chain(5, 6)]}))
    assert set(report.per_file) == {"a.jsonl", "b.jsonl"}
    # each file is its own workload: seq ids restart at 0, so both get the scripted draft
    a, b = report.per_file["a.jsonl"], report.per_file["b.jsonl"]
    assert (a.num_steps, a.num_accepted_tokens) == (1, 2)
    assert (b.num_steps, b.num_accepted_tokens) == (3, 0)
    assert report.num_steps == 4 and report.num_generated_tokens == 5
    assert report.num_accepted_tokens == 2 and report.num_proposed_tokens == 4
    assert report.memory_bytes == 2000 and report.bytes_per_cached_token == 25.0
    assert report.source_steps == {"local": 2, "none": 2}
    assert report.source_accepted == {"local": 2, "none": 0}
    d = report.to_dict()
    assert isinstance(d["per_file"], dict) and "tokens_per_step" in d["per_file"]["a.jsonl"]
    # Keyed by the batch asked for; one trajectory per file: batches of one.
    assert "propose_us_p50_batched64" in d and d["batch_size"] == 1
    assert ratios(report, report)["tokens_per_step"] == 1.0


def test_full_batch_latencies_pool_only_equal_batches() -> None:
    t_a = [traj("t", i, [([1], [5, 6])], file="a.jsonl") for i in range(3)]
    t_b = [traj("u", 0, [([1], [7, 8, 9])], file="b.jsonl")]
    report = replay_by_file([*t_a, *t_b], lambda: FakeSpeculator({}), batch_size=2)
    a, b = report.per_file["a.jsonl"], report.per_file["b.jsonl"]
    # a: groups {0, 1} (2 calls of 2) and {2} (2 calls of 1); b: 3 calls of 1
    assert (a.batch_size, a.num_full_batch_calls, a.mean_batch) == (2, 2, 1.5)
    assert (b.batch_size, b.num_full_batch_calls) == (1, 3)
    assert (report.batch_size, report.num_full_batch_calls) == (2, 2)
    assert report.mean_batch == (2 + 2 + 1 + 1 + 1 + 1 + 1) / 7
    assert "propose_us_p99_batched2" in report.to_dict()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        replay([TRAJ0], lambda: FakeSpeculator({}), batch_size=0)
    with pytest.raises(ValueError, match="budget"):
        replay([TRAJ0], lambda: FakeSpeculator({}), budget=-1)
    for kwargs in ({"batch_size": 2.5}, {"batch_size": True}, {"budget": 1.5}, {"budget": True}):
        with pytest.raises(ValueError, match=r"batch_size|budget"):
            replay([TRAJ0], lambda: FakeSpeculator({}), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        replay_by_file([], lambda: FakeSpeculator({}), batch_size=0)  # no file to replay


def test_mode_presets() -> None:
    assert MODES == ("path", "tree")
    assert mode_config("path") == SpecConfig()
    assert mode_config("tree") == SpecConfig.tree_preset() and mode_config("tree").tree
    base = baseline_config("tree", max_depth=32)
    assert (base.tree, base.factor, base.group_weight, base.alpha, base.max_depth) == (
        True, 2.0, 0.0, 0.0, 32,
    )
    assert not baseline_config("path").tree and baseline_config("path").factor == 1.0
    assert isinstance(replay([], lambda: FakeSpeculator({})), ReplayReport)
    with pytest.raises(ValueError, match="unknown mode 'bush'"):
        mode_config("bush")
    with pytest.raises(ValueError, match="unknown mode 'bush'"):
        baseline_config("bush")


def test_rl_steps_count_earlier_trials_of_the_task() -> None:
    trajs = [traj(t, 0, []) for t in ("a", "b", "a", "a", "c", "b")]
    assert rl_steps(trajs) == [0, 0, 1, 2, 0, 1]
