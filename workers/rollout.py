"""Rollout worker: prompts stream -> vLLM multi-turn episodes in the job's environment -> rollouts stream.

One process per engine (``python -m workers.rollout``), started by
``libra-ctl run``. Between engine calls, never inside one (so never inside a
group), it loads the newest published weights in place and resets the prefix
cache, answers held-out evaluation requests, and pauses while the downstream
backlog is at ``streams.max_queue_size``. Every group is stamped with the
single policy version that generated all of its samples.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, TypeVar

import msgpack
import numpy as np
import redis

from pipeline.config import Config
from pipeline.dataplane import messages
from pipeline.dataplane.keys import GROUP_ROLLOUT
from pipeline.observe.trace import span
from pipeline.dataplane.redisconn import Outage
from pipeline.dataplane.streams import Reject, ensure_groups, run_stage, transact
from pipeline.dataplane.worker import (CostMeter, WorkerContext, claim_policy, dedup_for, finish_worker,
                                       record_alive, room_downstream, start_worker)
from workers.envs import chat_template_setting, env_from_config
from workers.envs.base import Task
from workers.episode import evaluate, run_episodes, unjudged
from workers.oom import oom_reported
from workers.reward import judge_function
from workers.tiny_policy import load_tokenizer


def published_policy(ctx: WorkerContext) -> tuple[int, str]:
    """(version, weights dir) of the newest published policy."""
    info = ctx.r.hgetall(ctx.keys.policy)
    if not info:
        raise SystemExit("rollout: no policy published for this job (libra-ctl run publishes version 0)")
    return int(info[b"version"]), info[b"path"].decode()


T = TypeVar("T")


def load_newest(ctx: WorkerContext, load: Callable[[str], T]) -> tuple[int, str, T]:
    """(version, dir, ``load(dir)``) of the newest published weights.

    The learner keeps ``learner.keep_published`` versions and prunes older
    ones; a load that takes longer than that many publications (an engine
    starting while a backlog is trained at one version a step) can find its
    directory gone. Then it loads the newer weights announced since; an
    error with the directory still there, or with nothing newer, is raised.
    """
    while True:
        version, path = published_policy(ctx)
        try:
            return version, path, load(path)
        except Exception:
            if Path(path).exists() or published_policy(ctx)[0] == version:
                raise
            ctx.log.warning("weights_pruned_while_loading", version=version, path=path)


class Rollout:
    """The rollout stage of one worker: its engine, its policy version, its evaluation cursor."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.cfg = ctx.cfg.rollout
        # What the controller plans from: engine time, weight loads (the first included), waits for
        # input and for room downstream.
        self.meter = CostMeter(ctx.r, ctx.keys, ctx.worker_id, "rollout")
        t0 = time.monotonic()
        # the tokenizer first: a load that fails on pruned files leaves no engine behind
        version, path, (self.tokenizer, self.engine) = load_newest(
            ctx, lambda p: (load_tokenizer(p), make_engine(ctx.cfg, p)))
        ctx.set_version(version)
        self.meter.add(pause_s=time.monotonic() - t0)
        ctx.log.info("engine_loaded", path=path, load_s=round(time.monotonic() - t0, 1))
        self.env = env_from_config(ctx.cfg)
        self.judge = judge_function(ctx.cfg, self.env)   # the training reward, where it is a function
        self.chat_template = chat_template_setting(ctx.cfg)
        self.eval_cursor = "0"
        self.evaluated_bucket = -1
        self.eval_tasks = [t for t in self.env.read_prompts(ctx.cfg.job.eval_prompts)
                           if isinstance(t, Task)][: ctx.cfg.job.eval_size]

    # --- between engine calls -------------------------------------------------------------

    def between(self) -> bool:
        """Reload, evaluate, then say whether there is room downstream to generate more."""
        self.meter.got_input()          # a read that came back empty was all waiting
        self.maybe_reload()
        self.serve_eval_requests()
        self.maybe_periodic_eval()
        t0 = time.monotonic()
        if not room_downstream(self.ctx, self.cfg.group_size, pause_s=0.1):
            self.meter.add(blocked_s=time.monotonic() - t0)
            return False
        self.meter.reading()
        return True

    def maybe_reload(self, min_version: int = 0) -> None:
        version, _path = published_policy(self.ctx)
        if version <= self.ctx.policy_version:
            return
        t0 = time.monotonic()
        with span(self.ctx.log, "weight_sync", version=version):
            version, _path, _ = load_newest(self.ctx, self.engine.reload)
        took = time.monotonic() - t0
        self.meter.add(pause_s=took, reload_s=took, reloads=1)
        self.ctx.set_version(version)
        self.ctx.log.info("weights_reloaded", version=version, reload_s=round(took, 2))

    def catch_up(self, version: int) -> None:
        """Load weights at least as new as ``version`` before generating (the prompts' ``min_version``).

        The feeder stamps each prompt with the version published when it was
        issued, so the weights are on disk already; a read that blocked from
        before the publication would otherwise generate with the old ones.
        """
        if self.ctx.policy_version >= version:
            return
        # Called while handling a batch, outside the stage loop's outage handling: a Redis blip here is
        # waited out (up to redis.outage_s) rather than killing the worker and its engine.
        Outage(self.ctx.log, stop=self.ctx.stopping).call(self.maybe_reload)
        if self.ctx.policy_version < version:   # published versions only grow: should not happen
            self.ctx.log.warning("behind_prompt_version", version=self.ctx.policy_version, wanted=version)

    def serve_eval_requests(self) -> None:
        reply = self.ctx.r.xread({self.ctx.keys.eval_requests: self.eval_cursor}, count=10)
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                min_version = int(fields.get(b"min_version", 0))
                if self.ctx.policy_version < min_version:
                    self.maybe_reload()
                    if self.ctx.policy_version < min_version:
                        return   # not published yet: come back to this request next round
                if not self.run_eval(fields.get(b"tag", b"").decode(), claim=entry_id.decode()):
                    return   # another live worker runs it: look again next round, in case it dies first
                self.eval_cursor = entry_id.decode()

    def maybe_periodic_eval(self) -> None:
        """One held-out evaluation per ``job.eval_every`` learner steps, across the workers: by the steps the
        weights held have trained (a restore numbers its versions past the steps), the last step left to the
        run's final evaluation."""
        every = self.ctx.cfg.job.eval_every
        if not every:
            return
        version, step = self.ctx.r.hmget(self.ctx.keys.policy, ["version", "step"])
        if version is None or step is None or int(version) != self.ctx.policy_version:
            return   # newer weights are published: evaluate those once loaded
        bucket = int(step) // every
        if bucket <= self.evaluated_bucket:
            return
        # a bucket another live worker holds is looked at again next round (run_eval False)
        if not 0 < int(step) < self.ctx.cfg.job.steps or self.run_eval("periodic", claim=f"p{bucket}"):
            self.evaluated_bucket = bucket

    def run_eval(self, tag: str, claim: str) -> bool:
        """Greedy success on the held-out prompts, once per claim across all rollout workers; False while
        another live worker holds the claim (the caller looks again later).

        A claim whose result is written is never run again (``eval_served``);
        one held by our id is ours again (we died evaluating and were
        restarted under the same id), and one held by a worker that is gone
        (drained, scaled away, its heartbeat stale) is taken over, so a
        request is never left unanswered.
        """
        r, keys = self.ctx.r, self.ctx.keys
        if r.sismember(keys.eval_served, claim):
            return True
        if not r.set(keys.eval_claim(claim), self.ctx.worker_id, nx=True, ex=3600):
            got = self._take_claim(claim)
            if got != "ours":
                return got == "served"
        t0 = time.monotonic()
        with span(self.ctx.log, "eval", tag=tag):
            rate, episodes = evaluate(self.engine, self.tokenizer, self.eval_tasks, env=self.env,
                                      chat_template=self.chat_template, max_turns=self.cfg.max_turns,
                                      max_tokens_per_turn=self.cfg.max_tokens_per_turn,
                                      tool_timeout_s=self.cfg.tool_timeout_s,
                                      reward_timeout_s=self.ctx.cfg.reward.timeout_s, reward=self.judge,
                                      tool_retries=self.cfg.tool_retries)
        left_out = unjudged(episodes)
        samples = [{"prompt_id": e.prompt_id, "completion": list(map(int, e.completion_tokens)),
                    "text": e.text} for e in episodes[:16]]
        record = {
            "tag": tag, "version": self.ctx.policy_version, "success_rate": rate,
            "n": len(episodes) - left_out, "unjudged": left_out, "worker": self.ctx.worker_id, "at": time.time(),
            "samples": msgpack.packb(samples)}
        self.write(lambda pipe: (pipe.xadd(keys.eval_results, record), pipe.sadd(keys.eval_served, claim)))
        self.ctx.log.info("evaluated", tag=tag, success_rate=round(rate, 4), n=len(episodes) - left_out,
                          unjudged=left_out, eval_s=round(time.monotonic() - t0, 2))
        return True

    def _take_claim(self, claim: str) -> str:
        """"ours" when the claim is ours now: held by our id, or by a worker whose record says it is gone
        (taken over in a transaction, so that of two workers seeing the same dead holder one wins); "served"
        when its result is written (the holder may finish just before it exits); else "held"."""
        r, keys = self.ctx.r, self.ctx.keys
        key = keys.eval_claim(claim)
        with r.pipeline() as pipe:
            try:
                pipe.watch(key, keys.eval_served)
                if pipe.sismember(keys.eval_served, claim):
                    return "served"
                holder = pipe.get(key)
                if holder is not None and holder.decode() == self.ctx.worker_id:
                    return "ours"
                if holder is not None:
                    raw = pipe.hget(keys.workers, holder)
                    if raw is not None and record_alive(json.loads(raw), time.time()):
                        return "held"
                pipe.multi()
                pipe.set(key, self.ctx.worker_id, ex=3600)
                pipe.execute()
            except redis.WatchError:
                return "held"   # another worker took it first, or the holder just served it: looked at again
        self.ctx.log.warning("eval_claim_taken_over", claim=claim, holder=holder.decode() if holder else None)
        return "ours"

    def write(self, queue) -> None:
        """A transaction of small writes, waiting while Redis is full (backpressure, never a crash)."""
        transact(self.ctx.r, queue, self.ctx.log, self.ctx.stopping)

    # --- the stage --------------------------------------------------------------------------

    def generate(self, msgs: list) -> list[messages.Group | Reject]:
        """One output per input, in order: a group per prompt (``play``), a Reject for anything else.

        A well-formed message of another kind (a group written to the wrong
        stream) is dead-lettered with the reason, as the reward stage and the
        learner do, not read as a prompt: that would kill the worker on every
        delivery of its batch.
        """
        self.meter.got_input()
        prompts = [p for p in msgs if isinstance(p, messages.Prompt)]
        groups = iter(self.play(prompts) if prompts else ())
        return [next(groups) if isinstance(p, messages.Prompt) else Reject("rollout stage expects a prompt")
                for p in msgs]

    def play(self, prompts: list[messages.Prompt]) -> list[messages.Group | Reject]:
        """Run group_size episodes per prompt in one batched multi-turn loop (a Reject for a failed tool)."""
        self.catch_up(max((p.min_version for p in prompts), default=0))
        g = self.cfg.group_size
        tasks = [Task(p.prompt_id, p.prompt, p.answer) for p in prompts]
        version, t0, started = self.ctx.policy_version, time.monotonic(), time.time()
        with span(self.ctx.log, "rollout", groups=len(prompts), version=version):
            episodes = play_groups(self.engine, self.tokenizer, self.env, self.chat_template, self.ctx.cfg, tasks)
        gen_s = time.monotonic() - t0
        gen_tokens = sum(int(sum(e.completion_mask)) for e in episodes)
        self.meter.add(busy_s=gen_s, items=len(episodes),
                       tokens=sum(len(e.prompt_tokens) + len(e.completion_tokens) for e in episodes))
        # Counted when generated, not when written: a duplicate's tokens were spent all the same.
        self.write(lambda pipe: pipe.hincrby(self.ctx.keys.counters, "rollout_tokens", gen_tokens))
        self.ctx.count(len(episodes))
        self.ctx.log.info("generated", groups=len(prompts), trajectories=len(episodes),
                          tokens=gen_tokens, gen_s=round(gen_s, 2),
                          tokens_per_s=round(gen_tokens / max(gen_s, 1e-6), 1))
        out: list = []
        for k, p in enumerate(prompts):
            eps = episodes[k * g:(k + 1) * g]
            failed = next((e for e in eps if e.error), None)
            if failed is not None:   # a tool that failed on every try: the group is dead-lettered, never trained
                out.append(Reject(f"tool error on sample {failed.sample_idx}: {failed.error}"))
                continue
            out.append(messages.Group(
                prompt_id=p.prompt_id, prompt=p.prompt, answer=p.answer,
                prompt_tokens=np.asarray(eps[0].prompt_tokens, dtype=np.int32), version=version,
                worker=self.ctx.worker_id, generated_at=started, gen_s=gen_s,
                trajectories=tuple(_trajectory(e) for e in eps),
                extra={"gen_tokens": sum(int(sum(e.completion_mask)) for e in eps)}))
        return out


