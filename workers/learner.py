"""Learner: scored stream -> GRPO update -> published weights and checkpoints.

One process (``python -m workers.learner``), started by ``libra-ctl run``.
A step reads whole scored groups until ``batch_size`` trajectories are
admitted, dropping (and counting) groups staler than ``max_staleness``. Every
``publish_every`` steps it publishes weights under a new version; every
``checkpoint_every`` steps it writes a checkpoint (weights, optimizer, step,
version, the ids it consumed) and only then acknowledges the stream entries
that checkpoint contains. A restart restores the latest checkpoint, publishes
under a new version, and its unacknowledged entries are replayed.

It trains on the slot's GPU when there is one (the node agent sets
CUDA_VISIBLE_DEVICES per slot, so that GPU is cuda:0), else on the CPU;
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

from pipeline.config import LearnerConfig
from pipeline.dataplane import messages
from pipeline.observe.diversity import diversity_metrics
from pipeline.dataplane.keys import GROUP_LEARNER
from pipeline.observe.measures import tool_stats
from pipeline.observe.trace import span
from pipeline.dataplane.streams import (dead_letter, decode_entries, ensure_groups, execute_with_backpressure, read,
                              take_over_pending, transact, trim)
from pipeline.dataplane.worker import WorkerContext, finish_worker, start_worker
from workers.checkpoint import (latest_checkpoint, prune_published, read_optimizer, read_state, trained_ids_after,
                                write_checkpoint, write_published)
from workers.grpo import clipped_loss, group_advantages
from workers.tiny_policy import completion_logprobs, load_model

DEDUP_STEPS = 200  # steps a trained id is remembered (in memory and restored from checkpoints)


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

    def __init__(self, ctx: WorkerContext):
        self.ctx, self.cfg = ctx, ctx.cfg.learner
        torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(ctx.cfg.job.seed)
        self.device = pick_device()
        self.source_dir = Path()  # the directory the model was loaded from: its tokenizer files travel on
        self.ckpt_dir = ctx.run_dir / "checkpoints"
        self.pub_dir = ctx.run_dir / "policy"
        self.step = 0
        self.unacked: list[bytes] = []  # consumed since the last durable checkpoint
        self.consumed: list[str] = []  # trajectory ids trained since the last checkpoint
        self.dropped: list[str] = []  # trajectory ids dropped as stale since the last checkpoint
        # Trajectory id -> step that trained it, for the last DEDUP_STEPS steps: a
        # redelivered or regenerated group arrives within that window.
        self.trained_ids: dict[str, int] = {}
        self.replay_cursor: str | bytes | None = "0"  # our own pending entries come first
        self.trained_total = 0
        self.dropped_total = 0
        start = self.restore_or_init()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay)
        if start is not None:
            self.optimizer.load_state_dict(start)
        self.set_lr()

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
        self.trained_ids.update(trained_ids_after(self.ckpt_dir, self.step - DEDUP_STEPS))
        # Counters follow the checkpoint: steps after it will be trained again from the replay.
        self.write(lambda pipe: pipe.hset(self.ctx.keys.counters, mapping={
            "trained": self.trained_total, "dropped_stale": self.dropped_total}))
        self.publish()
        return opt

    def load(self, model_dir) -> None:
        """Load float32 weights onto the learner's device; later saves copy ``model_dir``'s tokenizer files."""
        self.model = load_model(model_dir).to(self.device)
        self.source_dir = Path(model_dir)
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ctx.log.info("model_loaded", path=str(model_dir), device=str(self.device), dtype=self.cfg.dtype,
                          parameters=sum(p.numel() for p in self.model.parameters()))

    def set_lr(self) -> None:
        warm = self.cfg.warmup_steps
        scale = min(1.0, (self.step + 1) / (warm + 1)) if warm else 1.0
        for g in self.optimizer.param_groups:
            g["lr"] = self.cfg.lr * scale

    # --- reading ------------------------------------------------------------------------------

    def collect(self) -> Batch:
        """Read scored groups until a batch is admitted; stale groups are dropped whole."""
        batch, need = Batch(), self.cfg.batch_size
        streams = self.ctx.cfg.streams
        while batch.trajectories < need and not self.ctx.stopping():
            t0 = time.monotonic()
            want = max(1, (need - batch.trajectories) // self.ctx.cfg.rollout.group_size)
            entries = self.read_entries(want, streams.block_ms)
            batch.wait_s += time.monotonic() - t0
            good, bad = decode_entries(entries, streams.max_message_bytes)
            if bad:
                self.dead_letter_bad(bad)
            for entry_id, group in good:
                batch.entry_ids.append(entry_id)
                if not isinstance(group, messages.Group) or any(t.reward is None for t in group.trajectories):
                    self.dead_letter_bad([(entry_id, messages.encode(group), "learner expects a scored group")])
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

    def read_entries(self, count: int, block_ms: int) -> list:
        # Replay our own pending entries first (after a restart), then read new ones.
        if self.replay_cursor is not None:
            reply = self.ctx.r.xreadgroup(GROUP_LEARNER, self.ctx.worker_id,
                                          {self.ctx.keys.scored: self.replay_cursor}, count=count)
            entries = [(i, f.get(messages.FIELD, b"")) for _s, es in reply or () for i, f in es]
            if entries:
                self.replay_cursor = entries[-1][0]
                return entries
            self.replay_cursor = None
        return read(self.ctx.r, self.ctx.keys.scored, GROUP_LEARNER, self.ctx.worker_id, count, block_ms)

    def write(self, queue) -> None:
        """A transaction of small writes, waiting while Redis is full (backpressure, never a crash)."""
        transact(self.ctx.r, queue, self.ctx.log, self.ctx.stopping)

    def dead_letter_bad(self, bad) -> None:
        def queue(pipe):
            for entry_id, payload, reason in bad:
                dead_letter(pipe, self.ctx.keys, self.ctx.keys.scored, entry_id, reason, payload)
                pipe.xack(self.ctx.keys.scored, GROUP_LEARNER, entry_id)

        self.write(queue)
        for _id, _payload, reason in bad:
            self.ctx.log.warning("dead_lettered", reason=reason)

    # --- training ------------------------------------------------------------------------------

    def train(self, batch: Batch) -> dict:
        """One GRPO update on the admitted groups; returns the step's metrics."""
        rows = _rows(batch.groups, self.version)
        active = [row for row in rows if row[2] != 0.0]  # zero advantage: no gradient
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, stats_all, fresh = self.backward(active)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        if active:
            self.optimizer.step()
        self.step += 1
        self.version += 1
        self.set_lr()
        return step_metrics(batch, rows, active, loss_sum, stats_all, fresh, grad_norm,
                            step=self.step, version=self.version, lr=self.optimizer.param_groups[0]["lr"])

    def backward(self, active: list) -> tuple[float, list, list[float]]:
        """Accumulate the loss's gradient over micro-batches; returns its sum, the chunks' stats, fresh |log ratio|s."""
        return accumulate_gradients(self.model, active, self.cfg, self.ctx.cfg.rollout.temperature)

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
        """Make the step durable, then acknowledge what it consumed (offsets ride on checkpoints)."""
        write_checkpoint(self.ckpt_dir, self.model, self.optimizer, self.consumed, self.dropped, {
            "step": self.step, "version": self.version, "trained_total": self.trained_total,
            "dropped_total": self.dropped_total, "written_at": time.time()}, self.source_dir)
        if self.unacked:
            self.ctx.r.xack(self.ctx.keys.scored, GROUP_LEARNER, *self.unacked)
        trim(self.ctx.r, self.ctx.keys.scored)
        self.ctx.log.info("checkpointed", step=self.step, acked=len(self.unacked))
        self.unacked, self.consumed, self.dropped = [], [], []

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
                break
            self.ctx.state = "running"
            t0 = time.monotonic()
            with span(self.ctx.log, "train", trajectories=batch.trajectories):
                metrics = self.train(batch)
            metrics["train_s"] = time.monotonic() - t0
            metrics.update(batch_metrics(batch, self.step, self.ctx.cfg.metrics.diversity_every))
            if self.step % self.cfg.publish_every == 0 or self.step == steps:
                with span(self.ctx.log, "publish", version=self.version):
                    self.publish()
            self.record(batch, metrics)
            self.ctx.log.info("trained", step=self.step, reward_mean=round(metrics["reward_mean"], 3),
                              staleness_max=metrics["staleness_max"], dropped=batch.dropped_trajectories,
                              train_s=round(metrics["train_s"], 2), wait_s=round(batch.wait_s, 2))
            if self.step % self.cfg.checkpoint_every == 0 or self.step == steps:
                with span(self.ctx.log, "checkpoint", step=self.step):
                    self.checkpoint()
        if self.step >= steps:
            self.ctx.r.hset(self.ctx.keys.state, "phase", "trained")
            self.ctx.log.info("training_done", step=self.step, version=self.version)


