"""Reward worker: rollouts stream -> the task's verifier -> scored stream.

One or more processes (``python -m workers.reward``), started by ``libra-ctl
run``. A verifier that raises is retried ``reward.verifier_retries`` times and
then the whole group is dead-lettered with the error: an error is never
recorded as a zero reward, and a group is scored whole or not at all.
"""

from __future__ import annotations

import time

from pipeline.dataplane import messages
from pipeline.dataplane.keys import GROUP_REWARD
from pipeline.observe.trace import span
from pipeline.dataplane.streams import Reject, ensure_groups, run_stage
from pipeline.dataplane.worker import claim_policy, dedup_for, WorkerContext, finish_worker, start_worker
from workers.envs.calc import Problem, VerifierError, verify


def score_group(group: messages.Group, retries: int, verifier=verify) -> messages.Group | Reject:
    """Rewards for every sample of the group, or a Reject naming the verifier error."""
    problem = Problem(group.prompt_id, group.prompt, group.answer)
    rewards = []
    for traj in group.trajectories:
        for attempt in range(retries + 1):
            try:
                rewards.append(float(verifier(problem, traj.text)))
                break
            except VerifierError as exc:
                if attempt == retries:
                    return Reject(f"verifier error after {retries + 1} attempts on sample "
                                  f"{traj.sample_idx}: {exc}")
                time.sleep(0.05 * 2 ** attempt)
    return group.with_rewards(rewards, scored_at=time.time())


def handle(ctx: WorkerContext, groups: list[messages.Group]) -> list:
    with span(ctx.log, "reward", groups=len(groups)):
        return _score_all(ctx, groups)


def _score_all(ctx: WorkerContext, groups: list[messages.Group]) -> list:
    out = []
    for g in groups:
        if not isinstance(g, messages.Group) or any(t.reward is not None for t in g.trajectories):
            out.append(Reject("reward stage expects an unscored group"))
            continue
        out.append(score_group(g, ctx.cfg.reward.verifier_retries))
    ctx.count(sum(len(g.trajectories) for g in out if isinstance(g, messages.Group)))
    return out


def main() -> None:
    ctx = start_worker("reward")
    try:
        ensure_groups(ctx.r, ctx.keys)
        ctx.publish_state("running")
        run_stage(ctx.r, ctx.keys, source=ctx.keys.rollouts, group=GROUP_REWARD,
                  consumer=ctx.worker_id, sink=ctx.keys.scored,
                  handle=lambda groups: handle(ctx, groups), count=16,
                  block_ms=ctx.cfg.streams.block_ms, max_bytes=ctx.cfg.streams.max_message_bytes,
                  claims=claim_policy(ctx.cfg, "reward"), dedup=dedup_for(ctx.cfg, "reward"), stop=ctx.stopping, counter="scored", log=ctx.log)
    finally:
        finish_worker(ctx)


if __name__ == "__main__":
    main()