def make_engine(cfg: Config, path: str):
    """The job's engine on the weights in ``path``, as every rollout worker runs it.

    Called by ``Rollout`` in the worker process, and by ``libra-ctl bench
    rollout`` for its direct path (the same engine with no Redis around it).
    """
    from workers.engine_vllm import VLLMEngine  # heavy import: only in a process that generates

    rc = cfg.rollout
    return VLLMEngine(path, gpu_memory_utilization=rc.gpu_memory_utilization, seed=cfg.job.seed,
                      max_model_len=rc.max_model_len, dtype=rc.dtype, kv_cache_memory_bytes=rc.kv_cache_bytes,
                      enforce_eager=rc.enforce_eager, tensor_parallel_size=rc.tensor_parallel_size,
                      temperature=rc.temperature)


def play_groups(engine, tokenizer, env, chat_template: bool | None, cfg: Config, tasks: list[Task]) -> list:
    """``rollout.group_size`` sampled episodes per task, all in one batched multi-turn loop, task by task.

    The rollout worker's generation (``Rollout.generate``), and the direct
    path of ``libra-ctl bench rollout``.
    """
    rc = cfg.rollout
    items = [(task, i) for task in tasks for i in range(rc.group_size)]
    return run_episodes(engine, tokenizer, items, greedy=False, env=env, chat_template=chat_template,
                        max_turns=rc.max_turns, max_tokens_per_turn=rc.max_tokens_per_turn,
                        tool_timeout_s=rc.tool_timeout_s, tool_retries=rc.tool_retries,
                        on_tool_timeout=rc.on_tool_timeout, seed=cfg.job.seed)


