"""The learner's read-ahead: scored groups taken in hand before the batch needs them, last chances first.

A group of version V can be trained in a learner step that starts at most
``max_staleness`` updates after V; after that it is dropped, and its rollout
and reward work is lost. Groups reach the scored stream in the order they
finish, so a group with a long response (or a slow tool) arrives behind
fresher groups that finished faster. While the learner has a backlog, taking
the stream in order trains the fresh groups first and leaves the slow one to
go stale at the next step. With ``learner.last_chance_first`` the learner
reads ahead of the batch in hand (up to ``limit`` groups) and admits first
the groups this step is the last one to take; the others keep their arrival
order, and what the batch does not take stays in hand for the next step.

The groups in hand are delivered to the learner and pending at it, so the
scored stream's lag no longer counts them: the learner publishes how many it
holds in the job's counters (``COUNTER``) and ``learner_backlog`` adds them,
so that rollout backpressure and the controller see the same backlog as
without the read-ahead.

Used by ``workers.learner`` and by the sim backend's learner
(``pipeline.sim.worker``); the des engine applies the same rule to its queue
(``pipeline.sim.des``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

COUNTER = "learner_ahead"   # groups the learner holds read ahead, in the job's counters hash


def limit_groups(batch_size: int, group_size: int, backlog_batches: float, max_staleness: int,
                 last_chance_first: bool) -> int:
    """Groups the learner may hold in hand: the batch plus the backlog the feeder lets wait
    (``streams.backlog_batches``), when it takes last chances first; else none beyond the batch.

    With ``max_staleness`` 0 every admitted group is at its last chance, so
    there is nothing to take first.
    """
    if not last_chance_first or max_staleness <= 0:
        return 0
    return math.ceil((1.0 + backlog_batches) * batch_size / group_size)


def admission_order(staleness: Sequence[int | None], bound: int) -> tuple[list[int], list[int]]:
    """(indices to admit, in order; indices too stale) of groups in hand, given in arrival order.

    ``staleness`` is each group's updates behind the learner (None: from a
    version the learner cannot place, dropped as stale too). A group at
    ``bound`` has this step as its last: those come first, then the rest in
    arrival order.
    """
    stale = [i for i, s in enumerate(staleness) if s is None or s > bound]
    last = [i for i, s in enumerate(staleness) if s == bound]
    rest = [i for i, s in enumerate(staleness) if s is not None and s < bound]
    return last + rest, stale


@dataclass
class InHand:
    """Scored groups read and not yet consumed: (entry id, decoded group, payload as read), in arrival order."""

    limit: int
    items: list[tuple[bytes, Any, bytes]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    def ids(self) -> set[bytes]:
        return {entry_id for entry_id, _g, _p in self.items}

    def read_count(self, want: int, run_wants: int) -> int:
        """How many entries to ask the stream for (0: none, what is in hand can fill the batch), when the
        batch still wants ``want`` groups and the run, this batch included, ``run_wants``: never more in
        hand than the run will take, so that none is left pending at the learner after its last step."""
        return max(0, max(want, min(self.limit, run_wants)) - len(self.items))

    def add(self, entry_id: bytes, group: Any, payload: bytes) -> None:
        self.items.append((entry_id, group, payload))

    def order(self, staleness: Sequence[int | None], duplicate: Sequence[bool], bound: int) -> tuple[list[int], int]:
        """(indices of the groups in hand in the order to consume them; how many of the first are consumed
        whether or not the batch is full), given each one's staleness and whether it was trained before.

        Reading ahead, the stale groups and the duplicates go first (dropped
        and skipped: they will never be trained), then ``admission_order``.
        Without read-ahead (``limit`` 0), every group read, in arrival order,
        as the stream gives it: none stays in hand.
        """
        if not self.limit:
            return list(range(len(self.items))), len(self.items)
        admit, stale = admission_order(staleness, bound)
        dups = [i for i in admit if duplicate[i]]
        return stale + dups + [i for i in admit if not duplicate[i]], len(stale) + len(dups)

    def take(self, order: list[int]) -> list[tuple[bytes, Any, bytes]]:
        """Remove the items at ``order`` (indices into the current list) and return them in that order."""
        chosen = [self.items[i] for i in order]
        gone = set(order)
        self.items = [it for i, it in enumerate(self.items) if i not in gone]
        return chosen
