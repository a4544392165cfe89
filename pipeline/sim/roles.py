"""Which role each GPU of the des engine has, and which GPUs move when libra changes the split.

Owned by ``pipeline.sim.des.AsyncSim`` (one per run, in the CLI process of
``libra-ctl bench policy``). The engine carries the moves out (a rollout GPU
hands its work back, a learner GPU finishes its step, every GPU then switches
for ``switch_cost_s``); this module keeps the books: the role per GPU, the
allocation ordered, and the learner GPUs that take part in the next step.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.control.allocator import Allocation
from pipeline.dataplane.keys import ROLES
from pipeline.sim.stages import RolloutSlots
from pipeline.sim.workload import Reward

ROLLOUT, LEARNER, REWARD, SWITCHING = 0, 1, 2, 3
ROLE_CODE = {"rollout": ROLLOUT, "learner": LEARNER, "reward": REWARD}


class Roles:
    """Each GPU's role (a code above) and the allocation ordered, switches included."""

    def __init__(self, alloc: Allocation, gpus: int):
        if alloc.total != gpus or min(alloc.rollout, alloc.learner) < 1:
            raise ValueError(f"allocation {alloc.as_dict()} does not fit {gpus} GPUs with >= 1 rollout and learner")
        self.code = np.full(gpus, ROLLOUT, dtype=np.int8)
        self.code[alloc.rollout:alloc.rollout + alloc.learner] = LEARNER
        self.code[alloc.rollout + alloc.learner:] = REWARD
        self.target = alloc                        # the allocation ordered (switches included)
        self.changed_from: Allocation | None = None
        self.last_change_t = -math.inf
        self.reconfigs = 0
        self.n_learner = alloc.learner             # learner GPUs that take part in the next step
        self.learner_leaving: list[tuple[int, int]] = []   # (gpu, destination role) at the step's end

    def count(self, code: int) -> int:
        return int((self.code == code).sum())

    def reward_workers(self, reward: Reward) -> int:
        """Reward workers now: the reward GPUs, or the CPU pool's size."""
        return self.count(REWARD) if reward.gpu else reward.cpu_workers

    def counts(self) -> dict[str, int]:
        """GPUs per role right now, switching ones apart (a timeline entry)."""
        return {"rollout": self.count(ROLLOUT), "learner": self.count(LEARNER), "reward": self.count(REWARD),
                "switching": self.count(SWITCHING)}

    def moves(self, new: Allocation, slots: RolloutSlots) -> list[tuple[int, str, int]]:
        """GPUs that leave roles above their count in ``new`` for roles below it: (gpu, role, new role code)."""
        cur = self.target
        gaining = [r for r in ROLES for _ in range(max(0, new.get(r) - cur.get(r)))]
        leaving = []
        for r in ROLES:
            k = cur.get(r) - new.get(r)
            if k > 0:
                leaving += self._pick_leavers(r, k, slots)
        return [(gpu, src, ROLE_CODE[dest]) for (gpu, src), dest in zip(leaving, gaining)]

    def _pick_leavers(self, role: str, k: int, slots: RolloutSlots) -> list[tuple[int, str]]:
        """Which GPUs leave ``role``: rollout GPUs with the least work in flight lose the least."""
        gpus = np.flatnonzero(self.code == ROLE_CODE[role])
        if role == "learner":
            leaving = {g for g, _ in self.learner_leaving}
            gpus = np.array([g for g in gpus if g not in leaving], dtype=np.int64)
        if role == "rollout":
            work = slots.work_per_gpu()[gpus]
            gpus = gpus[np.argsort(work, kind="stable")]
        return [(int(g), role) for g in gpus[:k]]

    def ordered(self, new: Allocation, t: float) -> None:
        """``new`` is the allocation ordered from t on."""
        self.changed_from, self.target = self.target, new
        self.reconfigs += 1
        self.last_change_t = t

    def release_learners(self) -> list[tuple[int, int]]:
        """The step ended: the learner GPUs that were due to leave go now, (gpu, destination role)."""
        out, self.learner_leaving = self.learner_leaving, []
        self.n_learner -= len(out)
        return out
