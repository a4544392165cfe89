"""The cost-model worker backend (``backend = "sim"``): the stages of a bench workload, sleeping.

``python -m pipeline.sim.worker --role rollout|reward|learner --run-dir D --worker-id W``,
started by a node agent like any other worker. It runs the same stage loop
(``dataplane.streams.run_stage``) over the same streams and message types as
the real workers, but where they would decode, score or train it sleeps for
the time the workload's cost model (``docs/workloads.md``, loaded with
``pipeline.sim.workload``) gives, divided by a time scale: with ``time_scale = 50``
a simulated GPU-minute lasts 1.2 s. So the real controller, agents, streams
and consumer groups can be run and tested with many slots on a CPU machine.

The run's manifest carries ``"sim": {"workload": PATH, "time_scale": X}``, plus
``"job": NAME`` for one job of a multi-job workload
(``pipeline.sim.job.prepare_sim_run`` writes it). What the cost model charges:

- rollout (one process per slot): each call takes whole groups, enough to
  fill ``concurrency`` decode slots, and sleeps their GPU-seconds, per
  trajectory ``prompt / prefill + (response / decode + tool waits) /
  concurrency`` (the fluid rate of a full GPU: the tail of a wave is not
  modelled); a new policy version costs ``weight_sync_s`` before the next call,
  and so does the first load at start;
- reward: a process stands for ``cpu_workers / reward.workers`` scorers (or
  one GPU when ``reward.gpu``) charging ``seconds`` per trajectory;
- learner (one process holding n slots): a step trains the admitted batch's
  tokens at ``train_tokens_per_s * n**scaling_exponent``, then publishes
  (``weight_publish_s``) when the cadence says so (``pipeline.dataplane.cadence``,
  as the real learner). Its step, version and counters live in Redis and are
  written in the transaction that acknowledges the step's entries, so a
  drained or killed learner resumes exactly where it stopped (a checkpoint per
  step), with the world size of its new slots;
- a role change: a slot worker started into a job that has already generated
  first sleeps out the workload's ``switch_cost_s`` (``pay_switch_cost``).

Each stage reports its measured busy, pause and idle seconds and its
trajectories and tokens (``dataplane.worker.CostMeter``) in wall seconds:
the controller sees a faster cluster, never the cost model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.dataplane import messages
from pipeline.dataplane.cadence import publishes, read_cadence
from pipeline.dataplane.keys import GROUP_LEARNER, GROUP_REWARD, GROUP_ROLLOUT, ROLES
from pipeline.dataplane.lineage import load_segments, record_line, restored
from pipeline.dataplane.lookahead import COUNTER as AHEAD_COUNTER
from pipeline.dataplane.lookahead import InHand, limit_groups
from pipeline.dataplane.redisconn import UNAVAILABLE, Outage
from pipeline.dataplane.streams import (dead_letter, decode_entries, ensure_groups, execute_with_backpressure, read,
                                        run_stage, trajectories_of, trim)
from pipeline.dataplane.worker import (SLOTS_ENV, CostMeter, claim_policy, dedup_for, finish_worker, room_downstream,
                                       start_worker)
from pipeline.sim.workload import Workload, load_workload



# --- the cost model (pure; no Redis) ------------------------------------------------------------


@dataclass(frozen=True)
class RolloutCall:
    """What generating some groups costs: GPU-seconds of one slot, and tokens per group."""

    gpu_s: float
    group_tokens: tuple[float, ...]   # prompt + response tokens of each group
    tool_calls: tuple[int, ...]       # per trajectory, in order


class CostModel:
    """The workload's charges for one worker; ``rng`` makes lengths reproducible per worker."""

    def __init__(self, wl: Workload, seed: int):
        self.wl = wl
        self.rng = np.random.default_rng(seed)

    def rollout(self, step: int, groups: int, group_size: int) -> RolloutCall:
        """The charges of ``groups`` generated with the weights of learner step ``step`` (its phase's lengths;
        a restore numbers its versions past the steps, so the phase goes by the step, as in des)."""
        ro, ph = self.wl.rollout, self.wl.job.phase_at(step)
        n = groups * group_size
        resp = ph.response_tokens.sample(self.rng, n)
        tools = ph.tool_calls.sample_wait_s(self.rng, n)
        per_traj = ph.prompt_tokens / ro.prefill_tokens_per_s + (resp / ro.decode_tokens_per_s + tools) / ro.concurrency
        tokens = (resp + ph.prompt_tokens).reshape(groups, group_size).sum(axis=1)
        calls = int(math.ceil(ph.tool_calls.per_trajectory))
        return RolloutCall(gpu_s=float(per_traj.sum()), group_tokens=tuple(float(t) for t in tokens),
                           tool_calls=(calls,) * n)

    def mean_rollout_gpu_s(self, step: int = 0) -> float:
        """Expected GPU-seconds of one trajectory (the allocator's ``rollout_gpu_s_per_traj``)."""
        ro, ph = self.wl.rollout, self.wl.job.phase_at(step)
        return (ph.prompt_tokens / ro.prefill_tokens_per_s
                + (ph.response_tokens.mean() / ro.decode_tokens_per_s + ph.tool_calls.mean_wait_s()) / ro.concurrency)

    def reward_s(self, trajectories: int, lanes: int) -> float:
        return self.wl.reward.seconds * trajectories / max(lanes, 1)

    def train_s(self, tokens: float, gpus: int) -> float:
        le = self.wl.learner
        return tokens / (le.train_tokens_per_s * max(gpus, 1) ** le.scaling_exponent)

    def groups_per_call(self, group_size: int) -> int:
        """Whole groups that fill a rollout GPU's decode slots (at least one)."""
        return max(1, self.wl.rollout.concurrency // group_size)

    def reward_lanes(self, reward_workers: int) -> float:
        """Scorers one reward process stands for: together the processes are the workload's ``cpu_workers``
        (a share of one where they do not divide evenly: 4 over 3 processes is 4/3 each, not 2)."""
        if self.wl.reward.gpu:
            return 1
        return self.wl.reward.cpu_workers / max(reward_workers, 1)


def reward_of(prompt_id: str, sample_idx: int, seed: int) -> float:
    """A reproducible 0/1 reward, so GRPO groups have some spread (the learner ignores it anyway)."""
    return float(zlib.crc32(f"{seed}:{prompt_id}:{sample_idx}".encode()) % 3 == 0)


# --- one run of the sim backend -------------------------------------------------------------


def sim_settings(run_dir: Path) -> dict:
    """The manifest's ``sim`` section: {"workload": path, "time_scale": x}, and "job" for one of [[jobs]]."""
    manifest = json.loads((Path(run_dir) / "manifest.json").read_text())
    sim = manifest.get("sim")
    if not sim:
        raise SystemExit(f"pipeline.sim.worker: {run_dir}/manifest.json has no \"sim\" section; "
                         "prepare the run with pipeline.sim.job.prepare_sim_run")
    return sim


class Clock:
    """Virtual time: sleeping ``s`` simulated seconds takes ``s / scale`` wall seconds."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"time_scale = {scale}: must be > 0")
        self.scale = scale

    def sleep(self, virtual_s: float) -> float:
        """Sleep; returns the wall seconds it took (what the worker reports)."""
        t0 = time.monotonic()
        if virtual_s > 0:
            time.sleep(virtual_s / self.scale)
        return time.monotonic() - t0


# --- the stages --------------------------------------------------------------------------------


class SimRollout:
    """One rollout slot: pays weight loads between calls, charges GPU-seconds per call."""

    def __init__(self, ctx, model: CostModel, clock: Clock, meter):
        self.ctx, self.model, self.clock, self.meter = ctx, model, clock, meter
        self.group_size = ctx.cfg.rollout.group_size
        self.step = 0   # the learner steps the loaded weights hold (the workload's phase goes by it)
        self.load_weights()

    def published_version(self) -> int:
        v = self.ctx.r.hget(self.ctx.keys.policy, "version")
        return int(v) if v is not None else 0

    def load_weights(self, reload: bool = False) -> None:
        version, step = self.ctx.r.hmget(self.ctx.keys.policy, ["version", "step"])
        slept = self.clock.sleep(self.model.wl.rollout.weight_sync_s)
        self.meter.add(pause_s=slept, **({"reload_s": slept, "reloads": 1} if reload else {}))
        self.step = int(step) if step is not None else 0
        self.ctx.set_version(int(version) if version is not None else 0)

    def between(self) -> bool:
        """Reload a newer version, then wait while downstream is full (as the vLLM worker does)."""
        if self.published_version() > self.ctx.policy_version:
            self.load_weights(reload=True)
        return room_downstream(self.ctx, self.group_size, pause_s=0.05)

    def generate(self, msgs: list) -> list:
        """A group per prompt; anything else is dead-lettered, as the vLLM rollout worker does."""
        from pipeline.dataplane.streams import Reject

        prompts = [p for p in msgs if isinstance(p, messages.Prompt)]
        # a read that blocked from before a publication: the weights its prompts were issued at first
        # (the vLLM worker's catch_up)
        if max((p.min_version for p in prompts), default=0) > self.ctx.policy_version:
            self.load_weights(reload=True)
        version, started = self.ctx.policy_version, time.time()
        call = self.model.rollout(self.step, len(prompts), self.group_size)
        wall = self.clock.sleep(call.gpu_s)
        out, k = [], 0
        for p in msgs:
            if not isinstance(p, messages.Prompt):
                out.append(Reject("rollout stage expects a prompt"))
                continue
            trajs = tuple(_trajectory(i, call.tool_calls[k * self.group_size + i]) for i in range(self.group_size))
            out.append(messages.Group(
                prompt_id=p.prompt_id, prompt=p.prompt, answer=p.answer,
                prompt_tokens=np.zeros(1, dtype=np.int32), version=version, worker=self.ctx.worker_id,
                generated_at=started, gen_s=wall, trajectories=trajs,
                extra={"sim_tokens": call.group_tokens[k]}))
            k += 1
        n = len(prompts) * self.group_size
        self.meter.add(busy_s=wall, items=n, tokens=sum(call.group_tokens))
        self.ctx.count(n)
        return out


def _trajectory(idx: int, tool_calls: int) -> messages.Trajectory:
    """A one-token stand-in: the simulated length travels in the group's ``extra``, not as tokens."""
    return messages.Trajectory(sample_idx=idx, completion=np.zeros(1, dtype=np.int32),
                               mask=np.ones(1, dtype=np.uint8), logprobs=np.zeros(1, dtype=np.float32),
                               text="", finish="sim", turns=1 + tool_calls, tool_calls=tool_calls,
                               tool_latency_s=(), tool_timeouts=0)


class SimReward:
    """``lanes`` scorers in one process, each charging the workload's seconds per trajectory."""

    def __init__(self, ctx, model: CostModel, clock: Clock, meter):
        self.ctx, self.model, self.clock, self.meter = ctx, model, clock, meter
        self.lanes = model.reward_lanes(ctx.cfg.reward.workers)
        meter.set(lanes=self.lanes)

    def score(self, groups: list) -> list:
        from pipeline.dataplane.streams import Reject

        unscored = [isinstance(g, messages.Group) and all(t.reward is None for t in g.trajectories) for g in groups]
        # only what it scores is charged and counted, as the real reward worker does
        n = sum(len(g.trajectories) for g, ok in zip(groups, unscored) if ok)
        wall = self.clock.sleep(self.model.reward_s(n, self.lanes))
        out = []
        for g, ok in zip(groups, unscored):
            if not ok:
                out.append(Reject("reward stage expects an unscored group"))
                continue
            rewards = [reward_of(g.prompt_id, t.sample_idx, self.ctx.cfg.job.seed) for t in g.trajectories]
            out.append(g.with_rewards(rewards, scored_at=time.time()))
        self.meter.add(busy_s=wall * self.lanes, items=n)
        self.ctx.count(n)
        return out


@dataclass
class _Batch:
    groups: list
    entry_ids: list          # every entry consumed: admitted, dropped as stale or already trained
    dropped: list            # groups dropped as stale (their staleness along the version tree beyond the bound)
    duplicates: int = 0      # trajectories of groups trained before (skipped)
    staleness: list = field(default_factory=list)  # per admitted group: updates along the version tree
    branch: list = field(default_factory=list)     # of the dropped groups, those from a discarded branch
    wait_s: float = 0.0
    prefetched: float = 0.0  # tokens of the admitted groups trained while the batch filled
    prefetch_s: float = 0.0  # wall seconds that took

    @property
    def trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)


