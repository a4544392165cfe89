"""``libra-ctl run CONFIG``: everything one job needs, started from one command.

Creates the run directory and manifest, builds (or reuses) the initial
policy, starts Redis when no URL is given, publishes policy version 0, starts
the feeder and the stage workers as child processes, shows a live progress
line, evaluates the policy on held-out prompts at the start and the end, and
writes ``summary.json``. Beside the run, the metrics sampler records samples
and a tracker follows ``metrics.jsonl`` into TensorBoard and W&B
(``observe.tracking``). Ctrl-C stops the children, then Redis, in order.

A SIGKILL of this process (which cannot stop anything in order) leaves
nothing behind: every child dies with it within a second or two
(``dataplane.lifeline``), the stage workers too (they watch this process,
which names itself in ``$LIBRA_OWNER``), and the embedded Redis keeps its
AOF; ``libra-ctl resume`` takes the run up from there. Inside the run, a
controller or agent that dies is restarted (``control.local``), and the
supervision loop waits out an unreachable Redis up to ``redis.outage_s``.

The stage workers come from the controller and the node agents on the job's
Redis: a controller holding the lease and live agents already there (a
Procfile's, a cluster's) are joined; only a missing one is started here, as
a child process (``control.local``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import redis

from pipeline import manifest as manifest_mod
from pipeline.logs import STDERR, open_output, output_tail
from pipeline.config import Config
from pipeline.control.allocation import live_agents
from pipeline.control.allocator import AdmissionError
from pipeline.control.job import check_admission
from pipeline.control.local import own_slots, start_local_control
from pipeline.dataplane.keys import AGENTS, CONTROLLER_LEASE, GROUP_REWARD, JOBS, JobKeys, agent_backoff
from pipeline.observe.audit import last_checkpoint_state
from pipeline.observe.measures import success_text, write_json
from pipeline.observe.metrics import start_sampler
from pipeline.observe.report import write_report
from pipeline.observe.tracking import start_tracker
from pipeline.dataplane.lifeline import own_runs, raise_interrupt, spawn
from pipeline.dataplane.redisconn import (ENV_OUTAGE, ENV_URL, UNAVAILABLE, EmbeddedRedis, Outage, RedisUnavailable,
                                         connect, raise_if_refused, refusal, resolve_url, stopped_server_dir)
from pipeline.dataplane.jobs import JobRunning, live_owner, release_claim, reset_job
from pipeline.dataplane.streams import ensure_groups, group_pending, stream_lag
from pipeline.redaction import is_redacted, redact, write_private

STOP_GRACE_S = 20.0
CHILD_RESTARTS = 20       # restarts of the feeder before the run gives up on it
CRASH_LOOP = 5            # exits in a row with an error code (none after a stable run) that fail the run
DEAD_END_BATCHES = 2      # batches' worth of trajectories dead-lettered, and none scored meanwhile, that fail the run
DEAD_END_S = 30.0         # ... when it stays so this long (a slow verifier scores its first group within it)
JOINED_GONE_S = 30.0      # a joined controller or agents gone this long (no lease, no heartbeat): the run fails
RATE_WINDOW_S = 30.0
EVAL_TIMEOUT_S = 300.0


@dataclass
class Child:
    worker_id: str
    role: str
    proc: subprocess.Popen
    module: str = ""
    restarts: int = 0


class RunFailed(RuntimeError):
    pass


HEAD_DIM = 32   # the tiny policy's attention head size


def policy_spec(cfg: Config) -> dict:
    """The tiny policy's spec: heads of 32 dimensions (every attention backend runs them, vLLM's CPU one
    included, which refuses 16), half as many key/value heads."""
    p = cfg.policy
    heads = p.hidden_size // HEAD_DIM
    return {"seed": p.seed, "hidden_size": p.hidden_size, "num_layers": p.num_layers,
            "num_heads": heads, "num_kv_heads": max(1, heads // 2)}


def prepare_policy(cfg: Config, out=STDERR) -> str:
    """The directory of version 0: ``policy.path``, checked, else the tiny policy, built and cached."""
    if cfg.policy.path:
        path = check_policy_dir(Path(cfg.policy.path))
    else:
        from workers.tiny_policy import ensure_policy

        def progress(msg: str) -> None:
            print(f"  policy: {msg}", file=out, flush=True)

        path = str(Path(ensure_policy(Path(cfg.policy.cache_dir), policy_spec(cfg), progress=progress)).resolve())
    check_policy_fits(cfg, Path(path))
    return path


def check_policy_fits(cfg: Config, path: Path) -> None:
    """RunFailed for settings the policy cannot serve, said before any worker starts (each rollout worker's
    engine would refuse them one by one, after its start)."""
    try:
        positions = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text()) \
            if (path / "tokenizer_config.json").exists() else {}
    except (ValueError, OSError) as exc:
        raise RunFailed(f"policy {path}: config.json or tokenizer_config.json cannot be read: {exc}") from None
    if isinstance(positions, int) and cfg.rollout.max_model_len > positions:
        raise RunFailed(f"rollout.max_model_len = {cfg.rollout.max_model_len} is more than the policy's "
                        f"max_position_embeddings ({positions}): lower it to {positions} or less")
    templated = bool(tok_cfg.get("chat_template")) or any(
        (path / f).exists() for f in ("chat_template.jinja", "chat_template.json"))
    if cfg.env.chat_template == "on" and not templated:
        raise RunFailed(f'env.chat_template = "on" but the policy\'s tokenizer ({path}) has no chat template: '
                        'use "auto" or "off", or a policy with one')


def check_policy_dir(path: Path) -> str:
    """A Hugging Face model directory that transformers and vLLM can load, or RunFailed saying what is missing."""
    if not path.is_dir():
        raise RunFailed(f"policy.path = {str(path)!r}: no such directory")
    missing = [f for f in ("config.json",) if not (path / f).exists()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("weights (*.safetensors)")
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        missing.append("tokenizer (tokenizer.json or tokenizer_config.json)")
    for index in sorted(path.glob("*.index.json")):   # sharded weights: every shard it names (a copy cut short)
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (ValueError, AttributeError, OSError) as exc:
            raise RunFailed(f"policy.path = {str(path)!r}: {index.name} cannot be read: {exc}") from None
        missing += [f"{shard} (named by {index.name})" for shard in sorted(shards) if not (path / shard).exists()]
    if missing:
        raise RunFailed(f"policy.path = {str(path)!r} is not a Hugging Face model directory: missing "
                        f"{', '.join(missing)} (save one with save_pretrained for the model and the tokenizer)")
    return str(path.resolve())


def check_prompt_files(cfg: Config, out=STDERR) -> list[dict]:
    """Report bad lines of the prompt files (they are skipped) and fail on an unusable file."""
    from workers.envs import EnvError, env_from_config
    from workers.feeder import load_prompts
    from workers.reward import judge_function

    try:
        env = env_from_config(cfg)
    except EnvError as exc:
        raise RunFailed(str(exc)) from None
    try:   # a bad [reward] is said now, not by reward workers failing at each restart minutes from now
        judge_function(cfg, env)
        if cfg.reward.model:
            from workers.reward_model import check_dir

            check_dir(cfg.reward.model)
    except (SystemExit, ValueError) as exc:
        raise RunFailed(str(exc)) from None
    bad_all = []
    for path in (cfg.job.train_prompts, cfg.job.eval_prompts):
        if not Path(path).exists():
            raise RunFailed(f"prompt file {path} does not exist (job.train_prompts / job.eval_prompts)")
        good, bad = load_prompts(env, path)
        for b in bad:
            print(f"warning: {path}:{b.lineno}: {b.reason}; line skipped", file=out)
            bad_all.append({"file": path, "line": b.lineno, "reason": b.reason})
        if not good:
            raise RunFailed(f"{path} has no usable prompt")
    return bad_all


class Orchestrator:
    def __init__(self, cfg: Config, run_dir: Path, r: redis.Redis, url: str, out=STDERR,
                 join_wait_s: float = 0.0, join: bool = True):
        self.cfg, self.run_dir, self.r, self.url, self.out = cfg, run_dir, r, url, out
        self.join_wait_s, self.join = join_wait_s, join
        self.keys = JobKeys(cfg.job.name)
        # trained when this process started: a resumed learner restores the newest checkpoint's count
        self.trained_before = int(last_checkpoint_state(run_dir).get("trained_total", 0))
        self.children: list[Child] = []
        self.control = None
        self.joined: tuple[bool, bool] = (False, False)   # (a controller, agents) this run found and did not start
        self.joined_gone_at: float | None = None
        self.crash_base: dict[str, int] | None = None   # failures in a row per worker when this run first looked
        self.rate_samples: collections.deque = collections.deque()
        self.t0 = time.monotonic()
        self.started_at = time.time()   # wall clock of t0: summary.json puts learner steps and evals on it
        self.resumed_at: float | None = None   # a resumed run's own start (started_at is then the first one's)
        self.resumes: list[float] = []         # the start of every resume, oldest first
        self.tty = out.isatty()
        self.outage = Outage(_Say(out))
        self.tracker = None                    # TensorBoard and W&B, closed with the settled summary (_stop)
        self.written: dict | None = None       # this run's summary.json, once written
        self.dead_end_since: float | None = None   # since when every group has been dead-lettered (check_dead_end)

    # --- processes ---------------------------------------------------------------------------

    def spawn(self, role: str, module: str, worker_id: str) -> None:
        self.children.append(Child(worker_id, role, self._popen(module, worker_id), module))

    def _popen(self, module: str, worker_id: str) -> subprocess.Popen:
        env = dict(os.environ, **{ENV_URL: self.url, "PYTHONUNBUFFERED": "1"})   # the URL never goes on argv
        with open_output(self.run_dir / "logs" / f"{worker_id}.out") as log:
            return spawn([sys.executable, "-m", module, "--run-dir", str(self.run_dir), "--worker-id", worker_id],
                         env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_workers(self) -> None:
        """The feeder here; the stage workers through the controller and agents on this Redis, or our own."""
        self.spawn("feeder", "workers.feeder", "feeder-0")
        controller, agents = self.find_control()
        self.joined = (controller, bool(agents))
        if not (controller and agents):
            self.control = start_local_control(self.cfg, self.run_dir, self.url, controller=not controller,
                                               agent=not agents, say=self.say)
        joined = (["the controller"] if controller else []) + ([f"agents {', '.join(sorted(agents))}"] if agents else [])
        said = ["joined " + " and ".join(joined) + " on this Redis"] if joined else []
        if self.control:
            said.append("started " + " and ".join(name for name, _p in self.control.procs))
        print(f"{'; '.join(said)}; workers come up through the agents (logs in {self.run_dir / 'logs'})",
              file=self.out, flush=True)

    def find_control(self) -> tuple[bool, dict]:
        """Whether a controller holds the lease, and the live agents; waits up to ``join_wait_s`` for both."""
        if not self.join:
            return False, {}
        deadline = time.monotonic() + self.join_wait_s
        while True:
            controller, agents = bool(self.r.exists(CONTROLLER_LEASE)), live_agents(self.r)
            if (controller and agents) or time.monotonic() >= deadline:
                return controller, agents
            time.sleep(0.2)

    def say(self, line: str) -> None:
        print(("\n" if self.tty else "") + line, file=self.out, flush=True)

    def check_children(self) -> None:
        """Restart a dead controller, agent or feeder (the agent restarts workers); fail the run on a crash
        loop of the controller or the agent, or after ``CHILD_RESTARTS`` restarts of the feeder."""
        if self.control is not None:
            try:
                self.control.check()
            except RuntimeError as exc:
                raise RunFailed(str(exc)) from None
        self.check_joined()
        self.check_crash_loops()
        for c in self.children:
            code = c.proc.poll()
            if code == 0:
                continue  # the feeder ends by itself once training is done
            if code is not None and c.restarts >= CHILD_RESTARTS:
                tail = output_tail(self.run_dir / "logs" / f"{c.worker_id}.out")
                raise RunFailed(f"{c.worker_id} exited with code {code} ({c.restarts} restarts); last output:\n{tail}")
            if code is not None:   # the feeder's cursor and counters are in Redis: a new one goes on from there
                self.say(f"{c.worker_id} exited with code {code}; restarting it")
                c.proc, c.restarts = self._popen(c.module, c.worker_id), c.restarts + 1

    def check_crash_loops(self) -> None:
        """Fail the run on a worker whose every start fails: its agent would restart it forever (with
        back-off), and the run would wait for its steps forever. ``CRASH_LOOP`` exits in a row with an
        error code, never a stable run between them; more where the learner may exit on a poison group
        until ``learner.max_train_attempts`` dead-letters it."""
        limit = max(CRASH_LOOP, self.cfg.learner.max_train_attempts + 2)
        records = self.redis_call(crash_records, self.r, self.keys.job, self.run_dir)
        if records is None:
            return
        first = self.crash_base is None
        self.crash_base = self.crash_base or {}
        for worker, b in sorted(records.items()):
            # counted from what this run found: a resume after a crash loop (its cause fixed) starts afresh
            base = self.crash_base[worker] = min(self.crash_base.get(worker, b["failures"] if first else 0),
                                                 b["failures"])
            if b["failures"] - base >= limit:
                tail = output_tail(self.run_dir / "logs" / f"{worker}.out")
                how = (f"killed by the kernel's out-of-memory killer (exit code {b['code']}): give it more "
                       f"memory or less work" if b["oom"] else f"exit code {b['code']}")
                raise RunFailed(f"{worker} failed {b['failures'] - base} times in a row ({how}; "
                                f"its agent restarts it with back-off). Fix the cause and resume with: "
                                f"libra-ctl resume {self.run_dir}\nits last output:\n{tail}")

    def check_joined(self) -> None:
        """Fail the run once a controller or the agents it joined have been gone for ``JOINED_GONE_S``.

        Nothing else would restart them (another run's, or the cluster's), and
        without them no worker of this job starts again: the run would wait
        for its steps forever. ``libra-ctl resume`` starts its own, or joins
        those that are back.
        """
        if not any(self.joined):
            return
        gone = self.redis_call(self.joined_gone)
        if gone is None:
            return   # Redis unreachable: redis_call judges the outage, and nothing can be told meanwhile
        if not gone:
            self.joined_gone_at = None
            return
        now = time.monotonic()
        self.joined_gone_at = self.joined_gone_at or now
        if now - self.joined_gone_at >= JOINED_GONE_S:
            raise RunFailed(f"the {' and the '.join(gone)} this run joined on its Redis "
                            f"{'have' if len(gone) > 1 else 'has'} been gone for {JOINED_GONE_S:.0f} s (another "
                            f"run's, which ended?): nothing starts this job's workers. Resume with: "
                            f"libra-ctl resume {self.run_dir}")

    def joined_gone(self) -> list[str]:
        """Which of what this run joined is gone: "controller" (no lease), "agents" (none live)."""
        controller, agents = self.joined
        gone = []
        if controller and not self.r.exists(CONTROLLER_LEASE):
            gone.append("controller")
        if agents and not live_agents(self.r):
            gone.append("agents")
        return gone

    def stop_children(self) -> None:
        if self.control is not None:
            self.control.stop()  # the controller, then the agent, which drains the stage workers
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    # --- evaluation ----------------------------------------------------------------------------

    def request_eval(self, tag: str, min_version: int) -> None:
        self.r.xadd(self.keys.eval_requests, {"tag": tag, "min_version": min_version, "at": time.time()})

    def eval_result(self, tag: str) -> dict | None:
        for _id, f in self.r.xrange(self.keys.eval_results):
            if f[b"tag"].decode() == tag:
                return {"version": int(f[b"version"]), "success_rate": float(f[b"success_rate"]),
                        "n": int(f[b"n"]), "samples": msgpack.unpackb(f[b"samples"])}
        return None

    def wait_eval(self, tag: str, timeout_s: float = EVAL_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            res = self.redis_call(self.eval_result, tag)
            if res is not None:
                return res
            time.sleep(0.2)
        raise RunFailed(f"no {tag} evaluation within {timeout_s:.0f}s")

    # --- progress --------------------------------------------------------------------------------

    def stats(self) -> dict:
        raw = self.r.hgetall(self.keys.learner_stats)
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def counters(self) -> dict:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.keys.counters).items()}

    def progress_line(self) -> str:
        s, c = self.stats(), self.counters()
        now = time.monotonic()
        elapsed = now - self.t0
        # Trained trajectories/s over the last RATE_WINDOW_S (a resumed run starts with old counts).
        self.rate_samples.append((now, c.get("trained", 0)))
        while len(self.rate_samples) > 2 and now - self.rate_samples[1][0] >= RATE_WINDOW_S:
            self.rate_samples.popleft()
        (t_old, n_old), (t_new, n_new) = self.rate_samples[0], self.rate_samples[-1]
        tps = max(n_new - n_old, 0) / max(t_new - t_old, 1e-6)
        reward = f"{s['reward_mean']:.3f}" if "reward_mean" in s else "  -  "   # no step yet: no reward either
        dead = c.get("dead_lettered", 0) - c.get("dead_lettered_replayed", 0)
        return (f"step {s.get('step', 0):>4}/{self.cfg.job.steps}  "
                f"reward {reward}  success {s.get('success_rate', 0.0):5.1%}  "
                f"traj/s {tps:6.1f}  staleness {s.get('staleness_mean', 0.0):.2f}/{s.get('staleness_max', 0)}  "
                f"v{s.get('policy_version', 0)}  {elapsed:5.0f}s"
                + (f"  dead-lettered {dead} (libra-ctl dlq list)" if dead > 0 else ""))

    def show(self, line: str, final: bool = False) -> None:
        if self.tty:
            print("\r" + line.ljust(110), end="\n" if final else "", file=self.out, flush=True)
        else:
            print(line, file=self.out, flush=True)

    def wait_trained(self) -> None:
        last_plain = 0.0
        base = self.redis_call(self.counters) or {}   # a resumed run's counters hold its history
        while True:
            self.check_children()
            phase = self.redis_call(self.r.hget, self.keys.state, "phase")
            if phase == b"trained":
                self.show(self.redis_call(self.progress_line), final=True)
                return
            now = time.monotonic()
            if self.tty or now - last_plain >= 10:
                line = self.redis_call(self.progress_line)
                if line is not None:
                    self.show(line)
                last_plain = now
                self.redis_call(self.check_dead_end, base)
            time.sleep(self.cfg.run.progress_s)

    def check_dead_end(self, base: dict) -> None:
        """Fail the run when every group since it started went to the dead-letter stream, for ``DEAD_END_S`` on
        end: not one scored, and ``DEAD_END_BATCHES`` batches' worth either dead-lettered at rollout with none
        written by it, or judged by the reward stage (written by rollout, no longer waiting there) and all
        dead-lettered. An environment or a verifier that fails on everything would fill the dead-letter
        stream for as long as the run lasts, and no step would train. Good groups waiting at a slow verifier
        while others fail at rollout are not a dead end: they have not been judged."""
        c = self.counters()
        since = {k: c.get(k, 0) - base.get(k, 0) for k in ("dead_lettered", "dead_lettered_replayed", "generated",
                                                           "scored")}
        dead, bound = since["dead_lettered"] - since["dead_lettered_replayed"], DEAD_END_BATCHES * \
            self.cfg.learner.batch_size
        at_reward = (stream_lag(self.r, self.keys.rollouts, GROUP_REWARD)
                     + group_pending(self.r, self.keys.rollouts, GROUP_REWARD)) * self.cfg.rollout.group_size
        judged = since["generated"] - at_reward   # left the reward stage: scored (none) or dead-lettered
        if since["scored"] > 0 or not ((since["generated"] == 0 and dead >= bound) or judged >= bound):
            self.dead_end_since = None
            return
        self.dead_end_since = self.dead_end_since or time.monotonic()
        if time.monotonic() - self.dead_end_since < DEAD_END_S:
            return
        newest = self.r.xrevrange(self.keys.dead_letters, count=1)
        reason = newest[0][1].get(b"reason", b"?").decode(errors="replace")[:300] if newest else "?"
        raise RunFailed(f"every group since the run started was dead-lettered ({dead} trajectories, "
                        f"none scored): the environment or the verifier fails on all of them. The newest dead "
                        f"letter's reason: {reason}\nSee libra-ctl dlq list and dlq show ID; once the cause is "
                        f"fixed, libra-ctl dlq replay --all --job {self.cfg.job.name} and libra-ctl resume "
                        f"{self.run_dir}")

    def redis_call(self, fn, *args):
        """``fn(*args)``; None while Redis is unreachable (logged once), RunFailed past ``redis.outage_s``."""
        try:
            out = fn(*args)
        except UNAVAILABLE as exc:
            try:
                self.outage.wait(exc)
            except RedisUnavailable as gone:
                raise RunFailed(str(gone)) from None
            return None
        self.outage.ok()
        return out

    # --- the run ---------------------------------------------------------------------------------

    def run(self) -> dict:
        self.r.sadd(JOBS, self.cfg.job.name)
        phase, first, before = self.r.hmget(self.keys.state, ["phase", "started_at", "resumes"])
        phase = (phase or b"running").decode()
        if phase != "starting" and first:   # a resume: the run's clock (its steps, its evals) starts at its first start
            self.resumed_at, self.started_at = self.started_at, float(first)
            # every resume's time: an experiment's figures leave out the time the run lay stopped before each
            self.resumes = [*json.loads(before or b"[]"), self.resumed_at]
        self.r.hset(self.keys.state, mapping={"phase": "trained" if phase == "trained" else "running",
                                              "run_dir": str(self.run_dir.resolve()),
                                              "started_at": self.started_at, "pid": os.getpid(),
                                              "host": socket.gethostname(),
                                              **({"resumed_at": self.resumed_at,
                                                  "resumes": json.dumps(self.resumes)} if self.resumed_at else {})})
        ensure_groups(self.r, self.keys)
        resumed = self.eval_result("start") is not None
        if not resumed:
            self.request_eval("start", 0)
        self.start_workers()
        start = self.wait_eval("start")
        print(f"held-out greedy success at start: {success_text(start['success_rate'], start['n'])} "
              f"(version {start['version']}, {start['n']} prompts)", file=self.out, flush=True)
        self.wait_trained()
        final_version = int(self.r.hget(self.keys.policy, "version"))
        self.request_eval("final", final_version)
        end = self.wait_eval("final")
        return self.summary(start, end)

    def summary(self, start: dict, end: dict) -> dict:
        s, c = self.stats(), self.counters()
        wall = time.monotonic() - self.t0
        evals = [{"tag": f[b"tag"].decode(), "version": int(f[b"version"]),
                  "success_rate": float(f[b"success_rate"]), "n": int(f.get(b"n", 0)),
                  "at": float(f.get(b"at", 0.0))} for _i, f in self.r.xrange(self.keys.eval_results)]
        return {
            "run_id": self.run_dir.name, "job": self.cfg.job.name, "started_at": self.started_at,
            **({"resumed_at": self.resumed_at, "resumes": self.resumes} if self.resumed_at else {}),
            "success_rate_start": start["success_rate"], "success_rate_end": end["success_rate"],
            "eval_prompts": end["n"], "eval_prompts_start": start["n"], "evals": evals,
            "trajectories_trained": c.get("trained", 0), "trajectories_generated": c.get("generated", 0),
            "policy_version": end["version"], "steps": s.get("step", 0),
            "dropped_stale": c.get("dropped_stale", 0), "dead_lettered": c.get("dead_lettered", 0),
            # the rate of this process's wall: a resumed run's trajectories trained before it are not counted
            "wall_s": round(wall, 1),
            "trajectories_per_s": round(max(c.get("trained", 0) - self.trained_before, 0) / max(wall, 1e-6), 2),
            "restarts": self.control.restarts if self.control else {},
        }


class _Say:
    """The run's terminal as the log of its ``Outage``."""

    def __init__(self, out):
        self.out = out

    def warning(self, event: str, **fields) -> None:
        print(f"\n{event}: {fields}", file=self.out, flush=True)

    info = warning


