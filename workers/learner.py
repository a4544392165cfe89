"""Learner: scored stream -> GRPO update -> published weights and checkpoints.

``python -m workers.learner``, started by ``libra-ctl run`` or a node agent.
A step reads whole scored groups until ``batch_size`` trajectories are
admitted, dropping (and counting) groups staler than ``max_staleness``. Every
``publish_every`` steps it publishes weights under a new version; every
``checkpoint_every`` steps it writes a checkpoint (weights, optimizer, step,
version, the ids it consumed) and only then acknowledges the stream entries
that checkpoint contains. A restart restores the latest checkpoint, publishes
under a new version, and its unacknowledged entries are replayed. A drain
(SIGTERM) finishes the step in hand, checkpoints it and exits 0, so the next
learner repeats nothing.

Data parallel: with N slots (``LIBRA_SLOTS``) this process is rank 0 of N
(``workers.ranks`` starts the others). Rank 0 alone talks to Redis, as
consumer ``learner-0``: it reads, deduplicates, dead-letters, and cuts each
step's batch into shares of whole groups (``workers.update.plan_shares``);
the ranks sum their gradients of the whole batch's token-level loss and take
the same optimizer step, so N ranks make one rank's update and keep identical
weights; rank 0 publishes and checkpoints. A checkpoint holds the whole state
whatever the world size, so the next learner may have another; the world
size changes only at a drain. One slot: no other process, no process group.

It trains on the slots' GPUs when there are (rank i on the i-th visible
device, the node agent showing only the slots' GPUs), else on the CPU;
master weights and optimizer state are float32 on either, and the files it
writes load on a CPU-only machine.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pipeline.dataplane import messages
from pipeline.observe.diversity import diversity_metrics
from pipeline.dataplane.keys import GROUP_LEARNER
from pipeline.dataplane.redisconn import UNAVAILABLE, Outage
from pipeline.observe.measures import tool_stats
from pipeline.observe.trace import span
from pipeline.dataplane.streams import (dead_letter, decode_entries, ensure_groups, execute_with_backpressure, read,
                                        take_over_pending, trajectories_of, transact, trim)
from pipeline.dataplane.worker import CostMeter, WorkerContext, finish_worker, start_worker
from workers.checkpoint import (latest_checkpoint, prune_published, read_optimizer, read_state, trained_ids_after,
                                write_checkpoint, write_published)
from workers.ranks import RankGroup, pick_device, world_size
# The step's compute lives in workers.update (shared by every rank); these names stay importable from here.
from workers.update import accumulate_gradients as accumulate_gradients
from workers.update import autocast as autocast
from workers.update import micro_batches as micro_batches
from workers.update import (StepSums, active_rows, group_rows, load_policy, lr_at, make_optimizer, plan_shares,
                            row_tokens, set_lr, train_share)

DEDUP_STEPS = 200  # steps a trained id is remembered (in memory and restored from checkpoints)
PENDING_PAGE = 500  # ids per XPENDING call when the learner looks over its own pending list


@dataclass
class Batch:
    groups: list[messages.Group] = field(default_factory=list)
    entry_ids: list[bytes] = field(default_factory=list)  # every entry consumed, admitted or dropped
    dropped_groups: int = 0
    dropped_trajectories: int = 0
    dropped_ids: list[str] = field(default_factory=list)
    duplicates: int = 0  # trajectories of groups already trained, skipped
    wait_s: float = 0.0

    @property
    def trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)


class Learner:
    """The learner process's state (model, optimizer, version, entries held until the next checkpoint) and loop."""

    def __init__(self, ctx: WorkerContext, world: int = 1):
        self.ctx, self.cfg, self.world = ctx, ctx.cfg.learner, world
        torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(ctx.cfg.job.seed)
        self.device = pick_device(0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # busy_s: training slot-seconds; pause_s: loading, publishing and checkpointing weights.
        self.meter = CostMeter(ctx.r, ctx.keys, ctx.worker_id, "learner")
        self.source_dir = Path()  # the directory the model was loaded from: its tokenizer files travel on
        self.restored_from: Path | None = None  # the checkpoint restored, whose optimizer the other ranks load
        self.ckpt_dir = ctx.run_dir / "checkpoints"
        self.pub_dir = ctx.run_dir / "policy"
        self.step = 0
        self.unacked: list[bytes] = []  # consumed since the last durable checkpoint
        self.consumed: list[str] = []  # trajectory ids trained since the last checkpoint
        self.dropped: list[str] = []  # trajectory ids dropped as stale since the last checkpoint
        # Trajectory id -> step that trained it, for the last DEDUP_STEPS steps: a
        # redelivered or regenerated group arrives within that window.
        self.trained_ids: dict[str, int] = {}
        # Where the next look over our own pending list starts (XPENDING range), None while reading new
        # entries; "-" at the start, at every step and after a read that found nothing (see read_entries).
        self.replay_from: str | None = "-"
        self.trained_total = 0
        self.dropped_total = 0
        t0 = time.monotonic()
        start = self.restore_or_init()
        self.meter.add(pause_s=time.monotonic() - t0)
        self.checkpointed_step = self.step  # the last step a durable checkpoint holds
        self.optimizer = make_optimizer(self.model, self.cfg)
        if start is not None:
            self.optimizer.load_state_dict(start)
        self.set_lr()
        self.ranks: RankGroup | None = None  # ranks 1..N-1, when there are any
        if world > 1:
            self.ranks = RankGroup.start(ctx.run_dir, ctx.worker_id, world, self.model, self.source_dir,
                                         self.restored_from, ctx.log)

    # --- state ------------------------------------------------------------------------------

    def restore_or_init(self):
        """Load the newest checkpoint if there is one, else the run's initial policy (version 0).

        Without a checkpoint, the published weights may already hold updates
        whose entries were never acknowledged; they will be replayed, so the
        learner starts again from the initial policy, not from those weights.
        """
        latest = latest_checkpoint(self.ckpt_dir)
        info = self.ctx.r.hgetall(self.ctx.keys.policy)
        published = int(info[b"version"]) if info else 0
        if latest is None:
            manifest = json.loads((self.ctx.run_dir / "manifest.json").read_text())
            self.load(manifest.get("initial_policy") or info[b"path"].decode())
            self.version = 0
            if published > 0:  # a learner ran before: restart under a new version number
                self.version = published + 1
                self.write(lambda pipe: pipe.hset(self.ctx.keys.counters, mapping={"trained": 0, "dropped_stale": 0}))
                self.publish()
            return None
        state = read_state(latest)
        self.load(latest / "model")  # a checkpoint's model dir carries the initial policy's tokenizer files
        self.step = state["step"]
        self.trained_total = state["trained_total"]
        self.dropped_total = state["dropped_total"]
        # A restore publishes under a new, higher version: a number never names two weight sets.
        self.version = max(published, state["version"]) + 1
        self.ctx.log.info("restored", checkpoint=str(latest), step=self.step, version=self.version)
        opt = read_optimizer(latest)
        self.restored_from = latest
        self.trained_ids.update(trained_ids_after(self.ckpt_dir, self.step - DEDUP_STEPS))
        # Counters follow the checkpoint: steps after it will be trained again from the replay.
        self.write(lambda pipe: pipe.hset(self.ctx.keys.counters, mapping={
            "trained": self.trained_total, "dropped_stale": self.dropped_total}))
        self.publish()
        return opt

    def load(self, model_dir) -> None:
        """Load float32 weights onto the learner's device; later saves copy ``model_dir``'s tokenizer files."""
        self.model = load_policy(model_dir, self.device, self.cfg)
        self.source_dir = Path(model_dir)
        self.ctx.log.info("model_loaded", path=str(model_dir), device=str(self.device), dtype=self.cfg.dtype,
                          parameters=sum(p.numel() for p in self.model.parameters()))

    def set_lr(self) -> None:
        set_lr(self.optimizer, lr_at(self.cfg, self.step))

    # --- reading ------------------------------------------------------------------------------

    def collect(self) -> Batch:
        """Read scored groups until a batch is admitted; stale groups are dropped whole."""
        batch, need = Batch(), self.cfg.batch_size
        streams, gs = self.ctx.cfg.streams, self.ctx.cfg.rollout.group_size
        held = set(self.unacked)  # pending at us for the next checkpoint, and below, this batch's
        self.replay_from = "-"
        while batch.trajectories < need and not self.ctx.stopping():
            t0 = time.monotonic()
            want = max(1, (need - batch.trajectories) // gs)
            entries = self.read_waiting(want, streams.block_ms, held)
            held.update(entry_id for entry_id, _p in entries)
            batch.wait_s += time.monotonic() - t0
            good, bad = decode_entries(entries, streams.max_message_bytes)
            if bad:  # each stood for one group (streams.trajectories_of)
                self.dead_letter_bad([(i, payload, reason, gs) for i, payload, reason in bad])
            for entry_id, group in good:
                batch.entry_ids.append(entry_id)
                if not isinstance(group, messages.Group) or any(t.reward is None for t in group.trajectories):
                    self.dead_letter_bad([(entry_id, messages.encode(group), "learner expects a scored group",
                                           trajectories_of(group, gs))])
                    continue
                if self.dedup and self.already_trained(group, batch):
                    batch.duplicates += len(group.trajectories)
                    continue
                if self.version - group.version > self.cfg.max_staleness:
                    batch.dropped_groups += 1
                    batch.dropped_trajectories += len(group.trajectories)
                    batch.dropped_ids += _ids(group)
                    continue
                batch.groups.append(group)
        return batch

    @property
    def dedup(self) -> bool:
        return self.ctx.cfg.streams.dedup

    def already_trained(self, group: messages.Group, batch: Batch) -> bool:
        """Was this group (any of its trajectory ids) trained, or admitted to this batch?"""
        ids = _ids(group)
        in_batch = {tid for g in batch.groups for tid in _ids(g)}
        return any(tid in self.trained_ids or tid in in_batch for tid in ids)

    def read_waiting(self, count: int, block_ms: int, held: set[bytes]) -> list:
        """``read_entries``, waiting out an unreachable Redis (``redis.outage_s``); after an outage the
        pending list is looked over again, since a read whose reply was lost delivered its entries to us."""
        outage = Outage(self.ctx.log, stop=self.ctx.stopping)
        while True:
            try:
                entries = self.read_entries(count, block_ms, held)
                outage.ok()
                return entries
            except UNAVAILABLE as exc:
                outage.wait(exc)
                self.replay_from = "-"

    def read_entries(self, count: int, block_ms: int, held: set[bytes]) -> list:
        """Entries pending at us that we do not hold (``held``) while there are any, then new ones.

        An entry can be pending at ``learner-0`` without this process holding
        it: the steps after the last checkpoint, after a restart; entries taken
        over from other ranks; a read whose reply was lost (a dropped
        connection, and redis-py retries the command). Nothing delivers those
        again, and unacknowledged they pin the scored stream's trim point, so
        the learner looks over its pending list at every step and after every
        read that finds nothing new, and replays what it does not hold: trained
        if new, skipped as a duplicate if its ids were trained, acknowledged
        with the next checkpoint either way.
        """
        if self.replay_from is not None:
            entries = self.replay_unheld(count, held)
            if entries:
                return entries
            self.replay_from = None
        entries = read(self.ctx.r, self.ctx.keys.scored, GROUP_LEARNER, self.ctx.worker_id, count, block_ms)
        if not entries:
            self.replay_from = "-"
        return entries

    def pending_unheld(self, count: int, held: set[bytes]) -> list[bytes]:
        """Up to ``count`` ids pending at us and not ``held``, oldest first, from ``replay_from`` on."""
        r, stream, me = self.ctx.r, self.ctx.keys.scored, self.ctx.worker_id
        out: list[bytes] = []
        while len(out) < count:
            page = [_as_bytes(p["message_id"]) for p in r.xpending_range(
                stream, GROUP_LEARNER, min=self.replay_from, max="+", count=PENDING_PAGE, consumername=me)]
            out += [i for i in page if i not in held][:count - len(out)]
            if len(page) < PENDING_PAGE:
                break
            self.replay_from = "(" + page[-1].decode()
        if out:
            self.replay_from = "(" + out[-1].decode()
        return out

    def replay_unheld(self, count: int, held: set[bytes]) -> list:
        """Deliver to ourselves again (XCLAIM, min idle 0) the pending entries we do not hold."""
        ids = self.pending_unheld(count, held)
        if not ids:
            return []
        claimed = self.ctx.r.xclaim(self.ctx.keys.scored, GROUP_LEARNER, self.ctx.worker_id, 0, ids)
        entries = [(i, f.get(messages.FIELD, b"")) for i, f in claimed if i is not None and f is not None]
        self.ctx.log.info("replayed_pending", entries=len(entries))
        # Pending, but deleted from the stream (XDEL): Redis 6.2 answers nil, 7 drops it from the pending list.
        gone = set(ids) - {i for i, _p in entries}
        if gone:
            self.dead_letter_bad([(i, b"", "deleted from the stream while pending", self.ctx.cfg.rollout.group_size)
                                  for i in sorted(gone)])
        return entries

    def write(self, queue) -> None:
        """A transaction of small writes, waiting while Redis is full (backpressure, never a crash)."""
        transact(self.ctx.r, queue, self.ctx.log, self.ctx.stopping)

    def dead_letter_bad(self, bad) -> None:
        """Dead-letter and acknowledge ``(entry id, payload, reason, trajectories it stood for)``."""
        def queue(pipe):
            for entry_id, payload, reason, trajectories in bad:
                dead_letter(pipe, self.ctx.keys, self.ctx.keys.scored, entry_id, reason, payload,
                            trajectories=trajectories)
                pipe.xack(self.ctx.keys.scored, GROUP_LEARNER, entry_id)

        self.write(queue)
        for _id, _payload, reason, _n in bad:
            self.ctx.log.warning("dead_lettered", reason=reason)

    # --- training ------------------------------------------------------------------------------

    def train(self, batch: Batch) -> dict:
        """One GRPO update on the admitted groups, over every rank; returns the step's metrics."""
        rows = group_rows(batch.groups, self.version)
        shares = plan_shares(batch.groups, self.version, self.step, self.world)
        if self.ranks is not None:
            self.ranks.send(shares[1:])
        sums = train_share(self.model, self.optimizer, shares[0], self.cfg, self.ctx.cfg.rollout.temperature,
                           distributed=self.ranks is not None)
        if sums.weight_spread:  # the ranks' weights should never part: a fault of the hardware or the collectives
            self.ctx.log.warning("ranks_diverged", step=self.step + 1, weight_spread=sums.weight_spread)
        self.step += 1
        self.version += 1
        self.set_lr()
        return step_metrics(batch, rows, active_rows(rows), sums, step=self.step, version=self.version,
                            lr=self.optimizer.param_groups[0]["lr"], gpus=self.world)

    # --- publishing and checkpoints ---------------------------------------------------------------

    def publish(self) -> None:
        """Write weights for the current version and announce them; old versions are pruned."""
        final = write_published(self.pub_dir, self.version, self.model, self.source_dir)
        announce = {"version": self.version, "path": str(final.resolve()), "step": self.step,
                    "published_at": time.time()}
        self.write(lambda pipe: pipe.hset(self.ctx.keys.policy, mapping=announce))
        self.ctx.set_version(self.version)
        prune_published(self.pub_dir, self.cfg.keep_published)

    def checkpoint(self) -> None:
        """Make the step durable, then acknowledge what it consumed (offsets ride on checkpoints).

        Rank 0's model and optimizer are every rank's (the ranks keep identical
        weights), and rank 0 consumed every id: the checkpoint restores at any
        world size; ``world_size`` is recorded for the record only.
        """
        t0 = time.monotonic()
        write_checkpoint(self.ckpt_dir, self.model, self.optimizer, self.consumed, self.dropped, {
            "step": self.step, "version": self.version, "trained_total": self.trained_total,
            "dropped_total": self.dropped_total, "world_size": self.world, "written_at": time.time()},
            self.source_dir)
        if self.unacked:
            self.ctx.r.xack(self.ctx.keys.scored, GROUP_LEARNER, *self.unacked)
        trim(self.ctx.r, self.ctx.keys.scored)
        self.meter.add(pause_s=time.monotonic() - t0)
        self.ctx.log.info("checkpointed", step=self.step, acked=len(self.unacked))
        self.unacked, self.consumed, self.dropped = [], [], []
        self.checkpointed_step = self.step

    # --- the loop ---------------------------------------------------------------------------------

    def record(self, batch: Batch, metrics: dict) -> None:
        self.unacked += batch.entry_ids
        trained = [tid for g in batch.groups for tid in _ids(g)]
        self.consumed += trained
        self.dropped += batch.dropped_ids
        for tid in trained:
            self.trained_ids[tid] = self.step
        self.trained_ids = {k: v for k, v in self.trained_ids.items() if v > self.step - DEDUP_STEPS}
        self.trained_total += metrics["trajectories"]
        self.dropped_total += batch.dropped_trajectories
        self.meter.add(busy_s=metrics["train_s"] * self.world, items=metrics["trajectories"],
                       tokens=metrics["tokens"])
        metrics.update(trained_total=self.trained_total, dropped_stale_total=self.dropped_total,
                       duplicates_skipped=batch.duplicates, at=time.time())
        execute_with_backpressure(lambda: _step_writes(self.ctx.r, self.ctx.keys, batch, metrics),
                                  self.ctx.log, self.ctx.stopping)
        # Entries held until the next checkpoint: refresh the claim so no one reclaims them.
        if self.unacked:
            self.ctx.r.xclaim(self.ctx.keys.scored, GROUP_LEARNER, self.ctx.worker_id, 0, self.unacked, justid=True)
        with open(self.ctx.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"kind": "learner_step", **metrics}) + "\n")
        self.ctx.count(metrics["trajectories"])

    def run(self) -> None:
        steps = self.ctx.cfg.job.steps
        self.ctx.publish_state("running")
        while self.step < steps and not self.ctx.stopping():
            self.ctx.state = "waiting"
            with span(self.ctx.log, "learner_wait"):
                batch = self.collect()
            if self.ctx.stopping():
                break  # a batch not trained: its entries stay pending, and the next learner-0 replays them
            self.ctx.state = "running"
            t0 = time.monotonic()
            with span(self.ctx.log, "train", trajectories=batch.trajectories, world=self.world):
                metrics = self.train(batch)
            metrics["train_s"] = time.monotonic() - t0
            metrics.update(batch_metrics(batch, self.step, self.ctx.cfg.metrics.diversity_every))
            metrics["publish_s"] = 0.0
            if self.step % self.cfg.publish_every == 0 or self.step == steps:
                t0 = time.monotonic()
                with span(self.ctx.log, "publish", version=self.version):
                    self.publish()
                metrics["publish_s"] = time.monotonic() - t0
                self.meter.add(pause_s=metrics["publish_s"])
            self.record(batch, metrics)
            self.ctx.log.info("trained", step=self.step, reward_mean=round(metrics["reward_mean"], 3),
                              staleness_max=metrics["staleness_max"], dropped=batch.dropped_trajectories,
                              train_s=round(metrics["train_s"], 2), wait_s=round(batch.wait_s, 2))
            if self.step % self.cfg.checkpoint_every == 0 or self.step == steps:
                with span(self.ctx.log, "checkpoint", step=self.step):
                    self.checkpoint()
        if self.step > self.checkpointed_step:  # drained between checkpoints: make what was trained durable
            with span(self.ctx.log, "checkpoint", step=self.step, reason="drain"):
                self.checkpoint()
        if self.step >= steps:
            self.ctx.r.hset(self.ctx.keys.state, "phase", "trained")
            self.ctx.log.info("training_done", step=self.step, version=self.version)

    def close(self) -> None:
        """Stop the other ranks (after the last checkpoint, or on the way out of an error)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None


def _as_bytes(entry_id) -> bytes:
    return entry_id if isinstance(entry_id, bytes) else entry_id.encode()


def _ids(group: messages.Group) -> list[str]:
    """Trajectory ids of a group: (prompt_id, sample_idx), written prompt_id/sample_idx."""
    return [f"{group.prompt_id}/{t.sample_idx}" for t in group.trajectories]


def step_metrics(batch: Batch, rows, active, sums: StepSums, *, step: int, version: int, lr: float,
                 gpus: int) -> dict:
    """The step's figures: reward, staleness, clipping, the fresh-sample ratio check, size and timing.

    ``sums`` are the ranks' figures summed (``workers.update.train_share``);
    ``tokens`` (prompt + completion of every trajectory trained) and ``gpus``
    (the world size) are what the controller's observer measures the
    learner's speed with, together with ``train_s``.
    """
    rewards = np.array([r[1].reward for r in rows], dtype=np.float64)
    stale = np.array([r[3] for r in rows])
    masks_all = [r[1].mask.astype(bool) for r in rows]
    behaviour = np.concatenate([r[1].logprobs[m] for r, m in zip(rows, masks_all)]) if rows else np.zeros(1)
    equal_groups = sum(1 for g in batch.groups if len(set(g.rewards)) == 1)
    return {
        "step": step, "policy_version": version, "loss": sums.loss,
        "reward_mean": float(rewards.mean()) if rows else 0.0,
        "reward_std": float(rewards.std()) if rows else 0.0,
        "success_rate": float((rewards >= 1.0).mean()) if rows else 0.0,
        "entropy": float(-behaviour.mean()),
        "staleness_mean": float(stale.mean()) if rows else 0.0,
        "staleness_max": int(stale.max()) if rows else 0,
        "staleness_hist": {int(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))},
        "trajectories": len(rows), "active_trajectories": len(active),
        "zero_signal_groups": equal_groups, "groups": len(batch.groups),
        "dropped_stale": batch.dropped_trajectories, "grad_norm": sums.grad_norm,
        "clip_frac": sums.clip_weighted / sums.clip_weight if sums.clip_weight else 0.0,
        "ratio_fresh_tokens": sums.fresh_n,
        "ratio_fresh_max_abs_log": sums.fresh_max if sums.fresh_n else None,
        "ratio_fresh_mean_abs_log": sums.fresh_sum / sums.fresh_n if sums.fresh_n else None,
        "policy_tokens": sums.tokens, "tokens": sum(row_tokens(r) for r in rows), "gpus": gpus,
        "wait_s": batch.wait_s, "lr": lr, "rank_weight_spread": sums.weight_spread,
    }


def batch_metrics(batch: Batch, step: int, diversity_every: int) -> dict:
    """Tool use of the batch, and its diversity every ``diversity_every`` steps (0: never)."""
    out = tool_stats(batch.groups)
    if diversity_every and step % diversity_every == 0:
        out.update(diversity_metrics([([t.text for t in g.trajectories], list(g.rewards)) for g in batch.groups]))
    return out


def _step_writes(r, keys, batch: Batch, metrics: dict):
    """The step's counters, stats and metrics entry, as one transaction (rebuilt on each retry)."""
    pipe = r.pipeline(transaction=True)
    pipe.hincrby(keys.counters, "trained", metrics["trajectories"])
    pipe.hincrby(keys.counters, "dropped_stale", batch.dropped_trajectories)
    if batch.duplicates:
        pipe.hincrby(keys.counters, "duplicates_dropped_learner", batch.duplicates)
    pipe.hset(keys.learner_stats, mapping={k: json.dumps(v) for k, v in metrics.items()})
    pipe.xadd(keys.metrics, {"kind": "learner_step", "data": json.dumps(metrics)},
              maxlen=100_000, approximate=True)
    return pipe


def main() -> None:
    ctx = start_worker("learner")
    try:
        ensure_groups(ctx.r, ctx.keys)
        # A changed world size: entries pending at old ranks are ours now, before anything new.
        taken = take_over_pending(ctx.r, ctx.keys.scored, GROUP_LEARNER, ctx.worker_id)
        if taken:
            ctx.log.info("took_over_pending", entries=taken)
        learner = Learner(ctx, world=world_size())
        try:
            learner.run()
        finally:
            learner.close()
    finally:
        finish_worker(ctx)


if __name__ == "__main__":
    main()