def _ids(groups: list) -> list[str]:
    """Trajectory ids, ``prompt_id/sample_idx``, as the real learner's checkpoints record them."""
    return [tid for g in groups for tid in g.trajectory_ids()]


class SimLearner:
    """Whole groups until a batch is admitted (stale ones dropped), train, publish, commit: per step.

    A step is committed like the real learner's checkpoint: its record
    (``checkpoints/step-N/``: state, consumed and dropped trajectory ids, what
    ``libra-ctl audit`` reads) is written first, then one transaction acks the
    step's entries and moves the counters, the step and the version. A record
    left by a crash before that transaction is removed at restore, and its
    entries, still pending, are replayed.
    """

    def __init__(self, ctx, model: CostModel, clock: Clock, meter, gpus: int):
        self.ctx, self.model, self.clock, self.meter, self.gpus = ctx, model, clock, meter, gpus
        self.cfg = ctx.cfg.learner
        self.ckpt_dir = ctx.run_dir / "checkpoints"
        self.replay_cursor: str | bytes | None = "0"   # our own pending entries first (after a restart)
        st = ctx.cfg.streams
        # scored groups read ahead of the batch and not consumed (learner.last_chance_first): pending at us
        self.ahead = InHand(limit_groups(self.cfg.batch_size, ctx.cfg.rollout.group_size, st.backlog_batches,
                                         self.cfg.max_staleness, self.cfg.last_chance_first))
        self.outage = Outage(ctx.log, stop=ctx.stopping)
        self.restore()

    def restore(self) -> None:
        """Step and version from the last committed step; a restore publishes a new, higher version."""
        k = self.ctx.keys
        st = {a.decode(): int(b) for a, b in self.ctx.r.hgetall(k.sim_learner).items()}
        published = int(self.ctx.r.hget(k.policy, "version") or 0)
        self.step = st.get("step", 0)
        # the schema's running totals, committed with the step; from a hash written before they were kept,
        # the job's counters, committed with the same steps
        trained, dropped = self.ctx.r.hmget(k.counters, ["trained", "dropped_stale"])
        self.trained_total = st.get("trained_total", int(trained or 0))
        self.dropped_total = st.get("dropped_stale_total", int(dropped or 0))
        for ckpt in self.ckpt_dir.glob("step-*"):
            if ckpt.name.endswith(".tmp") or int(ckpt.name.split("-")[1]) > self.step:
                shutil.rmtree(ckpt)   # never committed: its entries are still pending
        self.version = published if not st else max(published, st.get("version", 0)) + 1
        self.published_step = self.step     # a restore publishes the committed step's weights
        # Staleness counts updates along the version tree (dataplane.lineage), as the real learner's does:
        # a restore's new version holds the committed step's weights, 0 updates from them.
        self.lineage = restored(load_segments(self.ctx.r, k), None)
        pipe = self.ctx.r.pipeline(transaction=True)
        if st:
            self.lineage.start_line(self.version, self.step, st.get("version", 0))
            record_line(pipe, k, self.lineage, self.version)
            pipe.hset(k.policy, mapping={"version": self.version, "step": self.step, "published_at": time.time()})
            self.ctx.log.info("restored", step=self.step, version=self.version, gpus=self.gpus)
        else:
            record_line(pipe, k, self.lineage, 0)
        pipe.execute()
        self.ctx.set_version(self.version)

    def read_entries(self, count: int, block_ms: int | None) -> list:
        """Our own pending entries first, then new ones; waits out an unreachable Redis.

        After an outage the pending list is read again from the start: a read
        whose reply was lost has delivered its entries to us all the same.
        ``collect`` skips the ones already in its batch.
        """
        while True:
            try:
                entries = self._read_entries(count, block_ms)
                self.outage.ok()
                return entries
            except UNAVAILABLE as exc:
                self.outage.wait(exc)
                self.replay_cursor = "0"

    def _read_entries(self, count: int, block_ms: int | None) -> list:
        k = self.ctx.keys
        if self.replay_cursor is not None:
            reply = self.ctx.r.xreadgroup(GROUP_LEARNER, self.ctx.worker_id, {k.scored: self.replay_cursor},
                                          count=count)
            entries = [(i, f.get(messages.FIELD, b"")) for _s, es in reply or () for i, f in es]
            if entries:
                self.replay_cursor = entries[-1][0]
                return entries
            self.replay_cursor = None
        return read(self.ctx.r, k.scored, GROUP_LEARNER, self.ctx.worker_id, count, block_ms)

    def collect(self) -> _Batch:
        """Whole groups until a batch is admitted, through groups in hand as the real learner reads them
        (``workers.learner.Learner.collect``): with ``learner.last_chance_first`` it reads ahead of the
        batch and admits first the groups this step is the last to take."""
        batch, need = _Batch([], [], []), self.cfg.batch_size
        gs, block_ms = self.ctx.cfg.rollout.group_size, self.ctx.cfg.streams.block_ms
        in_hand = len(self.ahead)
        while batch.trajectories < need and not self.ctx.stopping():
            t0 = time.monotonic()
            want = max(1, (need - batch.trajectories) // gs)
            count = self.ahead.read_count(want, want + (self.ctx.cfg.job.steps - self.step - 1) * (need // gs))
            entries = self.read_entries(count, None if self.ahead else block_ms) if count else []
            batch.wait_s += time.monotonic() - t0
            good, bad = decode_entries(entries, self.ctx.cfg.streams.max_message_bytes)
            if bad:   # each stood for one group: the feeder's room comes back by its trajectories
                self.dead_letter([(i, payload, reason, gs) for i, payload, reason in bad])
            known = set(batch.entry_ids) | self.ahead.ids()
            for entry_id, g in good:
                if entry_id not in known and self.admissible(entry_id, g):
                    self.ahead.add(entry_id, g, b"")
            self.take_in_hand(batch)
            self.prefetch(batch)
            if len(self.ahead) != in_hand:
                in_hand = len(self.ahead)
                self.publish_ahead()
        return batch

    def take_in_hand(self, batch: _Batch) -> None:
        """Consume groups in hand into ``batch`` until it is whole, in ``InHand.order``."""
        items, need = self.ahead.items, self.cfg.batch_size
        if not items:
            return
        before = self.outage.call(self.ctx.r.smismember, self.ctx.keys.sim_trained,
                                  [g.prompt_id for _i, g, _p in items])
        # a copy of a group this batch already judged (trained or dropped) is a duplicate, not judged twice
        taken = {g.prompt_id for g in batch.groups + batch.dropped}
        dists = [self.lineage.distance(g.version, self.version) for _i, g, _p in items]
        dups = [bool(b) or g.prompt_id in taken for b, (_i, g, _p) in zip(before, items)]
        order, must = self.ahead.order([d.updates for d in dists], dups, self.cfg.max_staleness)
        consumed = []
        for n, i in enumerate(order):
            if n >= must and batch.trajectories >= need:
                break
            consumed.append(i)
            entry_id, g, _p = items[i]
            batch.entry_ids.append(entry_id)
            if before[i] or g.prompt_id in taken:
                batch.duplicates += len(g.trajectories)
                continue
            d = dists[i]
            if d.updates is None or d.updates > self.cfg.max_staleness:
                batch.dropped.append(g)
                taken.add(g.prompt_id)
                if not d.on_line:
                    batch.branch.append(g)
            else:
                batch.groups.append(g)
                batch.staleness.append(d.updates)
                taken.add(g.prompt_id)
        self.ahead.take(consumed)

    def publish_ahead(self) -> None:
        """How many groups we hold read ahead (``streams.learner_backlog`` counts them)."""
        self.outage.call(self.ctx.r.hset, self.ctx.keys.counters, AHEAD_COUNTER, len(self.ahead))

    def prefetch(self, batch: _Batch) -> None:
        """Train the groups admitted so far, as the real learner does with ``learner.prefetch``."""
        if not self.cfg.prefetch:
            return
        tokens = sum(float(g.extra.get("sim_tokens", 0.0)) for g in batch.groups)
        if tokens > batch.prefetched:
            self.ctx.state = "running"
            batch.prefetch_s += self.clock.sleep(self.model.train_s(tokens - batch.prefetched, self.gpus))
            batch.prefetched = tokens
            self.ctx.state = "waiting"

    def admissible(self, entry_id: bytes, g) -> bool:
        if isinstance(g, messages.Group) and all(t.reward is not None for t in g.trajectories):
            return True
        self.dead_letter([(entry_id, messages.encode(g), "learner expects a scored group",
                           trajectories_of(g, self.ctx.cfg.rollout.group_size))])
        return False

    def dead_letter(self, bad) -> None:
        """Dead-letter (entry id, payload, reason, trajectories it stood for) records of the scored stream."""
        k = self.ctx.keys

        def build():
            pipe = self.ctx.r.pipeline(transaction=True)
            for entry_id, payload, reason, trajectories in bad:
                dead_letter(pipe, k, k.scored, entry_id, reason, payload, trajectories=trajectories)
                pipe.xack(k.scored, GROUP_LEARNER, entry_id)
            return pipe

        execute_with_backpressure(build, self.ctx.log, self.ctx.stopping)

    def train_step(self, batch: _Batch) -> dict:
        tokens = sum(float(g.extra.get("sim_tokens", 0.0)) for g in batch.groups)
        self.ctx.state = "running"
        train = batch.prefetch_s + self.clock.sleep(self.model.train_s(tokens - batch.prefetched, self.gpus))
        every, _at = self.outage.call(read_cadence, self.ctx.r, self.ctx.keys, self.cfg.publish_every,
                                      self.cfg.max_staleness)
        published = publishes(self.step + 1, self.published_step, every, self.ctx.cfg.job.steps)
        publish = self.clock.sleep(self.model.wl.learner.weight_publish_s) if published else 0.0
        stale = [d for g, d in zip(batch.groups, batch.staleness) for _t in g.trajectories]
        hist = {int(v): int(c) for v, c in zip(*np.unique(stale, return_counts=True))} if stale else {}
        dropped = sum(len(g.trajectories) for g in batch.dropped)
        return {"step": self.step + 1, "policy_version": self.version + 1, "trajectories": len(stale),
                "trained_total": self.trained_total + len(stale), "dropped_stale_total": self.dropped_total + dropped,
                "tokens": tokens, "gpus": self.gpus, "train_s": train, "publish_s": publish,
                "published": published, "publish_every": every,
                "wait_s": batch.wait_s, "dropped_stale": dropped, "groups": len(batch.groups),
                "staleness_mean": float(np.mean(stale)) if stale else 0.0,
                "staleness_max": int(max(stale)) if stale else 0, "staleness_hist": hist,
                "reward_mean": float(np.mean([t.reward for g in batch.groups for t in g.trajectories]))
                if stale else 0.0, "at": time.time()}

    def write_record(self, batch: _Batch, m: dict) -> None:
        """The step's checkpoint record, in the real learner's layout (what ``libra-ctl audit`` reads)."""
        final = self.ckpt_dir / f"step-{m['step']:06d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "consumed.txt").write_text("".join(f"{i}\n" for i in _ids(batch.groups)))
        (tmp / "dropped.txt").write_text("".join(f"{i}\n" for i in _ids(batch.dropped)))
        (tmp / "dropped_branch.txt").write_text("".join(f"{i}\n" for i in _ids(batch.branch)))
        (tmp / "state.json").write_text(json.dumps({"step": m["step"], "version": m["policy_version"],
                                                    "gpus": self.gpus, "written_at": time.time()}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def commit(self, batch: _Batch, m: dict) -> None:
        """The step's record, then acks, counters, step and version in one transaction."""
        k, r = self.ctx.keys, self.ctx.r
        self.write_record(batch, m)

        def build():
            pipe = r.pipeline(transaction=True)
            if batch.entry_ids:
                pipe.xack(k.scored, GROUP_LEARNER, *batch.entry_ids)
            if batch.groups or batch.dropped:   # judged, trained or dropped: a later copy is a duplicate
                pipe.sadd(k.sim_trained, *[g.prompt_id for g in batch.groups + batch.dropped])
            pipe.hincrby(k.counters, "trained", m["trajectories"])
            pipe.hincrby(k.counters, "dropped_stale", m["dropped_stale"])
            if batch.duplicates:
                pipe.hincrby(k.counters, "duplicates_dropped_learner", batch.duplicates)
            if batch.branch:
                pipe.hincrby(k.counters, "dropped_branch", len(_ids(batch.branch)))
            pipe.hset(k.sim_learner, mapping={"step": m["step"], "version": m["policy_version"],
                                              "trained_total": m["trained_total"],
                                              "dropped_stale_total": m["dropped_stale_total"]})
            if m["published"]:
                pipe.hset(k.policy, mapping={"version": m["policy_version"], "step": m["step"],
                                             "published_at": time.time()})
            pipe.hset(k.learner_stats, mapping={a: json.dumps(b) for a, b in m.items()})
            pipe.xadd(k.metrics, {"kind": "learner_step", "data": json.dumps(m)}, maxlen=100_000, approximate=True)
            return pipe

        # once, even when the EXEC reply is lost (a retry would count the step twice); waits out an outage
        execute_with_backpressure(build, self.ctx.log, self.ctx.stopping)
        # the acknowledged entries go, as the real learner trims after its checkpoint (never what is pending)
        self.outage.call(trim, r, k.scored)
        self.step, self.version = m["step"], m["policy_version"]
        self.trained_total, self.dropped_total = m["trained_total"], m["dropped_stale_total"]
        if m["published"]:
            self.published_step = self.step
            self.ctx.set_version(self.version)
        with open(self.ctx.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"kind": "learner_step", "worker": self.ctx.worker_id, **m}) + "\n")
        self.meter.add(busy_s=(m["train_s"] + m["publish_s"]) * self.gpus, items=m["trajectories"],
                       tokens=m["tokens"])
        self.ctx.count(m["trajectories"])

    def run(self) -> None:
        steps = self.ctx.cfg.job.steps
        self.ctx.publish_state("running")
        self.publish_ahead()    # none in hand yet: what a predecessor held is pending at us, replayed as we read
        while self.step < steps and not self.ctx.stopping():
            self.ctx.state = "waiting"
            batch = self.collect()
            if batch.trajectories < self.cfg.batch_size:
                break   # stopping mid-batch: its entries stay pending and the next learner-0 replays them
            self.commit(batch, self.train_step(batch))
            self.ctx.log.info("trained", step=self.step, gpus=self.gpus, dropped=len(_ids(batch.dropped)))
        if self.step >= steps:
            self.outage.call(self.ctx.r.hset, self.ctx.keys.state, "phase", "trained")
            self.ctx.log.info("training_done", step=self.step, version=self.version)


# --- the process --------------------------------------------------------------------------------


def pay_switch_cost(ctx, wl: Workload, clock: Clock, role: str, started: float | None = None) -> float:
    """A slot that changes role yields nothing for ``switch_cost_s`` (drain, start, weight load).

    Paid by a slot worker started into a job that has already generated (a
    role change or a restart; the initial allocation starts for free, as in
    the des engine): it sleeps what its own process start-up left of the
    cost, so a machine slower to start processes than the workload's GPUs
    overcharges instead of undercharging. ``started``: the process's start
    (wall clock), by default read from the OS. Returns the wall seconds slept.
    """
    import psutil

    if role == "reward" and not wl.reward.gpu:
        return 0.0
    if not int(ctx.r.hget(ctx.keys.counters, "generated") or 0):
        return 0.0
    spent = (time.time() - (psutil.Process().create_time() if started is None else started)) * clock.scale
    return clock.sleep(wl.cluster.switch_cost_s - spent)


def slots_from_env() -> list[str]:
    raw = os.environ.get(SLOTS_ENV, "")
    return [s for s in raw.split(",") if s]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pipeline.sim.worker", description=__doc__.splitlines()[0])
    p.add_argument("--role", required=True, choices=ROLES)
    args, rest = p.parse_known_args(argv)
    # start_worker parses --run-dir and --worker-id itself, from sys.argv
    sys.argv = [f"pipeline.sim.worker:{args.role}", *rest]
    ctx = start_worker(args.role)
    try:
        sim = sim_settings(ctx.run_dir)
        wl = load_workload(sim["workload"], sim.get("job"))
        clock = Clock(float(sim["time_scale"]))
        model = CostModel(wl, seed=zlib.crc32(f"{ctx.cfg.job.seed}:{ctx.worker_id}".encode()))
        # before the meter starts: a switch is neither work nor a weight load (the controller reads pause_s as
        # weight loads), and the des engine counts it apart too
        pay_switch_cost(ctx, wl, clock, args.role)
        meter = CostMeter(ctx.r, ctx.keys, ctx.worker_id, args.role)
        ensure_groups(ctx.r, ctx.keys)
        common = dict(block_ms=ctx.cfg.streams.block_ms, max_bytes=ctx.cfg.streams.max_message_bytes,
                      stop=ctx.stopping, log=ctx.log)
        if args.role == "rollout":
            stage = SimRollout(ctx, model, clock, meter)
            ctx.publish_state("running")
            run_stage(ctx.r, ctx.keys, source=ctx.keys.prompts, group=GROUP_ROLLOUT, consumer=ctx.worker_id,
                      sink=ctx.keys.rollouts, handle=stage.generate, count=model.groups_per_call(stage.group_size),
                      claims=claim_policy(ctx.cfg, "rollout"), dedup=dedup_for(ctx.cfg, "rollout"),
                      before_read=stage.between, counter="generated", **common)
        elif args.role == "reward":
            stage = SimReward(ctx, model, clock, meter)
            ctx.publish_state("running")
            run_stage(ctx.r, ctx.keys, source=ctx.keys.rollouts, group=GROUP_REWARD, consumer=ctx.worker_id,
                      sink=ctx.keys.scored, handle=stage.score, count=16, claims=claim_policy(ctx.cfg, "reward"),
                      dedup=dedup_for(ctx.cfg, "reward"), counter="scored", **common)
        else:
            SimLearner(ctx, model, clock, meter, gpus=max(1, len(slots_from_env()))).run()
    finally:
        finish_worker(ctx)


if __name__ == "__main__":
    main()