def crash_records(r: redis.Redis, job: str, run_dir: Path) -> dict[str, dict]:
    """Worker -> the back-off record its agent keeps (``agent_backoff``: restarts, and ``failures``, the
    exits in a row with an error code), for this run's workers that crashed lately."""
    out = {}
    for node in r.hkeys(AGENTS):
        for key, raw in r.hgetall(agent_backoff(node.decode())).items():
            owner, _sep, worker = key.decode().partition("/")
            b = json.loads(raw)
            if owner == job and os.path.realpath(b.get("run_dir", "")) == os.path.realpath(run_dir):
                out[worker] = {"failures": b.get("failures", 0), "code": b.get("code"), "oom": b.get("oom", False)}
    return out


def format_summary(summary: dict, run_dir: Path) -> str:
    rows = [
        ("held-out success (start)", success_text(summary["success_rate_start"], summary.get("eval_prompts_start"))),
        ("held-out success (end)", success_text(summary["success_rate_end"], summary.get("eval_prompts"))),
        ("policy version", str(summary["policy_version"])),
        ("trajectories trained", str(summary["trajectories_trained"])),
        ("dropped as stale", str(summary["dropped_stale"])),
        ("dead-lettered", str(summary["dead_lettered"])),
        ("trajectories/s", f"{summary['trajectories_per_s']:.1f}"),
        ("wall time", f"{summary['wall_s']:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    body = "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
    return f"\n{body}\n\nrun directory: {run_dir}\n"


def absolute_paths(cfg: Config) -> Config:
    """``cfg`` with the files it names as absolute paths, as the manifest records them: the workers of agents
    started in another directory (a joined pool, a systemd unit's /opt/libra) read them from there."""
    def whole(path: str) -> str:
        return str(Path(path).resolve()) if path else path

    return dataclasses.replace(
        cfg,
        job=dataclasses.replace(cfg.job, train_prompts=whole(cfg.job.train_prompts),
                                eval_prompts=whole(cfg.job.eval_prompts)),
        policy=dataclasses.replace(cfg.policy, path=whole(cfg.policy.path)),
        reward=dataclasses.replace(cfg.reward, model=whole(cfg.reward.model)))


def run_job(cfg: Config, argv: list[str], out=STDERR, resume_dir: Path | None = None,
            join_wait_s: float = 0.0) -> int:
    """The whole of ``libra-ctl run`` (and ``libra-ctl resume``); returns the exit code.

    ``join_wait_s``: how long to wait for a controller and an agent starting
    beside this run on its Redis (a Procfile) before starting the missing ones.
    """
    # honcho and systemd stop us with SIGTERM: take it as Ctrl-C, so the controller, the agent,
    # the workers and the embedded Redis are stopped in order instead of being orphaned.
    signal.signal(signal.SIGTERM, raise_interrupt)
    # and Ctrl-C even when started with SIGINT ignored, as a shell starts a script's background job
    # (`libra-ctl run ... &`): Python then leaves it ignored, and the run could only be killed
    signal.signal(signal.SIGINT, signal.default_int_handler)
    own_runs()   # every process started below this one ends with it, also after a SIGKILL of ours
    os.environ[ENV_OUTAGE] = str(cfg.redis.outage_s)   # for the controller and the agent
    if not resume_dir:
        cfg = absolute_paths(cfg)
    run_dir = None
    try:
        bad_lines = check_prompt_files(cfg, out)
        if not resume_dir and _refused(cfg, out):
            return 2
        run_dir = resume_dir or manifest_mod.new_run_dir(cfg)
        print(f"run {run_dir.name}: {'resuming' if resume_dir else 'preparing the policy'}", file=out, flush=True)
        policy_dir = prepare_policy(cfg, out)
    except RunFailed as exc:   # bad input (prompt files, environment, policy directory): nothing started
        _forget_unstarted(run_dir, resume_dir)
        print(f"libra-ctl run: {exc}", file=out)
        return 2
    except RedisUnavailable as exc:   # the configured Redis refuses us (_refused): nothing started
        print(f"run failed: {exc}", file=out)
        return 1
    except KeyboardInterrupt:   # nothing started yet
        _forget_unstarted(run_dir, resume_dir)
        print("\ninterrupted before the run started", file=out)
        return 130
    orch, embedded, claimed = None, None, None
    try:
        url, embedded = _choose_redis(cfg, run_dir, resume_dir)
        url = _start_redis(embedded, url, run_dir, out)
        r = connect(url)
        if resume_dir:
            check_resumable(r, JobKeys(cfg.job.name), run_dir)
            check_prompts_unchanged(r, cfg)
        else:
            if _refused(cfg, out, r):    # again: the pool may have changed while the policy was prepared
                _forget_unstarted(run_dir, resume_dir)
                return 2
            claimed = r   # reset_job's claim of the job name: released below if no run takes it over
            _start_new_job(r, cfg, run_dir, argv=argv, redis_url=url, embedded=bool(embedded),
                           policy_dir=policy_dir, bad_prompt_lines=bad_lines)
        # Nothing else can be on an embedded server we just started: a controller lease or agent record
        # in it is a killed run's (restored from the AOF, not yet expired), never one to join.
        orch = Orchestrator(cfg, run_dir, r, url, out, join_wait_s=0.0 if embedded else join_wait_s,
                            join=not embedded)
        _run_and_summarise(orch, resumed=resume_dir is not None)
        return 0
    except RunFailed as exc:
        _forget_unstarted(run_dir, resume_dir)
        print(f"\nrun failed: {exc}" + (f"\nrun directory: {run_dir}" if run_dir.exists() else ""), file=out)
        return 1
    except UNAVAILABLE as exc:   # a redis.url that does not answer (checked once already, before the policy)
        _forget_unstarted(run_dir, resume_dir)
        print(f"\nrun failed: Redis {refusal(exc) or 'unreachable'}: {redact(str(exc))}", file=out)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted; stopping workers. resume with: libra-ctl resume {run_dir}", file=out)
        return 130
    finally:
        if orch is None and claimed is not None:   # ended before a run owned the job: its name is free again
            release_claim(claimed, JobKeys(cfg.job.name))
        _stop(orch, embedded)


def _refused(cfg: Config, out, r: redis.Redis | None = None) -> bool:
    """Whether the pool on the job's Redis cannot hold the job's minimum beside the running jobs' (said on ``out``).

    Without ``r``, the configured Redis is asked before the policy is prepared;
    when there is none (an embedded server) or it cannot be reached, that
    check is left to the one made once Redis is up.
    """
    try:
        if r is None:
            url = resolve_url(cfg.redis.url)
            if not url:
                return False
            r = connect(url)
        r.eval("return 1", 0)   # a user without scripting (the controller's lease, the stages' writes) is refused here
        check_admission(r, cfg, own_slots(cfg))
    except AdmissionError as exc:
        print(f"libra-ctl run: job {cfg.job.name!r} refused: {exc}", file=out)
        return True
    except redis.RedisError as exc:
        raise_if_refused(exc)   # this run's credentials, permissions or certificates: said before minutes of work
        return False
    return False


def _choose_redis(cfg: Config, run_dir: Path, resume_dir: Path | None) -> tuple[str | None, EmbeddedRedis | None]:
    """The Redis URL to use, or an embedded server (not yet started) when there is none."""
    url = resolve_url(cfg.redis.url)
    if resume_dir:
        recorded = json.loads((run_dir / "manifest.json").read_text())["redis"]
        if recorded["embedded"] and not cfg.redis.url:
            url = None   # the run's state is in its own server's AOF, whatever $LIBRA_REDIS_URL names now
        elif url is None:
            url = None if recorded["embedded"] else recorded["url"]
    if url and is_redacted(url):
        # the manifest keeps no password: the full URL comes from the environment
        if not os.environ.get(ENV_URL):
            raise RunFailed(f"the run's Redis {url} needs its password, which the run directory does not keep: "
                            f"set {ENV_URL} to the full URL")
        url = os.environ[ENV_URL]
    # Resuming on the embedded server restarts it from the run's AOF: streams, pending entries,
    # counters and the feeder's cursor are as they were. So too for a Procfile's server (`libra-ctl redis`,
    # stopped with the Procfile, e.g. by the Ctrl-C that printed the resume command): served again from its
    # directory for this resume.
    served = stopped_server_dir(url, run_dir.parent / "redis") if resume_dir and url else None
    if url is None or served:
        return None, EmbeddedRedis(served or run_dir / "redis", maxmemory=cfg.redis.maxmemory,
                                   appendfsync=cfg.redis.appendfsync)
    return url, None


def _forget_unstarted(run_dir: Path | None, resume_dir: Path | None) -> None:
    """Remove a new run's directory that never got its manifest: there is nothing in it to resume."""
    if run_dir is not None and resume_dir is None and not (run_dir / "manifest.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)


def _start_redis(embedded: EmbeddedRedis | None, url: str | None, run_dir: Path, out) -> str:
    """Start the embedded server if there is one; record the URL (its password redacted) in the run directory."""
    if embedded:
        try:
            embedded.start()
        except RuntimeError as exc:   # its lock is held: the run that owns it still runs
            raise RunFailed(str(exc)) from None
        url = embedded.url
        print(f"redis: embedded server at {url}", file=out, flush=True)
    write_private(run_dir / "redis.url", redact(url) + "\n")
    return url


def _start_new_job(r: redis.Redis, cfg: Config, run_dir: Path, **manifest_fields) -> None:
    """A fresh job: clear its old state, write the manifest, announce the initial policy as version 0."""
    keys = JobKeys(cfg.job.name)
    try:
        reset_job(r, keys)
    except JobRunning as exc:
        raise RunFailed(str(exc)) from None
    manifest_mod.write_manifest(run_dir, cfg, **manifest_fields)
    r.hset(keys.policy, mapping={"version": 0, "path": manifest_fields["policy_dir"], "step": 0,
                                 "published_at": time.time()})


def _run_and_summarise(orch: Orchestrator, resumed: bool) -> None:
    """Run the job with the metrics sampler and the tracker beside it, then write summary.json and the report."""
    # A resumed job's counters and steps hold its history: the sampler measures what comes after.
    sampler = start_sampler(orch.r, orch.cfg.job.name, orch.run_dir, orch.cfg.metrics.interval_s,
                            from_start=not resumed)
    orch.tracker = start_tracker(orch.cfg, orch.run_dir, orch.r, say=orch.say)
    try:
        summary = orch.run()
    finally:
        sampler.stop()
    write_json(orch.run_dir / "summary.json", summary)
    orch.written = summary
    # report.html once the workers stop, and TensorBoard and W&B closed then, with the settled summary (_stop)
    print(format_summary(summary, orch.run_dir), file=orch.out)


def _stop(orch: Orchestrator | None, embedded: EmbeddedRedis | None) -> None:
    """Stop the children first, then the embedded Redis they were using."""
    if orch is not None:
        done = None
        try:
            # Any phase but running/trained tells the controller and agent the job is over; "stopping" also
            # tells another run of the job name that this one still owns it until its workers are down.
            done = orch.r.hget(orch.keys.state, "phase") == b"trained"
            orch.r.hset(orch.keys.state, "phase", "stopping")
        except redis.RedisError:
            pass
        orch.stop_children()
        try:
            if done is None:   # the first read failed: the phase is still what the run left (trained or not)
                done = orch.r.hget(orch.keys.state, "phase") == b"trained"
            orch.r.hset(orch.keys.state, "phase", "done" if done else "stopped")
        except redis.RedisError:
            pass
        if done is not False and orch.written:   # trained, or Redis could not say: this run's summary is settled
            _settle_summary(orch)
        if orch.tracker:   # after the sampler's last sample and the settled summary: the sinks get the whole run
            orch.tracker.stop(orch.written)
    if embedded:
        embedded.stop()


def _settle_summary(orch: Orchestrator) -> None:
    """summary.json's count of trajectories generated, once the rollout workers have stopped (they finish the
    calls in hand after the last step, so the count read for the summary was short of what `audit` reports);
    then report.html, which holds the summary."""
    summary = orch.written
    try:
        generated = int(orch.r.hget(orch.keys.counters, "generated") or 0)
    except redis.RedisError:
        generated = summary.get("trajectories_generated")   # the count the summary read, then
    if summary.get("trajectories_generated") != generated:
        orch.written = summary = {**summary, "trajectories_generated": generated}
        write_json(orch.run_dir / "summary.json", summary)
    print(f"report: {write_report(orch.run_dir)}", file=orch.out)


def check_resumable(r: redis.Redis, keys: JobKeys, run_dir: Path) -> None:
    state = r.hgetall(keys.state)
    recorded = state.get(b"run_dir", b"").decode()
    if recorded and Path(recorded).resolve() != run_dir.resolve():
        raise RunFailed(f"job {keys.job!r} in this Redis belongs to run {recorded}, not {run_dir}")
    if state.get(b"phase") in (b"starting", b"running", b"stopping") and live_owner(state):
        raise RunFailed(f"job {keys.job!r} is still {state[b'phase'].decode()} (pid {state[b'pid'].decode()})")
    if not r.exists(keys.policy):
        raise RunFailed(f"nothing to resume: job {keys.job!r} has no state in this Redis "
                        f"(a Redis without persistence loses it on restart)")


def check_prompts_unchanged(r: redis.Redis, cfg: Config) -> None:
    """The feeder's own check (``workers.feeder.prompts_changed``), before anything starts."""
    from workers.envs import env_from_config
    from workers.feeder import load_prompts, prompts_changed

    path = cfg.job.train_prompts
    why = prompts_changed(r, JobKeys(cfg.job.name), path, load_prompts(env_from_config(cfg), path)[0])
    if why:
        raise RunFailed(why)


def resume_job(run_dir: Path, argv: list[str], out=STDERR) -> int:
    """Continue a stopped or crashed run from its checkpoints, with the config in its manifest."""
    from pipeline.config import from_dict, validate

    manifest = run_dir / "manifest.json"
    if not manifest.exists():
        raise RunFailed(f"{run_dir} is not a run directory (no manifest.json)")
    try:
        cfg = from_dict(json.loads(manifest.read_text())["config"])
    except (ValueError, KeyError, TypeError) as exc:   # JSONDecodeError is a ValueError
        raise RunFailed(f"{manifest} is damaged ({type(exc).__name__}: {exc}); it cannot be resumed") from None
    validate(cfg)
    if "sim" in json.loads(manifest.read_text()):   # prepare_sim_run's: its workers are simulated, its learner too
        raise RunFailed(f"{run_dir} is a sim job's run (libra-ctl sim-job); it is not resumed: start the sim job "
                        f"again with libra-ctl sim-job")
    done = finished_summary(run_dir, cfg.job.steps)
    if done is not None:
        print(f"run {run_dir.name} already finished ({done['steps']} of {cfg.job.steps} steps; its figures are in "
              f"{run_dir / 'summary.json'}): nothing to resume", file=out)
        return 0
    return run_job(cfg, argv, out, resume_dir=run_dir)


def finished_summary(run_dir: Path, steps: int) -> dict | None:
    """The run's summary.json once it trained all ``steps``, else None.

    The summary is written once the run's last step and final evaluation are
    done; an earlier one (a stopped run's) counts fewer steps. A finished run
    has nothing to resume.
    """
    try:
        done = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    try:
        return done if isinstance(done, dict) and int(done.get("steps") or 0) >= steps else None
    except (TypeError, ValueError):   # a damaged summary: not a finished run
        return None
