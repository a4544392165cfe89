"""Reward worker: rollouts stream -> the task's reward -> scored stream.

One or more processes (``python -m workers.reward``), started by a node
agent. Each episode is scored by ``[reward] model`` (a sequence-classification
model, ``workers.reward_model``), or ``[reward] entry`` (a function
``(task, transcript) -> float`` in any importable module), or, when both are
empty, by the environment's ``reward``. A reward that raises, returns
something that is not a finite number, or runs past ``reward.timeout_s``
(its thread is then abandoned: ``workers.envs.base.DeadlinePool``), is
retried ``reward.verifier_retries`` times and then the whole group is
dead-lettered with the error: an error is never recorded as a zero reward,
and a group is scored whole or not at all.
"""

from __future__ import annotations

import importlib
import time
from typing import Callable

from pipeline.dataplane import messages
from pipeline.dataplane.keys import GROUP_REWARD
from pipeline.dataplane.streams import Reject, ensure_groups, run_stage
from pipeline.dataplane.worker import CostMeter, WorkerContext, claim_policy, dedup_for, finish_worker, start_worker
from pipeline.observe.trace import span
from workers.envs import env_from_config
from workers.envs.base import CallTimeout, DeadlinePool, HungCalls, RewardError, Task, check_reward
from workers.oom import is_oom, oom_reported

RewardFn = Callable[[Task, str], float]
REWARD_TIMEOUT_S = 30.0   # score_group's default deadline per call (config: reward.timeout_s)
RETRY_PAUSE_MAX_S = 1.0   # the longest pause between two tries of a failing reward (tool retries wait as long)
# Reward calls run one at a time per process; one thread, replaced when a call hangs past its deadline.
_POOL = DeadlinePool(1, "reward")


def reward_function(cfg) -> RewardFn:
    """``[reward] model``, else ``[reward] entry`` imported, else the environment's ``reward``.

    SystemExit names a bad entry.
    """
    if cfg.reward.model:
        from workers.reward_model import RewardModel   # loads transformers: only when asked for

        return RewardModel(cfg.reward.model)
    return judge_function(cfg, env_from_config(cfg))


def judge_function(cfg, env) -> RewardFn:
    """What held-out evaluations score with: ``[reward] entry`` imported, else ``env``'s ``reward``.

    A reward model is not loaded beside the rollout engine (its score is no success rate):
    under ``[reward] model`` evaluations use the environment's reward, and an environment
    without one leaves every evaluated episode unjudged. SystemExit names a bad entry.
    """
    if not cfg.reward.entry:
        return env.reward
    module_name, _, attr = cfg.reward.entry.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"reward.entry = {cfg.reward.entry!r}: {exc}") from None
    except Exception as exc:   # the module itself is broken: a syntax error, or it raised while importing
        raise SystemExit(f"reward.entry = {cfg.reward.entry!r}: importing {module_name!r} raised "
                         f"{type(exc).__name__}: {exc}") from None
    if not callable(fn):
        raise SystemExit(f"reward.entry = {cfg.reward.entry!r} is not a function")
    return fn


def score_group(group: messages.Group, retries: int, reward: RewardFn,
                timeout_s: float = REWARD_TIMEOUT_S) -> messages.Group | Reject:
    """Rewards for every sample of the group, or a Reject naming the error (a timeout is one)."""
    task = Task(group.prompt_id, group.prompt, group.answer)
    rewards = []
    for traj in group.trajectories:
        for attempt in range(retries + 1):
            try:
                rewards.append(check_reward(_POOL.call(reward, task, traj.text, timeout_s=timeout_s)))
                break
            except HungCalls:
                raise   # not the reward's verdict on this sample: the worker exits and its agent restarts it
            except CallTimeout as exc:
                if attempt == retries:
                    return Reject(f"reward timeout after {retries + 1} attempts on sample "
                                  f"{traj.sample_idx}: {type(exc).__name__}: {exc}")
            # The reward is user code: whatever it raises is its failure to judge, never a zero; a SystemExit
            # too (a verifier wrapping a command line's main()). It is retried, then the group goes to the
            # dead-letter stream with the error.
            except (Exception, SystemExit) as exc:  # noqa: BLE001
                # the worker's memory, not the sample: reported as oom (workers.oom), not dead-lettered; a
                # RewardError is the sample's whatever it says, and so is an error that may quote the text
                if not isinstance(exc, RewardError) and is_oom(exc, quoted=task.prompt + traj.text):
                    raise
                if attempt == retries:
                    return Reject(f"reward error after {retries + 1} attempts on sample "
                                  f"{traj.sample_idx}: {type(exc).__name__}: {exc}")
                time.sleep(min(0.05 * 2 ** attempt, RETRY_PAUSE_MAX_S))
    return group.with_rewards(rewards, scored_at=time.time())


def handle(ctx: WorkerContext, reward: RewardFn, groups: list[messages.Group], meter: CostMeter | None = None) -> list:
    if meter is not None:
        meter.got_input()
    t0 = time.monotonic()
    with span(ctx.log, "reward", groups=len(groups)):
        out = _score_all(ctx, reward, groups)
    if meter is not None:
        meter.add(busy_s=time.monotonic() - t0, items=sum(len(g.trajectories) for g in out
                                                           if isinstance(g, messages.Group)))
    return out


def before_read(meter: CostMeter) -> bool:
    meter.got_input()      # a read that came back empty was all waiting
    meter.reading()
    return True


def _score_all(ctx: WorkerContext, reward: RewardFn, groups: list[messages.Group]) -> list:
    out = []
    for g in groups:
        if not isinstance(g, messages.Group) or any(t.reward is not None for t in g.trajectories):
            out.append(Reject("reward stage expects an unscored group"))
            continue
        out.append(score_group(g, ctx.cfg.reward.verifier_retries, reward, ctx.cfg.reward.timeout_s))
    ctx.count(sum(len(g.trajectories) for g in out if isinstance(g, messages.Group)))
    return out


def main() -> None:
    ctx = start_worker("reward")
    try:
        with oom_reported(ctx):   # loading a reward model included
            reward = reward_function(ctx.cfg)
        meter = CostMeter(ctx.r, ctx.keys, ctx.worker_id, "reward")
        ensure_groups(ctx.r, ctx.keys)
        ctx.publish_state("running")
        with oom_reported(ctx):
            run_stage(ctx.r, ctx.keys, source=ctx.keys.rollouts, group=GROUP_REWARD,
                      consumer=ctx.worker_id, sink=ctx.keys.scored,
                      handle=lambda groups: handle(ctx, reward, groups, meter), count=16,
                      before_read=lambda: before_read(meter),
                      block_ms=ctx.cfg.streams.block_ms, max_bytes=ctx.cfg.streams.max_message_bytes,
                      claims=claim_policy(ctx.cfg, "reward"), dedup=dedup_for(ctx.cfg, "reward"),
                      stop=ctx.stopping, counter="scored", log=ctx.log)
    finally:
        finish_worker(ctx)


if __name__ == "__main__":
    main()
