"""Learner: scored stream -> GRPO update -> published weights and checkpoints.

``python -m workers.learner``, started by ``libra-ctl run`` or a node agent.
A step reads whole scored groups until ``batch_size`` trajectories are
admitted, dropping (and counting) groups more than ``max_staleness`` updates
behind, counted along the version tree (``pipeline.dataplane.lineage``). Every
``publish_every`` steps (or as many as the controller's cadence says,
``pipeline.dataplane.cadence``) it publishes weights under a new version; every
``checkpoint_every`` steps it writes a checkpoint (weights, optimizer, step,
version, the ids it consumed) and only then acknowledges the stream entries
that checkpoint contains. A restart restores the latest checkpoint, publishes
under a new version that starts a new line of the tree (0 updates from the
checkpoint's), and its unacknowledged entries are replayed. A drain
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
import redis
import torch

from pipeline.dataplane import messages
from pipeline.dataplane.cadence import publishes, read_cadence
from pipeline.observe.diversity import diversity_metrics
from pipeline.dataplane.keys import GROUP_LEARNER
from pipeline.dataplane.lineage import Lineage, load_segments, record_line, restored
from pipeline.dataplane.lookahead import COUNTER as AHEAD_COUNTER
from pipeline.dataplane.lookahead import InHand, limit_groups
from pipeline.dataplane.redisconn import UNAVAILABLE, Outage
from pipeline.logs import json_line
from pipeline.observe.measures import tool_stats
from pipeline.observe.trace import span
from pipeline.dataplane.streams import (dead_letter, decode_entries, ensure_groups, execute_with_backpressure, read,
                                        take_over_pending, trajectories_of, transact, trim)
from pipeline.dataplane.worker import CostMeter, WorkerContext, finish_worker, start_worker
from workers.checkpoint import (announcement, latest_checkpoint, newest_published, prune_published, read_optimizer,
                                read_state, recorded_ids_after, weights_digest, write_checkpoint, write_published)
from workers.grpo import no_signal
from workers.oom import is_oom, oom_reported, record_oom
from workers.ranks import RankDied, RankGroup, pick_device, world_size
# The step's compute lives in workers.update (shared by every rank); these names stay importable from here.
from workers.update import accumulate_gradients as accumulate_gradients
from workers.update import autocast as autocast
from workers.update import micro_batches as micro_batches
from workers.update import (Prefetch, StepSums, active_rows, group_rows, load_policy, lr_at, make_optimizer,
                            plan_shares, row_tokens, set_lr, train_share)

DEDUP_STEPS = 200  # steps a trained id is remembered (in memory and restored from checkpoints)
PENDING_PAGE = 500  # ids per XPENDING call when the learner looks over its own pending list


@dataclass
class Batch:
    groups: list[messages.Group] = field(default_factory=list)
    entry_ids: list[bytes] = field(default_factory=list)  # every entry consumed, admitted or dropped
    dropped_groups: int = 0
    dropped_trajectories: int = 0
    dropped_ids: list[str] = field(default_factory=list)  # every id dropped: stale, or off a discarded branch
    dropped_branch_ids: list[str] = field(default_factory=list)  # of those, the ones from a discarded branch
    staleness: list[int] = field(default_factory=list)  # per admitted group: updates along the version tree
    duplicates: int = 0  # trajectories of groups already trained, skipped
    no_signal: int = 0  # trajectories of admitted groups whose rewards are all equal (learner.dynamic_sampling)
    wait_s: float = 0.0
    prefetch_s: float = 0.0  # training the groups while the batch filled (learner.prefetch)
    raw: dict[bytes, bytes] = field(default_factory=dict)  # entry id -> payload as read (for dead letters)
    marked: set[bytes] = field(default_factory=set)  # entry ids recorded as in training (Learner.mark_training)

    @property
    def trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)

    def counted(self, dynamic_sampling: bool) -> int:
        """Trajectories that count towards ``batch_size``: with dynamic sampling, only groups with signal."""
        return self.trajectories - (self.no_signal if dynamic_sampling else 0)


class StepPartlyApplied(RuntimeError):
    """A step raised after one of its mini-batches had updated the weights: they hold part of the step.

    Its groups that raise alone are dead-lettered first; the learner then
    exits, and its restart trains the step from the last checkpoint, so that
    no group is trained twice."""


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
        self.published_step = 0   # the step whose weights were published last (restore publishes its own)
        self.publish_every = self.cfg.publish_every   # the cadence last read (pipeline.dataplane.cadence)
        self.unacked: list[bytes] = []  # consumed since the last durable checkpoint
        # Scored groups read ahead of the batch and not consumed (learner.last_chance_first): pending at us.
        st = ctx.cfg.streams
        # Not with dynamic sampling: a step may end at its cap with groups read, which must not stay in hand.
        self.ahead = InHand(limit_groups(self.cfg.batch_size, ctx.cfg.rollout.group_size, st.backlog_batches,
                                         self.cfg.max_staleness,
                                         self.cfg.last_chance_first and not self.cfg.dynamic_sampling))
        self.consumed: list[str] = []  # trajectory ids trained since the last checkpoint
        self.dropped: list[str] = []  # trajectory ids dropped as stale since the last checkpoint
        self.dropped_branch: list[str] = []  # of those, the ones generated on a discarded branch
        self.lineage = Lineage()  # the version tree: staleness counts updates along it (see restore_or_init)
        # Trajectory id -> step that trained it or dropped it as stale, for the last DEDUP_STEPS steps: a
        # redelivered or regenerated group arrives within that window, and a checkpointed step's entries whose
        # acks were lost are replayed after a restore (a drop judged again would be recorded twice).
        self.judged_ids: dict[str, int] = {}
        # Where the next look over our own pending list starts (XPENDING range), None while reading new
        # entries; "-" at the start, at every step and after a read that found nothing (see read_entries).
        self.replay_from: str | None = "-"
        self.delivered: dict[bytes, int] = {}   # the deliveries of the ids ``pending_unheld`` returned last
        self.trained_total = 0
        self.dropped_total = 0
        self.dropped_branch_total = 0
        t0 = time.monotonic()
        start = self.restore_or_init()
        self.meter.add(pause_s=time.monotonic() - t0)
        self.checkpointed_step = self.step  # the last step a durable checkpoint holds
        # Entry id -> deaths while probed alone, of the entries in our hands when a learner process died
        # (see take_suspects): each is probed alone before it is trained again.
        self.suspects: dict[bytes, int] = self.take_suspects()
        self.optimizer = make_optimizer(self.model, self.cfg)
        if start is not None:
            self.optimizer.load_state_dict(start)
        self.updates = 0   # optimizer steps taken by this process: whether a failed step changed the weights
        self.optimizer.register_step_post_hook(self.count_update)
        self.set_lr()
        self.prefetch: Prefetch | None = None  # the step in hand, trained as its groups arrive (learner.prefetch)
        self.ranks: RankGroup | None = None  # ranks 1..N-1, when there are any
        if world > 1:
            self.ranks = RankGroup.start(ctx.run_dir, ctx.worker_id, world, self.model, self.source_dir,
                                         self.restored_from, ctx.log)

    # --- state ------------------------------------------------------------------------------

    def count_update(self, _optimizer, _args, _kwargs) -> None:
        self.updates += 1

    def restore_or_init(self):
        """Load the newest checkpoint if there is one, else the run's initial policy (version 0).

        Without a checkpoint, the published weights may already hold updates
        whose entries were never acknowledged; they will be replayed, so the
        learner starts again from the initial policy, not from those weights.
        """
        latest = latest_checkpoint(self.ckpt_dir)
        # drops a dead learner held in its unfinished batch: replayed and judged again
        self.write(lambda pipe: pipe.hset(self.ctx.keys.counters, mapping={"dropped_held": 0, "filtered_held": 0}))
        info = self.ctx.r.hgetall(self.ctx.keys.policy)
        # the newest version number used: published, or only named by a step the dead learner recorded (a
        # publish cadence above 1 leaves steps unpublished), or written to disk and not announced (or
        # announced, and the announcement lost with Redis's last second of AOF); the restart numbers past all
        recorded = json.loads(self.ctx.r.hget(self.ctx.keys.learner_stats, "policy_version") or "0")
        published = max(int(info[b"version"]) if info else 0, int(recorded), newest_published(self.pub_dir))
        stored = load_segments(self.ctx.r, self.ctx.keys)
        if latest is None:
            manifest = json.loads((self.ctx.run_dir / "manifest.json").read_text())
            self.load(manifest.get("initial_policy") or info[b"path"].decode())
            self.version = 0
            self.lineage = restored(stored, None)
            if published > 0:  # a learner ran before: restart under a new version number
                self.version = published + 1
                self.start_line(updates=0, parent=0)  # the initial policy's weights, under a new number
                self.write(lambda pipe: pipe.hset(self.ctx.keys.counters, mapping={
                    "trained": 0, "dropped_stale": 0, "dropped_branch": 0}))
                self.publish()
            else:
                self.write(lambda pipe: record_line(pipe, self.ctx.keys, self.lineage, 0))
            return None
        state = read_state(latest)
        self.load(latest / "model")  # a checkpoint's model dir carries the initial policy's tokenizer files
        loaded = weights_digest(self.model)
        if loaded != state.get("weights_sha256", loaded):   # recorded since checkpoints carry it
            raise RuntimeError(f"checkpoint {latest.name}: the weights loaded from {latest / 'model'} are not the "
                               f"ones it recorded (sha256 {loaded[:12]}, recorded {state['weights_sha256'][:12]}); "
                               f"its files are damaged: move {latest.name} aside to restore the one before it")
        self.step = state["step"]
        self.trained_total = state["trained_total"]
        self.dropped_total = state["dropped_total"]
        self.dropped_branch_total = state.get("dropped_branch_total", 0)
        # A restore publishes under a new, higher version: a number never names two weight sets. The new
        # version starts a line from the checkpoint's (0 updates apart); what the dead learner published
        # after the checkpoint is a discarded branch.
        self.version = max(published, state["version"]) + 1
        self.lineage = restored(stored, state)
        self.start_line(updates=self.step, parent=state["version"])
        self.ctx.log.info("restored", checkpoint=str(latest), step=self.step, version=self.version,
                          parent_version=state["version"], weights_sha256=loaded)
        opt = read_optimizer(latest)
        self.restored_from = latest
        for record in ("consumed.txt", "dropped.txt"):
            self.judged_ids.update(recorded_ids_after(self.ckpt_dir, self.step - DEDUP_STEPS, record))
        # Counters follow the checkpoint: steps after it will be trained again from the replay.
        self.write(lambda pipe: pipe.hset(self.ctx.keys.counters, mapping={
            "trained": self.trained_total, "dropped_stale": self.dropped_total,
            "dropped_branch": self.dropped_branch_total}))
        self.publish()
        return opt

    def start_line(self, updates: int, parent: int) -> None:
        """Start a line at ``self.version`` from ``parent``'s weights, recorded before anything is published."""
        self.lineage.start_line(self.version, updates, parent)
        self.write(lambda pipe: record_line(pipe, self.ctx.keys, self.lineage, self.version))

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
        """Read scored groups until a batch is admitted; stale groups are dropped whole.

        The groups read go in hand first (``self.ahead``); ``take_in_hand``
        admits from there, and with ``learner.last_chance_first`` the learner
        reads ahead of the batch and admits first the groups this step is the
        last to take (``pipeline.dataplane.lookahead``). While the groups in
        hand could fill the batch, it does not wait on the stream: it takes
        what is there, and waits only for what the batch still lacks. With
        dynamic sampling it does not read ahead: a step may end at its cap.

        With ``learner.dynamic_sampling``, groups without signal (all rewards
        equal) are admitted but do not count towards ``batch_size``: reading
        goes on until the batch holds ``batch_size`` trajectories of groups
        with signal, or ``dynamic_sampling_max`` batches' worth in all. Like
        stale drops, they are published at once (``filtered_held``) so that
        the feeder issues their replacements while the batch fills.
        """
        batch, need = Batch(), self.cfg.batch_size
        dyn = self.cfg.dynamic_sampling
        cap = int(self.cfg.dynamic_sampling_max * need) if dyn else need
        streams, gs = self.ctx.cfg.streams, self.ctx.cfg.rollout.group_size
        held = set(self.unacked) | self.ahead.ids()  # pending at us: for the next checkpoint, or in hand
        held_drops = 0   # this batch's stale drops, published as the counter dropped_held until the step commits
        held_filtered = 0  # this batch's groups without signal (dynamic sampling), as the counter filtered_held
        in_hand = len(self.ahead)
        self.replay_from = "-"
        self.prefetch = self.start_prefetch()

        def full() -> bool:
            return batch.counted(dyn) >= need or batch.trajectories >= cap

        while not full() and not self.ctx.stopping():
            t0 = time.monotonic()
            want = max(1, (need - batch.counted(dyn)) // gs)
            block = None if self.ahead else streams.block_ms   # groups in hand: take them, wait after
            count = self.ahead.read_count(want, want + (self.ctx.cfg.job.steps - self.step - 1) * (need // gs))
            entries = self.read_waiting(count, block, held) if count else []
            held.update(entry_id for entry_id, _p in entries)
            batch.wait_s += time.monotonic() - t0
            payloads = dict(entries)
            good, bad = decode_entries(entries, streams.max_message_bytes)
            if bad:  # each stood for one group (streams.trajectories_of)
                self.dead_letter_bad([(i, payload, reason, gs) for i, payload, reason in bad])
            for entry_id, group in good:
                if not isinstance(group, messages.Group) or any(t.reward is None for t in group.trajectories):
                    self.dead_letter_bad([(entry_id, payloads[entry_id], "learner expects a scored group",
                                           trajectories_of(group, gs))])
                    continue
                self.ahead.add(entry_id, group, payloads[entry_id])
            self.take_in_hand(batch, full)
            self.feed(batch)
            changed: dict[str, int] = {}   # the counters that moved, in one write
            if batch.dropped_trajectories != held_drops:   # room for the feeder now, not at the step's end
                held_drops = changed["dropped_held"] = batch.dropped_trajectories
            if dyn and batch.no_signal != held_filtered:
                held_filtered = changed["filtered_held"] = batch.no_signal
            if len(self.ahead) != in_hand:
                in_hand = changed[AHEAD_COUNTER] = len(self.ahead)
            if changed:
                self.write(lambda pipe: pipe.hset(self.ctx.keys.counters, mapping=changed))
        return batch

    def take_in_hand(self, batch: Batch, full) -> None:
        """Consume groups in hand into ``batch`` until ``full()``, in ``InHand.order``: reading ahead
        (``learner.last_chance_first``), the stale ones and duplicates, then those at ``max_staleness``, then
        the rest in arrival order; else in arrival order."""
        items, ahead = self.ahead.items, bool(self.ahead.limit)
        staleness = [self.lineage.distance(g.version, self.version).updates if ahead else None for _i, g, _p in items]
        dups = [ahead and self.dedup and self.already_judged(g, batch) for _i, g, _p in items]
        order, must = self.ahead.order(staleness, dups, self.cfg.max_staleness)
        taken = []
        for n, i in enumerate(order):
            if n >= must and full():
                break
            taken.append(i)
            entry_id, group, payload = items[i]
            batch.entry_ids.append(entry_id)
            batch.raw[entry_id] = payload
            if self.dedup and self.already_judged(group, batch):
                batch.duplicates += len(group.trajectories)
                continue
            updates = self.admit(group, batch)
            if updates is not None:
                batch.groups.append(group)
                batch.staleness.append(updates)
                if no_signal(group.rewards):
                    batch.no_signal += len(group.trajectories)
        self.ahead.take(taken)

    def publish_ahead(self) -> None:
        """How many groups we hold read ahead (``learner_backlog`` counts them with the stream's lag)."""
        n = len(self.ahead)
        self.write(lambda pipe: pipe.hset(self.ctx.keys.counters, AHEAD_COUNTER, n))

    def start_prefetch(self) -> Prefetch | None:
        if not Prefetch.eligible(self.cfg, self.world) or self.suspects:   # a suspect is probed before training
            return None
        ro = self.ctx.cfg.rollout
        return Prefetch(self.model, self.optimizer, self.cfg, ro.temperature, ro.max_turns * ro.max_tokens_per_turn)

    def feed(self, batch: Batch) -> None:
        """Train the groups admitted since the last call (``learner.prefetch``).

        On an error, or a group the GPU must not see (``outside_vocabulary``),
        the prefetch is given up: ``train_contained`` then trains the whole
        batch as without it, and finds the group at fault.
        """
        pf = self.prefetch
        if pf is None or len(pf.groups) == len(batch.groups):
            return
        new, stale = batch.groups[len(pf.groups):], batch.staleness[len(pf.groups):]
        t0 = time.monotonic()
        try:
            if self.device.type == "cuda" and self.vocabulary_errors(new):
                raise ValueError("a group holds token ids outside the policy's vocabulary")
            self.mark_training(batch)
            self.ctx.state = "running"
            pf.add(new, stale)
        except Exception as exc:  # noqa: BLE001 - the batch is trained again whole, where errors are handled
            self.ctx.log.warning("prefetch_given_up", step=self.step + 1, error=f"{type(exc).__name__}: {exc}")
            self.prefetch = None
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            self.ctx.state = "waiting"
        batch.prefetch_s += time.monotonic() - t0

    def admit(self, group: messages.Group, batch: Batch) -> int | None:
        """The group's staleness if it is admitted; else None, the drop counted in ``batch`` with its reason.

        Staleness counts learner updates between the group's weights and ours
        along the version tree (``dataplane.lineage``): the restored line's own
        work is as stale as its updates say, however many versions a restore
        skipped. A group from a discarded branch is off-policy by the updates
        back to the fork and on to us; its behaviour log-probs are those of the
        weights that sampled it, so the importance ratio corrects it as it
        corrects a stale group of that distance, and the same bound holds.
        Beyond it, or from a version the tree does not know, it is dropped as
        ``dropped_branch`` (counted among the stale drops as well).
        """
        d = self.lineage.distance(group.version, self.version)
        if d.updates is not None and d.updates <= self.cfg.max_staleness:
            return d.updates
        batch.dropped_groups += 1
        batch.dropped_trajectories += len(group.trajectories)
        batch.dropped_ids += group.trajectory_ids()
        if not d.on_line:
            batch.dropped_branch_ids += group.trajectory_ids()
        return None

    @property
    def dedup(self) -> bool:
        return self.ctx.cfg.streams.dedup

    def already_judged(self, group: messages.Group, batch: Batch) -> bool:
        """Was this group (any of its trajectory ids) trained or dropped as stale, or judged in this batch?"""
        in_batch = {tid for g in batch.groups for tid in g.trajectory_ids()} | set(batch.dropped_ids)
        return any(tid in self.judged_ids or tid in in_batch for tid in group.trajectory_ids())

    def read_waiting(self, count: int, block_ms: int | None, held: set[bytes]) -> list:
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

    def read_entries(self, count: int, block_ms: int | None, held: set[bytes]) -> list:
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
        """Up to ``count`` ids pending at us and not ``held``, oldest first, from ``replay_from`` on; their
        deliveries so far go to ``self.delivered`` (a dead letter says them)."""
        r, stream, me = self.ctx.r, self.ctx.keys.scored, self.ctx.worker_id
        out: list[bytes] = []
        delivered: dict[bytes, int] = {}
        while len(out) < count:
            infos = r.xpending_range(stream, GROUP_LEARNER, min=self.replay_from, max="+", count=PENDING_PAGE,
                                     consumername=me)
            page = [_as_bytes(p["message_id"]) for p in infos]
            delivered.update((_as_bytes(p["message_id"]), int(p["times_delivered"])) for p in infos)
            out += [i for i in page if i not in held][:count - len(out)]
            if len(page) < PENDING_PAGE:
                break
            self.replay_from = "(" + page[-1].decode()
        if out:
            self.replay_from = "(" + out[-1].decode()
        self.delivered = {i: delivered[i] for i in out}
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
            self.dead_letter_bad([(i, b"", "deleted from the stream while pending", self.ctx.cfg.rollout.group_size,
                                   self.delivered.get(i, 1)) for i in sorted(gone)])
        return entries

    def ack_judged_pending(self) -> None:
        """Acknowledge the entries pending at us whose groups the checkpoints hold (trained or dropped).

        For a learner restored with no step left to take: the last
        checkpoint's acks were lost (a kill between the checkpoint and its
        XACK), and no step replays the entries, so nothing else would ever
        acknowledge them. What no checkpoint holds stays pending.
        """
        self.replay_from = "-"
        judged, trajectories = [], 0
        while entries := self.replay_unheld(PENDING_PAGE, set()):
            good, _bad = decode_entries(entries, self.ctx.cfg.streams.max_message_bytes)
            for entry_id, group in good:
                if isinstance(group, messages.Group) and self.already_judged(group, Batch()):
                    judged.append(entry_id)
                    trajectories += len(group.trajectories)
        if judged:
            keys = self.ctx.keys
            self.write(lambda pipe: (pipe.xack(keys.scored, GROUP_LEARNER, *judged),
                                     pipe.hincrby(keys.counters, "duplicates_dropped_learner", trajectories)))
            trim(self.ctx.r, keys.scored)
            self.ctx.log.info("acked_judged_pending", entries=len(judged))

    def write(self, queue) -> None:
        """A transaction of small writes, waiting while Redis is full (backpressure, never a crash)."""
        transact(self.ctx.r, queue, self.ctx.log, self.ctx.stopping)

    def dead_letter_bad(self, bad, also=None) -> None:
        """Dead-letter and acknowledge ``(entry id, payload, reason, trajectories it stood for[, deliveries])``;
        ``also(pipe)`` queues more writes into the same transaction."""
        def queue(pipe):
            for entry_id, payload, reason, trajectories, *deliveries in bad:
                dead_letter(pipe, self.ctx.keys, self.ctx.keys.scored, entry_id, reason, payload,
                            deliveries=deliveries[0] if deliveries else 1, trajectories=trajectories)
                pipe.xack(self.ctx.keys.scored, GROUP_LEARNER, entry_id)
            if also is not None:
                also(pipe)

        self.write(queue)
        for _id, _payload, reason, *_n in bad:
            self.ctx.log.warning("dead_lettered", reason=reason)

    # --- training ------------------------------------------------------------------------------

    def train(self, batch: Batch) -> dict:
        """One GRPO update on the admitted groups, over every rank; returns the step's metrics."""
        rows = group_rows(batch.groups, batch.staleness, self.cfg.advantage)
        prefetched, self.prefetch = self.prefetch, None   # used once: a retry after an error trains the batch whole
        if prefetched is not None and prefetched.covers(batch.groups):
            sums = prefetched.step(self.step)
        else:
            ro = self.ctx.cfg.rollout
            shares = plan_shares(batch.groups, batch.staleness, self.version, self.step, self.world, self.cfg,
                                 max_completion=ro.max_turns * ro.max_tokens_per_turn)
            if self.ranks is not None:
                self.ranks.send(shares[1:])
            sums = train_share(self.model, self.optimizer, shares[0], self.cfg, ro.temperature,
                               distributed=self.ranks is not None)
        if sums.weight_spread:  # the ranks' weights should never part: a fault of the hardware or the collectives
            self.ctx.log.warning("ranks_diverged", step=self.step + 1, weight_spread=sums.weight_spread)
        if sums.skipped_nonfinite:
            self.ctx.log.warning("skipped_nonfinite", step=self.step + 1, loss=sums.loss, grad_norm=sums.grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]   # the rate this step trained with
        self.step += 1
        self.version += 1
        self.set_lr()
        return step_metrics(batch, rows, active_rows(rows), sums, step=self.step, version=self.version,
                            lr=lr, gpus=self.world)

    def train_contained(self, batch: Batch) -> dict:
        """``train``, with the entries that make training raise taken out and dead-lettered.

        Before training, entries that already made training raise
        ``learner.max_train_attempts`` times (counted in Redis, so across
        restarts) are dead-lettered with the error recorded. When the step
        raises, each group is tried alone (forward and backward, no optimizer
        step): the groups that raise are tried again until their attempts
        reach the bound and then dead-lettered with the real error; the step
        is trained on the rest, each once. When no group raises alone (or
        every one does: a broken device, not the data), or with several
        ranks, the attempts of the whole batch are counted and the error
        re-raised: the learner exits, and its restart replays the batch.
        With several mini-batches, an error after the first one updated the
        weights cannot be retried on them: the groups that raise alone are
        dead-lettered and ``StepPartlyApplied`` raised, so that the restart
        trains the step from the last checkpoint.
        A learner process that dies in training (an OOM kill, a native crash),
        or one of its ranks, raises nothing that counts; its restart probes the
        entries it held, one at a time (``probe_suspects``). So does the
        restart after a step that raised with several ranks, whose groups could
        not be tried alone mid-step.
        """
        if self.device.type == "cuda":
            self.dead_letter_entries(batch, self.outside_vocabulary(batch))
        if self.ctx.r.exists(self.ctx.keys.learner_attempts):   # some entry made training raise before
            self.dead_letter_entries(batch, self.attempts_over(list(self.entry_ids_of(batch).values())))
        if self.suspects:
            self.probe_suspects(batch)
        self.mark_training(batch)
        while True:
            updates = self.updates
            try:
                return self.train(batch)
            except RankDied:
                raise   # a death, as if this process had died: learner:training stays, the restart probes it
            except Exception as exc:  # noqa: BLE001 - anything the data can make torch raise; bounded below
                if self.ranks is not None and (why := self.ranks.gone()):   # a collective that lost its peer
                    raise RankDied(why) from exc
                error = f"{type(exc).__name__}: {exc}"
                if is_oom(exc):   # reported whether one group turns out too big or the exit follows
                    record_oom(self.ctx, exc, fatal=False)
                culprits = self.failing_groups(batch) if self.ranks is None and len(batch.groups) else {}
                if not culprits or len(culprits) == len(batch.groups) > 1:
                    self.count_attempts(batch.entry_ids, error)
                    if self.ranks is None:   # each group was tried alone just now
                        self.forget_training()   # an error, counted: no death to charge
                    # with ranks none was (their collectives are mid-step): the restart tries each alone
                    raise
                self.ctx.log.warning("train_raised", error=error, failing_groups=len(culprits))
                self.dead_letter_entries(batch, culprits)
                if self.updates > updates:   # an earlier mini-batch stepped: the weights hold part of the step
                    self.forget_training()
                    raise StepPartlyApplied(
                        f"step {self.step + 1} raised after {self.updates - updates} of its mini-batches updated "
                        f"the weights ({error}); {len(culprits)} group(s) dead-lettered, the restart trains the "
                        "step from the last checkpoint") from exc

    def outside_vocabulary(self, batch: Batch) -> dict[bytes, str]:
        """Entry id -> reason of the groups holding a token id the policy does not have.

        Checked before training on a GPU, where such an id is not an
        exception but a device-side assert, after which the process's CUDA
        context is lost for every group alike. On the CPU the embedding
        raises IndexError, which ``train_contained`` handles like any error.
        """
        bad = self.vocabulary_errors(batch.groups)
        if not bad:
            return {}
        entry_of = self.entry_ids_of(batch)
        return {entry_of[pid]: reason for pid, reason in bad.items() if pid in entry_of}

    def vocabulary_errors(self, groups) -> dict[str, str]:
        """Prompt id -> reason of the groups holding a token id the policy does not have."""
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if not vocab:
            return {}
        bad = {}
        for g in groups:
            arrays = [g.prompt_tokens, *(t.completion for t in g.trajectories)]
            if any(a.size and (int(a.max()) >= vocab or int(a.min()) < 0) for a in arrays):
                bad[g.prompt_id] = f"token ids outside the policy's vocabulary (0..{vocab - 1})"
        return bad

    def failing_groups(self, batch: Batch) -> dict[bytes, str]:
        """Entry id -> error of the batch's groups that raise when trained alone, ``max_train_attempts`` times.

        Each try is a forward and backward pass of the group alone, with its
        gradient thrown away; the attempts are counted per entry in Redis.
        """
        entry_of = self.entry_ids_of(batch)
        out: dict[bytes, str] = {}
        for g, stale in zip(batch.groups, batch.staleness, strict=True):
            entry_id = entry_of.get(g.prompt_id)
            if entry_id is None:
                continue
            while True:
                error = self.probe(g, stale)
                if error is None:
                    break
                if self.count_attempts([entry_id], error)[entry_id] >= self.cfg.max_train_attempts:
                    out[entry_id] = error
                    break
        return out

    def probe(self, group: messages.Group, staleness: int) -> str | None:
        """The error of a forward and backward pass on ``group`` alone (None: it trains); grads are cleared."""
        active = active_rows(group_rows([group], [staleness], self.cfg.advantage))
        try:
            accumulate_gradients(self.model, active, self.cfg, self.ctx.cfg.rollout.temperature)
            return None
        except Exception as exc:  # noqa: BLE001 - the error is the verdict on this group
            return f"{type(exc).__name__}: {exc}"
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    # --- entries in hand when a learner process died -------------------------------------------------

    def mark_training(self, batch: Batch) -> None:
        """Record in Redis the batch's entries before their gradients are computed; the step's writes clear
        them. What a dead process left there, ``take_suspects`` reads."""
        new = [i for i in batch.entry_ids if i not in batch.marked]
        if new:
            self.write(lambda pipe: pipe.hset(self.ctx.keys.learner_training, mapping=dict.fromkeys(new, "step")))
            batch.marked.update(new)

    def forget_training(self) -> None:
        """Clear ``learner_training`` on the way out without a death, if Redis takes it now: the drain's
        checkpoint must not wait on it (a full Redis refuses a write while we stop), and a mark left
        behind costs the restart one probe of each of those groups, nothing more."""
        try:
            self.ctx.r.delete(self.ctx.keys.learner_training)
        except redis.RedisError as exc:
            self.ctx.log.warning("training_marks_left", error=str(exc))

    def let_go_of_batch(self) -> None:
        """On a drain before the batch trained, the counters of what it held go back to 0, if Redis takes it now:
        its drops and groups without signal are judged again by the next learner, and until then the
        feeder must count them in flight, not over-issue. The groups read ahead stay counted: pending here,
        outside the scored stream's lag, they wait for the next learner as lag would (the feeder's hold)."""
        try:
            self.ctx.r.hset(self.ctx.keys.counters, mapping={"dropped_held": 0, "filtered_held": 0,
                                                             AHEAD_COUNTER: len(self.ahead)})
        except redis.RedisError as exc:
            self.ctx.log.warning("held_counters_left", error=str(exc))   # the next learner's start resets them

    def take_suspects(self) -> dict[bytes, int]:
        """The suspects on record, with what a dead predecessor left in training added (at start).

        A process that dies computing gradients (an OOM kill, a segfault in a
        native library, a SIGKILL) leaves its entries in ``learner_training``:
        a step's entries become suspects with no death counted against them (a
        whole batch cannot say which one killed it); an entry probed alone is
        charged the death. A suspect charged ``max_train_attempts`` deaths is
        dead-lettered instead of trained (``probe_suspects``).
        """
        keys = self.ctx.keys
        left = self.ctx.r.hgetall(keys.learner_training)
        if left:
            def queue(pipe):
                for entry_id, how in left.items():
                    if how == b"probe":
                        pipe.hincrby(keys.learner_suspects, entry_id, 1)
                    else:
                        pipe.hsetnx(keys.learner_suspects, entry_id, 0)
                pipe.delete(keys.learner_training)
            self.write(queue)
            self.ctx.log.warning("died_in_training", entries=len(left),
                                 probed_alone=sum(how == b"probe" for how in left.values()))
        suspects = {i: int(n) for i, n in self.ctx.r.hgetall(keys.learner_suspects).items()}
        # one acknowledged since (dead-lettered, or judged in a step a checkpoint holds) never comes back
        gone = [i for i in suspects if not self.ctx.r.xpending_range(keys.scored, GROUP_LEARNER, i, i, 1)]
        if gone:
            self.write(lambda pipe: pipe.hdel(keys.learner_suspects, *gone))
        return {i: n for i, n in suspects.items() if i not in gone}

    def probe_suspects(self, batch: Batch) -> None:
        """Dead-letter the batch's suspects charged ``max_train_attempts`` deaths; probe the others alone.

        Each probe (``probe``: a forward and backward pass of the group alone)
        is recorded in ``learner_training`` first, so that a death during it
        is charged to that group alone. A probe that passes clears the
        suspect; one that raises counts a training attempt against the group
        (a rank it killed raises here, on rank 0), and at
        ``max_train_attempts`` it is dead-lettered with that error.
        """
        entry_of = self.entry_ids_of(batch)
        limit = self.cfg.max_train_attempts
        over = {i: f"the learner process died {n} times training this group alone" for i in entry_of.values()
                if (n := self.suspects.get(i, 0)) >= limit}
        self.dead_letter_entries(batch, over)
        keys = self.ctx.keys
        raised: dict[bytes, str] = {}
        probed = 0
        for g, stale in zip(batch.groups, batch.staleness, strict=True):
            entry_id = entry_of.get(g.prompt_id)
            if entry_id not in self.suspects:
                continue
            probed += 1
            self.write(lambda pipe: pipe.hset(keys.learner_training, entry_id, "probe"))
            error = self.probe(g, stale)
            self.ctx.log.info("probed_suspect", entry=entry_id.decode(), deaths=self.suspects[entry_id],
                              error=error)
            del self.suspects[entry_id]
            self.write(lambda pipe: (pipe.hdel(keys.learner_suspects, entry_id), pipe.delete(keys.learner_training)))
            if error is not None:
                raised[entry_id] = error
        if len(raised) > 1 and len(raised) == probed:
            return   # every group raises alone: the device, not the data (train_contained's rule)
        self.dead_letter_entries(batch, {i: e for i, e in raised.items()
                                         if self.count_attempts([i], e)[i] >= limit})

    def entry_ids_of(self, batch: Batch) -> dict[str, bytes]:
        """prompt_id -> entry id of the batch's admitted groups (a group's prompt id is unique in a batch)."""
        wanted = {g.prompt_id for g in batch.groups}
        out = {}
        for entry_id in batch.entry_ids:
            try:
                msg = messages.decode(batch.raw.get(entry_id, b""), 1 << 40)
            except messages.BadMessage:
                continue
            if msg.prompt_id in wanted:
                out[msg.prompt_id] = entry_id
        return out

    def count_attempts(self, entry_ids: list[bytes], error: str) -> dict[bytes, int]:
        """Add one failed training attempt, with its error, to each entry; returns the counts."""
        key = self.ctx.keys.learner_attempts
        old = self.ctx.r.hmget(key, entry_ids) if entry_ids else []
        counts = {i: (json.loads(raw)["n"] if raw else 0) + 1 for i, raw in zip(entry_ids, old)}
        if counts:
            self.write(lambda pipe: pipe.hset(key, mapping={
                i: json.dumps({"n": n, "error": error[:2000]}) for i, n in counts.items()}))
        return counts

    def attempts_over(self, entry_ids: list[bytes]) -> dict[bytes, str]:
        """Entry id -> recorded error of the entries whose training raised ``max_train_attempts`` times."""
        if not entry_ids:
            return {}
        out = {}
        for entry_id, raw in zip(entry_ids, self.ctx.r.hmget(self.ctx.keys.learner_attempts, entry_ids)):
            rec = json.loads(raw) if raw else None
            if rec and rec["n"] >= self.cfg.max_train_attempts:
                out[entry_id] = f"training raised {rec['n']} times: {rec['error']}"
        return out

    def dead_letter_entries(self, batch: Batch, errors: dict[bytes, str]) -> None:
        """Take these entries out of the batch and dead-letter them, whole, with their error."""
        if not errors:
            return
        entry_of = self.entry_ids_of(batch)
        failed = {entry_of[g.prompt_id]: g for g in batch.groups if entry_of.get(g.prompt_id) in errors}
        kept = [(g, s) for g, s in zip(batch.groups, batch.staleness, strict=True)
                if entry_of.get(g.prompt_id) not in errors]
        batch.groups, batch.staleness = [g for g, _ in kept], [s for _, s in kept]
        batch.entry_ids = [i for i in batch.entry_ids if i not in errors]
        # a group without signal was counted as filtered when admitted: from now on it is a dead letter only
        flat = sum(len(g.trajectories) for g in failed.values() if no_signal(g.rewards))
        batch.no_signal -= flat
        dyn = self.cfg.dynamic_sampling
        gs = self.ctx.cfg.rollout.group_size
        self.dead_letter_bad([(i, batch.raw.get(i, b""), f"learner: {error}",
                              trajectories_of(failed.get(i), gs)) for i, error in errors.items()],
                             also=(lambda pipe: pipe.hset(self.ctx.keys.counters, "filtered_held", batch.no_signal))
                             if dyn and flat else None)
        self.write(lambda pipe: (pipe.hdel(self.ctx.keys.learner_attempts, *errors),
                                 pipe.hdel(self.ctx.keys.learner_suspects, *errors)))
        for entry_id in errors:
            self.suspects.pop(entry_id, None)

    # --- publishing and checkpoints ---------------------------------------------------------------

    def cadence(self) -> int:
        """Steps per published version: the controller's, else the config's; the last one read while Redis is away."""
        try:
            every, _at = read_cadence(self.ctx.r, self.ctx.keys, self.cfg.publish_every, self.cfg.max_staleness)
        except UNAVAILABLE:
            return self.publish_every
        if every != self.publish_every:
            self.ctx.log.info("publish_cadence", every=every, was=self.publish_every)
            self.publish_every = every
        return every

    def publish(self) -> None:
        """Write weights for the current version and announce them; old versions are pruned.

        Weights holding a NaN or an infinity are never published (train_share
        skips a non-finite step, so they cannot arise from one): RuntimeError.
        """
        bad = [name for name, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:
            raise RuntimeError(f"refusing to publish version {self.version}: non-finite weights in "
                               f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
        final = write_published(self.pub_dir, self.version, self.model, self.source_dir)
        announce = announcement(self.version, final, self.step)
        self.write(lambda pipe: pipe.hset(self.ctx.keys.policy, mapping=announce))
        self.ctx.set_version(self.version)
        self.published_step = self.step
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
            "dropped_total": self.dropped_total, "dropped_branch_total": self.dropped_branch_total,
            "lineage": self.lineage.to_json(), "world_size": self.world, "written_at": time.time(),
            "weights_sha256": weights_digest(self.model)},
            self.source_dir, dropped_branch=self.dropped_branch)
        if self.unacked:
            # Both are safe to repeat, so a Redis blip is waited out. Acks lost all the same (a kill right
            # here, an everysec AOF) leave the entries pending: replayed after a restore, they are skipped
            # as already judged (already_judged), or acknowledged at once when no step is left.
            outage = Outage(self.ctx.log, stop=self.ctx.stopping)
            outage.call(self.ctx.r.xack, self.ctx.keys.scored, GROUP_LEARNER, *self.unacked)
            outage.call(self.ctx.r.hdel, self.ctx.keys.learner_attempts, *self.unacked)   # trained: failures past
            if self.suspects:   # those judged without a probe (a duplicate, a stale drop)
                outage.call(self.ctx.r.hdel, self.ctx.keys.learner_suspects, *self.unacked)
                for entry_id in self.unacked:
                    self.suspects.pop(entry_id, None)
        # safe to repeat, and the checkpoint is durable already: an outage here is waited out, not a crash
        Outage(self.ctx.log, stop=self.ctx.stopping).call(trim, self.ctx.r, self.ctx.keys.scored)
        self.meter.add(pause_s=time.monotonic() - t0)
        self.ctx.log.info("checkpointed", step=self.step, acked=len(self.unacked))
        self.unacked, self.consumed, self.dropped, self.dropped_branch = [], [], [], []
        self.checkpointed_step = self.step

    # --- the loop ---------------------------------------------------------------------------------

    def record(self, batch: Batch, metrics: dict) -> None:
        self.unacked += batch.entry_ids
        trained = [tid for g in batch.groups for tid in g.trajectory_ids()]
        self.consumed += trained
        self.dropped += batch.dropped_ids
        self.dropped_branch += batch.dropped_branch_ids
        self.dropped_branch_total += len(batch.dropped_branch_ids)
        for tid in (*trained, *batch.dropped_ids):
            self.judged_ids[tid] = self.step
        self.judged_ids = {k: v for k, v in self.judged_ids.items() if v > self.step - DEDUP_STEPS}
        self.trained_total += metrics["trajectories"]
        self.dropped_total += batch.dropped_trajectories
        self.meter.add(busy_s=metrics["train_s"] * self.world, items=metrics["trajectories"],
                       tokens=metrics["tokens"])
        metrics.update(trained_total=self.trained_total, dropped_stale_total=self.dropped_total,
                       duplicates_skipped=batch.duplicates, at=time.time())
        execute_with_backpressure(lambda: _step_writes(self.ctx.r, self.ctx.keys, batch, metrics),
                                  self.ctx.log, self.ctx.stopping)
        # Entries held until the next checkpoint: refresh the claim so no one reclaims them.
        held = self.unacked + sorted(self.ahead.ids())
        if held:   # safe to repeat: an outage here is waited out (the step is committed already)
            Outage(self.ctx.log, stop=self.ctx.stopping).call(
                self.ctx.r.xclaim, self.ctx.keys.scored, GROUP_LEARNER, self.ctx.worker_id, 0, held, justid=True)
        with open(self.ctx.run_dir / "metrics.jsonl", "a") as f:
            f.write(json_line({"kind": "learner_step", **metrics}) + "\n")   # a skipped step's inf: null
        self.ctx.count(metrics["trajectories"])

    def run(self) -> None:
        steps = self.ctx.cfg.job.steps
        self.ctx.publish_state("running")
        self.publish_ahead()    # none in hand yet: what a predecessor held is pending at us, replayed as we read
        if self.step >= steps:   # restored at the end: no step replays what the last checkpoint's lost acks left
            self.ack_judged_pending()
        while self.step < steps and not self.ctx.stopping():
            self.ctx.state = "waiting"
            with span(self.ctx.log, "learner_wait"):
                batch = self.collect()
            if self.ctx.stopping():
                # a batch not trained: its entries stay pending, and the next learner-0 replays them
                self.forget_training()
                self.let_go_of_batch()
                break
            self.ctx.state = "running"
            t0 = time.monotonic()
            with span(self.ctx.log, "train", trajectories=batch.trajectories, world=self.world):
                metrics = self.train_contained(batch)
            # training time, the part done while the batch filled included: what the observer measures speed by
            metrics["train_s"] = time.monotonic() - t0 + batch.prefetch_s
            metrics["prefetch_s"] = batch.prefetch_s
            metrics.update(batch_metrics(batch, self.step, self.ctx.cfg.metrics.diversity_every))
            metrics["publish_s"] = 0.0
            metrics["publish_every"] = every = self.cadence()
            if publishes(self.step, self.published_step, every, steps):
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
    equal_groups = sum(1 for g in batch.groups if no_signal(g.rewards))
    rates = sums.counts.rates()
    return {
        "step": step, "policy_version": version, "loss": sums.loss,
        "reward_mean": float(rewards.mean()) if rows else 0.0,
        "reward_std": float(rewards.std()) if rows else 0.0,
        "success_rate": float((rewards >= 1.0).mean()) if rows else 0.0,
        # the current policy's entropy at the trained tokens (the learner's forward pass, before the update)
        "entropy": rates["entropy"] if rates["entropy"] is not None else float(-behaviour.mean()),
        "behaviour_neg_logprob": float(-behaviour.mean()),
        "staleness_mean": float(stale.mean()) if rows else 0.0,
        "staleness_max": int(stale.max()) if rows else 0,
        "staleness_hist": {int(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))},
        "trajectories": len(rows), "active_trajectories": len(active),
        "zero_signal_groups": equal_groups, "groups": len(batch.groups),
        "dropped_stale": batch.dropped_trajectories, "grad_norm": sums.grad_norm,
        "clip_frac": sums.clip_weighted / sums.clip_weight if sums.clip_weight else 0.0,
        "clip_frac_pos": rates["clip_frac_pos"], "clip_frac_neg": rates["clip_frac_neg"],
        "is_masked_frac": rates["is_masked_frac"], "is_truncated_frac": rates["is_truncated_frac"],
        "is_weight_mean": rates["is_weight_mean"], "optimizer_steps": sums.optimizer_steps,
        "filtered_no_signal": batch.no_signal,
        "ratio_fresh_tokens": sums.fresh_n,
        "ratio_fresh_max_abs_log": sums.fresh_max if sums.fresh_n else None,
        "ratio_fresh_mean_abs_log": sums.fresh_sum / sums.fresh_n if sums.fresh_n else None,
        "policy_tokens": sums.tokens, "tokens": sum(row_tokens(r) for r in rows), "gpus": gpus,
        "wait_s": batch.wait_s, "lr": lr, "rank_weight_spread": sums.weight_spread,
        "skipped_nonfinite": sums.skipped_nonfinite,
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
    pipe.hset(keys.counters, "dropped_held", 0)   # the held drops, counted above
    pipe.hset(keys.counters, "filtered_held", 0)  # the held groups without signal, counted in trained above
    if metrics.get("filtered_no_signal"):
        pipe.hincrby(keys.counters, "filtered_no_signal", metrics["filtered_no_signal"])
    if batch.dropped_branch_ids:
        pipe.hincrby(keys.counters, "dropped_branch", len(batch.dropped_branch_ids))
    if batch.duplicates:
        pipe.hincrby(keys.counters, "duplicates_dropped_learner", batch.duplicates)
    if metrics.get("skipped_nonfinite"):
        pipe.hincrby(keys.counters, "steps_skipped_nonfinite", 1)
    pipe.hset(keys.learner_stats, mapping={k: json.dumps(v) for k, v in metrics.items()})
    pipe.delete(keys.learner_training)   # trained: no death to charge
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
        with oom_reported(ctx):   # loading, training, publishing and checkpointing
            learner = Learner(ctx, world=world_size())
            try:
                learner.run()
            finally:
                learner.close()
    finally:
        finish_worker(ctx)


if __name__ == "__main__":
    main()