def pick_device() -> torch.device:
    """The slot's GPU when there is one (CUDA_VISIBLE_DEVICES shows it as cuda:0), else the CPU."""
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def autocast(device: torch.device, dtype: str):
    """The forward pass's precision: bf16 autocast for learner.dtype "bf16", else a no-op (fp32)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def row_tokens(row) -> int:
    """Tokens of a (prompt tokens, trajectory, advantage, staleness) row: prompt + completion."""
    return len(row[0]) + len(row[1].completion)


def micro_batches(rows: list, max_tokens: int) -> list[list]:
    """Rows by length, cut so that each micro-batch's padded size (rows x longest) fits in ``max_tokens``.

    Sorting keeps rows of similar length together, so little of a micro-batch
    is padding; a row longer than ``max_tokens`` goes alone.
    """
    out: list[list] = []
    for row in sorted(rows, key=row_tokens):
        # Sorted ascending: the new row is the longest of its micro-batch.
        if out and (len(out[-1]) + 1) * row_tokens(row) <= max_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def accumulate_gradients(model, active: list, cfg: LearnerConfig, temperature: float) -> tuple[float, list, list[float]]:
    """Add the batch loss's gradient to ``model``'s grads, micro-batch by micro-batch.

    The loss is token-level over the whole batch (each micro-batch's sum is
    divided by the batch's policy-token count), so however the rows are cut
    the accumulated gradient is the full batch's. Returns the loss, the
    micro-batches' stats and the fresh samples' |log ratio|s.
    """
    device = next(model.parameters()).device
    total_tokens = int(sum(int(r[1].mask.sum()) for r in active))
    loss_sum, stats_all, fresh = 0.0, [], []
    for chunk in micro_batches(active, cfg.micro_batch_tokens):
        with autocast(device, cfg.dtype):
            new = completion_logprobs(model, [r[0].tolist() for r in chunk], [r[1].completion.tolist() for r in chunk],
                                      temperature=temperature, chunk_tokens=cfg.logprob_chunk)
        old = [torch.from_numpy(r[1].logprobs.astype(np.float32)).to(device) for r in chunk]
        masks = [torch.from_numpy(r[1].mask.astype(np.float32)).to(device) for r in chunk]
        loss, st = clipped_loss(new, old, masks, [r[2] for r in chunk], cfg.clip_eps, total_tokens)
        loss.backward()
        loss_sum += float(loss.detach())
        stats_all.append(st)
        fresh += fresh_ratio_devs(new, old, masks, chunk)
    return loss_sum, stats_all, fresh


def _ids(group: messages.Group) -> list[str]:
    """Trajectory ids of a group: (prompt_id, sample_idx), written prompt_id/sample_idx."""
    return [f"{group.prompt_id}/{t.sample_idx}" for t in group.trajectories]


def _rows(groups: list[messages.Group], version: int) -> list[tuple]:
    """(prompt tokens, trajectory, advantage, staleness) for every trajectory of the groups."""
    rows = []
    for g in groups:
        adv = group_advantages(g.rewards)
        for t, a in zip(g.trajectories, adv):
            rows.append((g.prompt_tokens, t, a, version - g.version))
    return rows


def fresh_ratio_devs(new, old, masks, chunk) -> list[float]:
    """|log ratio| per policy token of samples generated by these very weights (staleness 0)."""
    out = []
    for n, o, m, row in zip(new, old, masks, chunk):
        if row[3] == 0:
            sel = m.bool()
            out += (n.detach()[sel] - o[sel]).abs().tolist()
    return out


def step_metrics(batch: Batch, rows, active, loss_sum, stats_all, fresh, grad_norm, *,
                 step: int, version: int, lr: float) -> dict:
    """The step's figures: reward, staleness, clipping, the fresh-sample ratio check, timing."""
    rewards = np.array([r[1].reward for r in rows], dtype=np.float64)
    stale = np.array([r[3] for r in rows])
    masks_all = [r[1].mask.astype(bool) for r in rows]
    behaviour = np.concatenate([r[1].logprobs[m] for r, m in zip(rows, masks_all)]) if rows else np.zeros(1)
    equal_groups = sum(1 for g in batch.groups if len(set(g.rewards)) == 1)
    n_tok = sum(s.tokens for s in stats_all)
    return {
        "step": step, "policy_version": version, "loss": loss_sum,
        "reward_mean": float(rewards.mean()) if rows else 0.0,
        "reward_std": float(rewards.std()) if rows else 0.0,
        "success_rate": float((rewards >= 1.0).mean()) if rows else 0.0,
        "entropy": float(-behaviour.mean()),
        "staleness_mean": float(stale.mean()) if rows else 0.0,
        "staleness_max": int(stale.max()) if rows else 0,
        "staleness_hist": {int(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))},
        "trajectories": len(rows), "active_trajectories": len(active),
        "zero_signal_groups": equal_groups, "groups": len(batch.groups),
        "dropped_stale": batch.dropped_trajectories, "grad_norm": grad_norm,
        "clip_frac": float(np.average([s.clip_frac for s in stats_all],
                                      weights=[max(s.tokens, 1) for s in stats_all])) if stats_all else 0.0,
        "ratio_fresh_tokens": len(fresh),
        "ratio_fresh_max_abs_log": float(max(fresh)) if fresh else None,
        "ratio_fresh_mean_abs_log": float(np.mean(fresh)) if fresh else None,
        "policy_tokens": n_tok, "wait_s": batch.wait_s, "lr": lr,
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
        Learner(ctx).run()
    finally:
        finish_worker(ctx)


if __name__ == "__main__":
    main()
