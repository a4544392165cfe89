"""The prompt feeder: issues prompts from the job's prompt file into the prompts stream.

Runs as its own process (``python -m workers.feeder``), started by
``libra-ctl run`` or the Procfile. Its cursor lives in Redis, so a restarted
feeder continues where it stopped. Each pass over the file is an epoch, and
the epoch is part of the prompt id, so a prompt issued twice is two distinct
groups. It pauses while the trajectories in flight (issued and not yet
trained, dropped or dead-lettered) reach ``streams.max_queue_size``, which
also bounds how stale the buffer can get, while the learner is behind by
``streams.backlog_batches`` batches (``learner_behind``), and, in synchronous
training with dynamic sampling, once a step's refills reach what its learner
reads at most (``step_reads_spent``).
"""

from __future__ import annotations

import functools
import hashlib
import random
import time

from pipeline.dataplane import messages
from pipeline.dataplane.redisconn import UNAVAILABLE, Outage
from pipeline.dataplane.streams import (counted_in_flight, downstream_backlog, ensure_groups,
                                         execute_with_backpressure)
from pipeline.dataplane.worker import WorkerContext, finish_worker, start_worker
from workers.envs import env_from_config
from workers.envs.base import BadLine, Environment, Task


def load_prompts(env: Environment, path: str, log=None) -> tuple[list[Task], list[BadLine]]:
    """All good tasks of a prompt file, read by the environment, and the bad lines (reported, then skipped)."""
    good, bad = [], []
    for item in env.read_prompts(path):
        (bad if isinstance(item, BadLine) else good).append(item)
    if log:
        for b in bad:
            log.warning("bad_prompt_line", file=path, line=b.lineno, reason=b.reason)
    return good, bad


def in_flight(ctx: WorkerContext) -> int:
    """Trajectories issued and not yet accounted for downstream.

    A dead letter counts what its entry stood for (a prompt or an undecodable
    entry: one group of ``group_size``; a group: its trajectories, see
    ``streams.trajectories_of``); one replayed onto its stream
    (``libra-ctl dlq replay``) is in flight again.

    The learner's stale drops count as soon as it judges them (``dropped_held``,
    the drops of the batch it is filling), not only when its step commits
    them: after a restore it may replay more stale work than the window holds,
    and its step would otherwise wait for prompts the feeder holds back.
    """
    return counted_in_flight(counters(ctx))


def counters(ctx: WorkerContext) -> dict[str, int]:
    """The job's counters (issued, trained, dropped, held, dead-lettered, ...)."""
    return {k.decode(): int(v) for k, v in ctx.r.hgetall(ctx.keys.counters).items()}


def admission_limit(cfg) -> int:
    """Trajectories allowed in flight: the queue bound, and no more than the learner consumes
    within ``max_staleness`` versions (plus the batch it is filling), so that admitted work is
    not generated only to be dropped as stale. At ``max_staleness = 0`` that is one batch: the
    next is issued once the learner has trained this one and published its weights (it publishes
    before it commits the step's counters), and each prompt carries that version
    (``Prompt.min_version``), which rollout waits for."""
    lr = cfg.learner
    return min(cfg.streams.max_queue_size, (lr.max_staleness + 1) * lr.batch_size)


def step_reads_spent(cfg, c: dict[str, int]) -> bool:
    """At ``max_staleness = 0`` with dynamic sampling: whether this step's trajectories issued (in flight,
    or held by the learner for want of signal; ``c``: the job's counters) reach the ``dynamic_sampling_max``
    batches' worth it reads at most. A refill issued beyond that would reach the learner after the step it
    was issued for, with the weights before it: it could only be dropped as stale."""
    lr = cfg.learner
    if lr.max_staleness or not lr.dynamic_sampling:
        return False
    issued = counted_in_flight(c) + c.get("filtered_held", 0)
    return issued + cfg.rollout.group_size > lr.dynamic_sampling_max * lr.batch_size


def learner_behind(ctx: WorkerContext) -> bool:
    """Whether ``streams.backlog_batches`` learner batches of generated trajectories wait for the learner.

    Then the learner is the slower stage: more prompts now would only wait
    longer downstream and reach it staler (or past ``max_staleness``, to be
    dropped); the rollout engines finish what they hold meanwhile. The des
    engine holds admission the same way (``pipeline.sim.des``).
    """
    cfg = ctx.cfg
    hold = cfg.streams.backlog_batches * cfg.learner.batch_size
    return hold > 0 and downstream_backlog(ctx.r, ctx.keys) * cfg.rollout.group_size >= hold


def job_phase(ctx: WorkerContext) -> str:
    phase = ctx.r.hget(ctx.keys.state, "phase")
    return phase.decode() if phase else "running"


