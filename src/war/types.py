"""Wire types shared by every part of WAR.

Knows: the shape of the values that cross package boundaries. Does not know how
any of them is produced or consumed; it imports nothing from ``war``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Draft:
    """A draft token tree proposed for one sequence.

    ``token_ids[i]`` follows ``token_ids[parents[i]]`` (``-1``: it follows the
    sequence's last token); ``parents[i] < i``. A chain has ``parents == (-1, 0, 1,
    ...)``. ``probs[i]`` is the estimated probability that the path to token ``i``
    is accepted; ``score`` (their sum) is the expected number of accepted tokens.
    ``source`` names where the draft came from (``"group"``, ``"local"``,
    ``"global"`` or ``"none"`` for the empty draft) and ``match_len`` how many
    context tokens it matched.
    """

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]
    score: float
    source: str
    match_len: int

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        """True when every token follows the one before it."""
        return all(p == i - 1 for i, p in enumerate(self.parents))


EMPTY_DRAFT = Draft((), (), (), 0.0, "none", 0)