def _trajectory(e) -> messages.Trajectory:
    return messages.Trajectory(
        sample_idx=e.sample_idx, completion=np.asarray(e.completion_tokens, dtype=np.int32),
        mask=np.asarray(e.completion_mask, dtype=np.uint8),
        logprobs=np.asarray(e.logprobs, dtype=np.float32), text=e.text, finish=e.finish,
        turns=e.turns, tool_calls=e.tool_calls, tool_latency_s=tuple(e.tool_latency_s),
        tool_timeouts=e.tool_timeouts)


def main() -> None:
    ctx = start_worker("rollout")
    try:
        ensure_groups(ctx.r, ctx.keys)
        with oom_reported(ctx):   # the engine's allocation (vLLM, CUDA) included
            stage = Rollout(ctx)
            ctx.publish_state("running")
            run_stage(ctx.r, ctx.keys, source=ctx.keys.prompts, group=GROUP_ROLLOUT,
                      consumer=ctx.worker_id, sink=ctx.keys.rollouts, handle=stage.generate,
                      count=ctx.cfg.rollout.groups_per_call, block_ms=ctx.cfg.streams.block_ms,
                      max_bytes=ctx.cfg.streams.max_message_bytes,
                      claims=claim_policy(ctx.cfg, "rollout"), dedup=dedup_for(ctx.cfg, "rollout"),
                      stop=ctx.stopping, before_read=stage.between, counter="generated", log=ctx.log)
    finally:
        finish_worker(ctx)


if __name__ == "__main__":
    main()
