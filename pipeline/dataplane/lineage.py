"""Policy versions as a tree of lines: how many learner updates lie between two sets of weights.

Written by the learner (``workers.learner``, and the sim learner
``pipeline.sim.worker``) when it starts a line; read by the same learners to
judge staleness, and by ``libra-ctl audit``. No process other than the one
learner writes it.

A learner numbers its weights with consecutive versions, one per update, so
along one learner's life version ``v`` holds ``updates(start) + (v - start)``
updates. A restore starts a new line: a new, higher version ``W`` whose
weights are those of the checkpoint's version ``c`` (0 updates between them,
``parent = c``). The versions the dead learner made after ``c`` are a
discarded branch: they exist, rollouts may have sampled from them, but the
current weights do not descend from them.

The tree is a set of segments, one per line start: ``start -> (updates at
start, parent version or None)``. A version belongs to the segment with the
greatest start not above it (a restore's ``W`` exceeds every version
published before it, so lines never interleave). Staleness counts the
updates between a version and the head along the tree: for an ancestor of
the head, ``updates(head) - updates(v)``; for a version on a discarded branch,
the updates from it back to the fork plus those from the fork to the head,
the amount its samples are off-policy by.

Stored in Redis (``JobKeys.lineage``: a hash, start -> JSON) and in each
checkpoint's ``state.json`` (``"lineage"``), so a restore knows its own line
from the checkpoint and the branches left since from Redis.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

import redis

from pipeline.dataplane.keys import JobKeys


@dataclass(frozen=True)
class Distance:
    """Updates between a version's weights and the head's, and whether the head descends from it."""

    updates: int | None   # None: a version the tree does not know
    on_line: bool         # an ancestor of the head (or the head): its work is the restored lineage's


@dataclass
class Lineage:
    """The version tree: line start -> (updates at that version, parent version or None)."""

    segments: dict[int, tuple[int, int | None]] = field(default_factory=lambda: {0: (0, None)})
    # the line starts in order, sorted again only when a line was added (staleness asks for every group in hand)
    _starts: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    # --- reading the tree -------------------------------------------------------------------------

    def start_of(self, version: int) -> int | None:
        """The first version of the line ``version`` belongs to (None below the first line)."""
        if len(self._starts) != len(self.segments):   # lines are only ever added
            self._starts = sorted(self.segments)
        starts = self._starts
        i = bisect.bisect_right(starts, version) - 1
        return starts[i] if i >= 0 else None

    def updates(self, version: int) -> int | None:
        """Learner updates the weights of ``version`` hold (its step)."""
        start = self.start_of(version)
        if start is None:
            return None
        return self.segments[start][0] + (version - start)

    def line(self, version: int) -> dict[int, int]:
        """The versions ``version`` descends from, as line start -> the newest ancestor on that line."""
        out: dict[int, int] = {}
        v: int | None = version
        while v is not None:
            start = self.start_of(v)
            if start is None or start in out:
                break
            out[start] = v
            v = self.segments[start][1]
        return out

    def distance(self, version: int, head: int) -> Distance:
        """Updates between ``version`` and ``head`` (the learner's version), through their newest common ancestor."""
        if self.start_of(version) is None or self.start_of(head) is None:
            return Distance(None, False)
        version = self.first_holder(version)
        head_line, line = self.line(head), self.line(version)
        common = [min(head_line[s], line[s]) for s in head_line.keys() & line.keys()]
        if not common:
            return Distance(None, False)
        fork = max(common)  # along a line versions grow from the root: the newest common ancestor is the greatest
        on_line = fork == version
        up_head, up_v, up_fork = self.updates(head), self.updates(version), self.updates(fork)
        return Distance((up_head - up_fork) + (up_v - up_fork), on_line)

    def first_holder(self, version: int) -> int:
        """The oldest version with ``version``'s weights: a restore's line starts with its parent's weights,
        0 updates on (a restore that died before training, and the next one from the same checkpoint, leave
        several such starts), so its groups are as on the line as the parent's."""
        while version in self.segments:
            updates, parent = self.segments[version]
            if parent is None or parent >= version or updates != self.updates(parent):
                break
            version = parent
        return version

    # --- growing it ---------------------------------------------------------------------------------

    def start_line(self, version: int, updates: int, parent: int | None) -> None:
        """A new line from ``version``: the weights of ``parent``, which hold ``updates`` (a restore)."""
        self.segments[version] = (updates, parent)

    # --- storage -------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {str(s): {"updates": u, "parent": p} for s, (u, p) in sorted(self.segments.items())}

    @staticmethod
    def segments_from_json(raw: dict) -> dict[int, tuple[int, int | None]]:
        return {int(s): (int(v["updates"]), None if v["parent"] is None else int(v["parent"]))
                for s, v in raw.items()}


def restored(stored: dict[int, tuple[int, int | None]], ckpt_state: dict | None) -> Lineage:
    """The tree a restoring learner works with: its checkpoint's own lines, and every line Redis recorded since.

    A checkpoint written before lineage was recorded holds one straight line
    (its version minus its step is where that line started); with no
    checkpoint, the tree is the initial policy's line (version 0) and Redis's.
    """
    if ckpt_state is None:
        own = {0: (0, None)}
    elif "lineage" in ckpt_state:
        own = Lineage.segments_from_json(ckpt_state["lineage"])
    else:
        own = {ckpt_state["version"] - ckpt_state["step"]: (0, None)}
    return Lineage({**stored, **own})


def load_segments(r: redis.Redis, keys: JobKeys) -> dict[int, tuple[int, int | None]]:
    """Every line start recorded for the job (the restored lines and the discarded branches)."""
    return Lineage.segments_from_json({k.decode(): json.loads(v) for k, v in r.hgetall(keys.lineage).items()})


def record_line(pipe, keys: JobKeys, lineage: Lineage, start: int) -> None:
    """Queue the write of the line starting at ``start`` (before any version of it is published)."""
    updates, parent = lineage.segments[start]
    pipe.hset(keys.lineage, str(start), json.dumps({"updates": updates, "parent": parent}))
