"""Which role each GPU of the des engine has, and which GPUs move when libra changes the split.

Owned by ``pipeline.sim.des.AsyncSim`` (one per run, in the CLI process of
``libra-ctl bench policy``). The engine carries the moves out (a rollout GPU
hands its work back, a learner GPU finishes its step, every GPU then switches
for ``switch_cost_s``); this module keeps the books: the role per GPU, the
allocation ordered, and the learner GPUs that take part in the next step.

In a pool of several jobs (``pipeline.sim.pool``) each job's engine sees the
whole pool: the GPUs it does not hold are ``AWAY``, and a job's allocation may
grow (GPUs ``inbound`` from the pool) or shrink (GPUs leaving for the pool).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pipeline.control.allocator import Allocation
from pipeline.dataplane.keys import ROLES
from pipeline.sim.stages import RolloutSlots
from pipeline.sim.workload import Reward

ROLLOUT, LEARNER, REWARD, SWITCHING, AWAY = 0, 1, 2, 3, 4
ROLE_CODE = {"rollout": ROLLOUT, "learner": LEARNER, "reward": REWARD}
ROLE_NAME = {c: r for r, c in ROLE_CODE.items()}


class Moves(NamedTuple):
    """What a new allocation asks of one job's GPUs (``Roles.moves``).

    ``internal``: (gpu, source, new role code) for GPUs that change role inside
    the job; ``outgoing``: (gpu, source) for GPUs that leave the job;
    ``incoming``: the roles that GPUs from outside the job are to fill. A
    source is a role name for a GPU working in it, or where a GPU not working
    yet stands: ``"inbound"`` (on its way from the pool), ``"switching"`` (to
    another role of the job), ``"leaving"`` (a learner GPU due to leave at the
    step's end).
    """

    internal: list[tuple[int, str, int]]
    outgoing: list[tuple[int, str]]
    incoming: list[str]


class Roles:
    """Each GPU's role (a code above) and the allocation ordered, switches included."""

    def __init__(self, alloc: Allocation, gpus: int, held: np.ndarray | None = None):
        """GPUs ``held`` (default: all ``gpus``) take ``alloc``'s roles in order; the others are away."""
        held = np.arange(gpus) if held is None else np.asarray(held, dtype=np.int64)
        if alloc.total != len(held) or min(alloc.rollout, alloc.learner) < 1:
            raise ValueError(f"allocation {alloc.as_dict()} does not fit {len(held)} GPUs with >= 1 rollout "
                             "and learner")
        self.code = np.full(gpus, AWAY, dtype=np.int8)
        self.code[held[:alloc.rollout]] = ROLLOUT
        self.code[held[alloc.rollout:alloc.rollout + alloc.learner]] = LEARNER
        self.code[held[alloc.rollout + alloc.learner:]] = REWARD
        self.switch_dest = np.full(gpus, -1, dtype=np.int8)   # role code a SWITCHING GPU is heading for
        self.switch_id = np.zeros(gpus, dtype=np.int64)       # its current switch (a retargeted one is void)
        self.inbound: dict[int, int] = {}          # GPUs ordered from the pool, not arrived yet: role code
        self.target = alloc                        # the allocation ordered (switches included)
        self.changed_from: Allocation | None = None
        # the job's start counts as its last change, as the control plane's allocation record has it
        # (changed_at set when the job is created): no move while the window still holds the first fill
        self.last_change_t = 0.0
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

    def moves(self, new: Allocation, slots: RolloutSlots) -> Moves:
        """The GPUs that leave roles above their count in ``new`` and the roles below it that they fill.

        Leavers pair with the roles gaining, in role order; with a smaller
        total the leavers left over leave the job, with a larger one the roles
        left over are filled from outside it.
        """
        cur = self.target
        gaining = [r for r in ROLES for _ in range(max(0, new.get(r) - cur.get(r)))]
        leaving = []
        for r in ROLES:
            k = cur.get(r) - new.get(r)
            if k > 0:
                leaving += self._pick_leavers(r, k, slots)
        n = min(len(leaving), len(gaining))
        return Moves(internal=[(gpu, src, ROLE_CODE[dest]) for (gpu, src), dest in zip(leaving, gaining)],
                     outgoing=leaving[n:], incoming=gaining[n:])

    def _pick_leavers(self, role: str, k: int, slots: RolloutSlots) -> list[tuple[int, str]]:
        """Which k GPUs leave ``role``: first those not working in it yet, then working ones.

        A GPU on its way to the role (from the pool, switching from another
        role, or a learner GPU due to leave for it at the step's end) turns
        round at no cost. Among working ones, rollout GPUs with the least work
        in flight lose the least.
        """
        code = ROLE_CODE[role]
        out = [(g, "inbound") for g, c in sorted(self.inbound.items()) if c == code]
        out += [(int(g), "switching") for g in np.flatnonzero((self.code == SWITCHING) & (self.switch_dest == code))]
        out += [(g, "leaving") for g, dest in self.learner_leaving if dest == code]
        gpus = np.flatnonzero(self.code == code)
        if role == "learner":
            leaving = {g for g, _ in self.learner_leaving}
            gpus = np.array([g for g in gpus if g not in leaving], dtype=np.int64)
        if role == "rollout" and len(out) < k:
            work = slots.work_per_gpu()[gpus]
            gpus = gpus[np.argsort(work, kind="stable")]
        out += [(int(g), role) for g in gpus[:max(0, k - len(out))]]
        if len(out) < k:
            raise RuntimeError(f"{role} holds {len(out)} GPUs in all, {k} were to leave: the books disagree")
        return out[:k]

    def committed(self) -> Allocation:
        """GPUs per role counting where every GPU of the job is bound: equals ``target`` when the books agree."""
        n = {r: int((self.code == c).sum()) + int(((self.code == SWITCHING) & (self.switch_dest == c)).sum())
             for r, c in ROLE_CODE.items()}
        for _gpu, dest in self.learner_leaving:
            n["learner"] -= 1
            if dest != AWAY:
                n[ROLE_NAME[dest]] += 1
        for c in self.inbound.values():
            n[ROLE_NAME[c]] += 1
        return Allocation(**n)

    def retarget_leaving(self, gpu: int, dest: int) -> None:
        """A learner GPU due to leave at the step's end goes to ``dest`` instead (to the learner: it stays)."""
        self.learner_leaving = [(g, dest if g == gpu else d) for g, d in self.learner_leaving
                                if g != gpu or dest != LEARNER]

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