def run(ctx: WorkerContext) -> None:
    cfg = ctx.cfg
    problems, _bad = load_prompts(env_from_config(cfg), cfg.job.train_prompts, ctx.log)
    if not problems:
        raise SystemExit(f"feeder: no usable prompt in {cfg.job.train_prompts}")
    group = cfg.rollout.group_size
    limit = admission_limit(cfg)
    outage = Outage(ctx.log, stop=ctx.stopping)
    outage.call(ensure_groups, ctx.r, ctx.keys)
    outage.call(check_prompts, ctx, problems)
    outage.call(ctx.publish_state, "running")
    while not ctx.stopping():
        try:
            if job_phase(ctx) != "running":
                break
            c = counters(ctx)
            if counted_in_flight(c) + group > limit or step_reads_spent(cfg, c) or learner_behind(ctx):
                ctx.state = "waiting"
                time.sleep(0.1)
                continue
            outage.ok()
        except UNAVAILABLE as exc:
            outage.wait(exc)
            continue
        ctx.state = "running"
        issue_one(ctx, problems, group, outage)


def task_at(problems: list[Task], seed: int, cursor: int) -> Task:
    """The task the feeder issues at ``cursor``, under its prompt id (``<id>@<epoch>``).

    A fresh, seeded order per epoch: reproducible from the manifest's seed.
    ``libra-ctl bench rollout`` reads the same tasks for its direct path.
    """
    epoch, idx = divmod(cursor, len(problems))
    p = problems[epoch_order(seed, epoch, len(problems))[idx]]
    return Task(f"{p.prompt_id}@{epoch}", p.prompt, p.answer)


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The order of an epoch's ``n`` prompts, drawn once per epoch (not once per prompt issued)."""
    return random.Random(seed * 1_000_003 + epoch).sample(range(n), n)


def fingerprint(problems: list[Task]) -> str:
    """What the cursor counts: the prompt ids in file order (their number and order both matter)."""
    h = hashlib.sha256()
    for p in problems:
        h.update(p.prompt_id.encode() + b"\n")
    return f"{len(problems)}:{h.hexdigest()[:16]}"


def prompts_changed(r, keys, path: str, problems: list[Task]) -> str | None:
    """Why ``problems`` (read from ``path``) is not the prompt file the job's cursor counts in; None if it is.

    The cursor maps to (epoch, line) through the file's length and order: a
    resumed job whose file gained, lost or reordered lines would issue ids
    already issued (``<id>@<epoch>`` again) and skip others. A job that has
    issued nothing, or that recorded no file, may take any.
    """
    cursor, recorded = r.hmget(keys.feeder, ["cursor", "prompts"])
    mine = fingerprint(problems)
    if recorded is None or int(cursor or 0) == 0 or recorded.decode() == mine:
        return None
    return (f"{path} is not the prompt file this job issued {int(cursor)} prompts from (ids in order: "
            f"{recorded.decode()} then, {mine} now); put that file back to resume, or start a new run")


def check_prompts(ctx: WorkerContext, problems: list[Task]) -> None:
    """Refuse to go on over another prompt file than the one the cursor counts in; record this one."""
    why = prompts_changed(ctx.r, ctx.keys, ctx.cfg.job.train_prompts, problems)
    if why:
        raise SystemExit(f"feeder: {why}")
    ctx.r.hset(ctx.keys.feeder, "prompts", fingerprint(problems))


def issue_one(ctx: WorkerContext, problems: list[Task], group: int, outage: Outage | None = None) -> None:
    """Issue the prompt under the cursor; cursor and stream entry move together, once
    (``execute_with_backpressure`` also waits out an unreachable Redis)."""
    cursor = int((outage or Outage(ctx.log)).call(ctx.r.hget, ctx.keys.feeder, "cursor") or 0)
    epoch = cursor // len(problems)
    task = task_at(problems, ctx.cfg.job.seed, cursor)
    version = int((outage or Outage(ctx.log)).call(ctx.r.hget, ctx.keys.policy, "version") or 0)
    msg = messages.Prompt(prompt_id=task.prompt_id, prompt=task.prompt, answer=task.answer,
                          issued_at=time.time(), min_version=version)

    def build():
        pipe = ctx.r.pipeline(transaction=True)
        pipe.xadd(ctx.keys.prompts, {messages.FIELD: messages.encode(msg)})
        # group_size: the unit of "issued", which a stage's dead letter of this prompt gives back
        pipe.hset(ctx.keys.feeder, mapping={"cursor": cursor + 1, "epoch": epoch, "group_size": group})
        pipe.hincrby(ctx.keys.counters, "issued", group)
        pipe.hincrby(ctx.keys.counters, "issued_prompts", 1)
        pipe.sadd(ctx.keys.issued, msg.prompt_id)  # the record `libra-ctl audit` accounts for, id by id
        return pipe

    execute_with_backpressure(build, ctx.log, ctx.stopping)
    ctx.count(group)


def main() -> None:
    ctx = start_worker("feeder")
    try:
        run(ctx)
    finally:
        finish_worker(ctx)


if __name__ == "__main__":
    main()
