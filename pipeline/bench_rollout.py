"""``libra-ctl bench rollout``: the real rollout worker's tokens/s in the pipeline, beside the same engine and
episode loop called directly, and what a weight switch costs.

Registered on the ``bench`` subcommand by ``pipeline.cli`` (``add_parser``).
It sits at the top of the house beside ``run``, not in ``pipeline/sim``: it
starts a real rollout worker and calls the workers' code. It runs in the CLI
process, which feeds prompts, sinks rollouts, publishes weights and measures.

Three runs, one after the other, on the same ``prompts`` tasks (the feeder's
order for the job's seed, ``workers.feeder.task_at``), with the job's engine
(``workers.rollout.make_engine``: one engine thread) and episode loop
(``workers.rollout.play_groups``), the engine's process pinned to the same
CPUs (``--cpus``; the CLI process and Redis get the others):

- **direct**: a child process loads the engine and plays the tasks in calls
  of ``rollout.groups_per_call`` groups, with no Redis; tokens/s over those
  calls (the engine's load is not counted).
- **pipeline**: a real rollout worker (``python -m workers.rollout``) on an
  embedded Redis. The CLI process issues the prompts with the feeder's
  ``issue_one`` under the feeder's admission rule, and a sink reads the
  rollouts stream in the reward stage's group, decodes every group,
  acknowledges it and counts it trained (no reward stage, no learner).
  Tokens/s from the moment the worker says ``running`` (its engine loaded)
  to the sink's last acknowledgement.
- **switch**: the pipeline again; each time the sink has received one step's
  batch (``learner.batch_size`` trajectories) and more is to come, the CLI
  process publishes new weights as the learner does (``write_published``,
  then the policy announcement) while the worker generates, and the worker
  reloads them between engine calls. The reload's seconds are the worker's
  ``weight_sync`` spans.

A **step** is the time the pipeline takes to generate one batch of
``learner.batch_size`` trajectories at its measured rate (the pipeline run's);
a switch's share of a step is its reload seconds over that. Policy tokens are
the sampled ones (mask 1): environment replies are not generated.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import structlog

from pipeline import argtypes, config as config_mod
from pipeline import manifest as manifest_mod
from pipeline.dataplane import messages, streams
from pipeline.dataplane.keys import GROUP_REWARD, JobKeys
from pipeline.dataplane.lifeline import spawn
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect
from pipeline.dataplane.worker import WorkerContext
from pipeline.redaction import redact_tree
from pipeline.run import RunFailed, prepare_policy

# The workers' modules are imported where they are used: some load torch, and the CLI imports this module
# to build its parser for every command.

WORKER_ID = "rollout-bench-0"
SINK = "sink-0"
POLL_S = 0.01
TARGET_RATIO = 0.9          # the pipeline's tokens/s over the direct loop's, at least
TARGET_SWITCH_SHARE = 0.05  # a version switch's reload over one step, below


@dataclass(frozen=True)
class RolloutBenchSpec:
    """One benchmark's settings (the command line's options)."""

    config: str = "examples/quickstart.toml"
    overrides: tuple[str, ...] = ()      # key=value, as ``libra-ctl run --set``
    prompts: int = 128                   # tasks per run; each plays rollout.group_size episodes
    cpus: tuple[int, ...] = ()           # the engine's CPUs; empty: the last CPU this process may use
    rounds: int = 3                      # alternations of the direct and pipeline runs (medians)
    switch: bool = True                  # run the version-switch pass
    timeout_s: float = 900.0             # the longest one run may take, its engine's load included


@dataclass
class Sink:
    """What the sink saw of one pipeline run: trajectory ids, and per engine call its tokens and last ack.

    An engine call is told by its groups' ``generated_at`` (the call's start,
    the same for all of its groups).
    """

    groups: set = field(default_factory=set)
    trajectory_ids: set = field(default_factory=set)
    trajectories: int = 0
    entries: int = 0
    bad: int = 0
    # generated_at -> [policy tokens, trajectories, last ack (perf_counter), the worker's CPU seconds then]
    calls: dict = field(default_factory=dict)
    worker_pid: int | None = None   # set once the worker is started
    error: BaseException | None = None
    digests: dict = field(default_factory=dict)   # prompt id -> ``group_digest`` of what the worker generated

    @property
    def tokens(self) -> int:
        return sum(c[0] for c in self.calls.values())


def group_digest(samples) -> str:
    """One group's tokens as a digest: ``(sample index, completion tokens, mask)`` of each of its samples, in
    sample order. The two paths generated the same tokens for a prompt exactly when the digests agree."""
    h = hashlib.sha256()
    for idx, tokens, mask in sorted(samples, key=lambda s: s[0]):
        h.update(f"{idx}:".encode())
        h.update(np.asarray(tokens, dtype=np.int64).tobytes())
        h.update(np.asarray(mask, dtype=np.uint8).tobytes())
    return h.hexdigest()[:16]


def bench_config(spec: RolloutBenchSpec, job: str) -> config_mod.Config:
    """The job's config with the bench's own job name and no periodic evaluation (it would pause generation)."""
    return config_mod.load(spec.config, [*spec.overrides, f"job.name={job}", "job.eval_every=0"])


def job_problems(cfg: config_mod.Config) -> list:
    """The job's training tasks, as the feeder reads them."""
    from workers.envs import env_from_config
    from workers.feeder import load_prompts

    if not Path(cfg.job.train_prompts).is_file():
        raise ValueError(f"prompt file {cfg.job.train_prompts} does not exist (job.train_prompts)")
    problems, _bad = load_prompts(env_from_config(cfg), cfg.job.train_prompts)
    if not problems:
        raise ValueError(f"no usable prompt in {cfg.job.train_prompts}")
    return problems


def first_tasks(cfg: config_mod.Config, problems: list, n: int) -> list:
    """The first ``n`` tasks the feeder issues for this job (its order, its prompt ids)."""
    from workers.feeder import task_at

    return [task_at(problems, cfg.job.seed, k) for k in range(n)]


# --- direct: the engine and the episode loop, no Redis (a child process) -----------------------------------


def direct_main(cfg_dict: dict, policy_dir: str, tasks: list, cpus: tuple[int, ...], log: str, results) -> None:
    """Body of the direct run's process: output to ``log`` (as the worker's goes to its ``.out``), pin,
    load the engine, play the tasks call by call."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        results.put(("ok", _direct(config_mod.from_dict(cfg_dict), policy_dir, tasks, cpus)))
    except BaseException as exc:   # reported by the parent, which raises it
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _direct(cfg: config_mod.Config, policy_dir: str, tasks: list, cpus: tuple[int, ...]) -> dict:
    os.sched_setaffinity(0, cpus)
    from workers.envs import chat_template_setting, env_from_config
    from workers.rollout import make_engine, play_groups
    from workers.tiny_policy import load_tokenizer

    t0 = time.perf_counter()
    engine = make_engine(cfg, policy_dir)
    tokenizer = load_tokenizer(policy_dir)
    load_s = time.perf_counter() - t0
    env, chat_template = env_from_config(cfg), chat_template_setting(cfg)
    per_call = cfg.rollout.groups_per_call
    calls = []   # (seconds, policy tokens, trajectories, CPU seconds) per engine call
    samples: dict = {}   # prompt id -> its samples, for ``group_digest``
    for k in range(0, len(tasks), per_call):
        t, cpu = time.perf_counter(), process_cpu_s(os.getpid())
        episodes = play_groups(engine, tokenizer, env, chat_template, cfg, tasks[k:k + per_call])
        calls.append((time.perf_counter() - t, sum(int(sum(e.completion_mask)) for e in episodes), len(episodes),
                      process_cpu_s(os.getpid()) - cpu))
        for e in episodes:
            samples.setdefault(e.prompt_id, []).append((e.sample_idx, e.completion_tokens, e.completion_mask))
    # The first call is a warm-up, left out as in the pipeline run.
    seconds, measured = sum(c[0] for c in calls[1:]), calls[1:]
    tokens, trajectories = sum(c[1] for c in measured), sum(c[2] for c in measured)
    cpu_s = sum(c[3] for c in measured)
    return {"tokens": tokens, "trajectories": trajectories, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "cpu_s": round(cpu_s, 2),
            "tokens_per_cpu_s": round(tokens / cpu_s, 1) if cpu_s else None, "all_tokens": sum(c[1] for c in calls),
            "warmup_s": round(calls[0][0], 3), "load_s": round(load_s, 1),
            "call_s": [round(c[0], 3) for c in calls], "affinity": sorted(os.sched_getaffinity(0)),
            "group_digests": {pid: group_digest(ss) for pid, ss in samples.items()}}


def run_direct(cfg: config_mod.Config, policy_dir: str, tasks: list, cpus: tuple[int, ...], timeout_s: float,
               log: Path) -> dict:
    """The direct run in a child process; its result, or RuntimeError with the end of its ``log``."""
    ctx = mp.get_context("spawn")   # a fresh interpreter: vLLM must not inherit a forked CLI process
    results = ctx.Queue()
    proc = ctx.Process(target=direct_main, args=(cfg.to_dict(), policy_dir, tasks, cpus, str(log), results),
                       name="bench-rollout-direct", daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status, out = results.get(timeout=1.0)
                break
            except queue.Empty:
                if not proc.is_alive():
                    raise _failed(f"the direct run's process exited ({proc.exitcode}) without a result", log) from None
                if time.monotonic() > deadline:
                    raise _failed(f"the direct run took over {timeout_s:g} s", log) from None
        if status != "ok":
            raise _failed(f"the direct run failed: {out}", log)
        return out
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)


# --- pipeline: feeder -> rollout worker -> sink (the worker in its own process) ------------------------------


def start_job(r, cfg: config_mod.Config, run_dir: Path, url: str, policy_dir: str) -> JobKeys:
    """A fresh job on ``r`` as ``libra-ctl run`` starts one: manifest, stream groups, version 0 announced."""
    from workers.checkpoint import announcement

    keys = JobKeys(cfg.job.name)
    run_dir.mkdir(parents=True)
    manifest_mod.write_manifest(run_dir, cfg, argv=sys.argv, redis_url=url, embedded=True, policy_dir=policy_dir,
                                bad_prompt_lines=[])
    streams.ensure_groups(r, keys)
    r.hset(keys.policy, mapping=announcement(0, Path(policy_dir), 0))
    return keys


def feed(ctx: WorkerContext, problems: list, n: int, stop: threading.Event) -> None:
    """Issue ``n`` prompts with the feeder's own ``issue_one``, under its admission rule.

    The job is fresh, so the feeder's cursor starts at 0 and the k-th prompt
    is ``first_tasks(...)[k]``, the direct run's k-th task.
    """
    from workers.feeder import admission_limit, in_flight, issue_one

    group, limit = ctx.cfg.rollout.group_size, admission_limit(ctx.cfg)
    for _ in range(n):
        while in_flight(ctx) + group > limit:
            if stop.wait(POLL_S):
                return
        issue_one(ctx, problems, group)


def sink(r, keys: JobKeys, cfg: config_mod.Config, out: Sink, want_groups: int, stop: threading.Event,
         on_trajectories=lambda n: None) -> None:
    """Read the rollouts stream as the reward stage's group; decode, acknowledge and count every group trained.

    ``on_trajectories(total)`` runs after each acknowledgement (the switch run
    publishes weights from it).
    """
    max_bytes, count = cfg.streams.max_message_bytes, cfg.rollout.groups_per_call
    try:
        while not stop.is_set() and len(out.groups) < want_groups:
            entries = streams.read(r, keys.rollouts, GROUP_REWARD, SINK, count, block_ms=100)
            if not entries:
                continue
            good, bad = streams.decode_entries(entries, max_bytes)
            trained, seen = 0, []
            for _id, group in good:
                if not isinstance(group, messages.Group):
                    out.bad += 1
                    continue
                out.trajectory_ids.update((group.prompt_id, t.sample_idx) for t in group.trajectories)
                out.digests[group.prompt_id] = group_digest((t.sample_idx, t.completion, t.mask)
                                                            for t in group.trajectories)
                seen.append(group)
                trained += len(group.trajectories)
            pipe = r.pipeline(transaction=True)
            pipe.xack(keys.rollouts, GROUP_REWARD, *[i for i, _p in entries])
            pipe.hincrby(keys.counters, "trained", trained)   # what the feeder's admission counts as done
            pipe.execute()
            acked = time.perf_counter()
            for group in seen:
                call = out.calls.setdefault(group.generated_at, [0, 0, 0.0, 0.0])
                call[0] += sum(int(t.mask.sum()) for t in group.trajectories)
                call[1] += len(group.trajectories)
                call[2] = acked
                call[3] = process_cpu_s(out.worker_pid) if out.worker_pid else 0.0
            out.entries += len(entries)
            out.bad += len(bad)
            out.trajectories += trained
            on_trajectories(out.trajectories)
            # last: the driver ends the run once every group is here, so the bookkeeping above (the worker's
            # CPU time, read while it runs) is done by then
            out.groups.update(group.prompt_id for group in seen)
    except BaseException as exc:   # reported by the driver, which stops the run
        out.error = exc


class Publisher:
    """Publishes a new version after every ``batch_size`` trajectories the sink receives, as the learner does.

    The weights are the policy's with seeded noise added per version (a real
    change, so the worker loads new numbers); written by ``write_published``
    and announced in the job's policy hash, then old versions are pruned.
    """

    def __init__(self, r, keys: JobKeys, cfg: config_mod.Config, policy_dir: str, pub_dir: Path, total: int):
        import torch

        from workers.tiny_policy import load_model

        self.r, self.keys, self.cfg, self.pub_dir = r, keys, cfg, pub_dir
        self.source = Path(policy_dir)
        self.model = load_model(policy_dir)
        self.total = total
        self.version = 0
        self.publish_s: list[float] = []
        self._torch = torch

    def __call__(self, received: int) -> None:
        batch = self.cfg.learner.batch_size
        # A step's batch received, and more to generate: the learner would train it and publish.
        while received >= (self.version + 1) * batch and received < self.total:
            self.publish()

    def publish(self) -> None:
        from workers.checkpoint import announcement, prune_published, write_published

        torch = self._torch
        self.version += 1
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(self.version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-4)
        final = write_published(self.pub_dir, self.version, self.model, self.source)
        self.r.hset(self.keys.policy, mapping=announcement(self.version, final, self.version))
        prune_published(self.pub_dir, self.cfg.learner.keep_published)
        self.publish_s.append(time.perf_counter() - t0)


def run_pipeline(url: str, cfg: config_mod.Config, run_dir: Path, policy_dir: str, problems: list, tasks: list,
                 cpus: tuple[int, ...], timeout_s: float, switch: bool, say) -> dict:
    """One pipeline run of ``tasks`` through a real rollout worker; its rate, its sink's counts, its spans."""
    r = connect(url)
    keys = start_job(r, cfg, run_dir, url, policy_dir)
    ctx = WorkerContext(cfg=cfg, run_dir=run_dir, keys=keys, r=r, worker_id="feeder-bench", role="feeder",
                        log=structlog.get_logger("bench-rollout"))
    stop, out = threading.Event(), Sink()
    publisher = (Publisher(r, keys, cfg, policy_dir, run_dir / "published", len(tasks) * cfg.rollout.group_size)
                 if switch else None)
    threads = [threading.Thread(target=feed, args=(ctx, problems, len(tasks), stop), name="bench-feeder", daemon=True),
               threading.Thread(target=sink, args=(r, keys, cfg, out, len(tasks), stop),
                                kwargs={"on_trajectories": publisher or (lambda n: None)},
                                name="bench-sink", daemon=True)]
    for t in threads:
        t.start()
    proc, worker_log = start_worker(url, run_dir, cpus)
    out.worker_pid = proc.pid
    try:
        t_start = time.perf_counter()
        t0 = wait_running(r, keys, proc, worker_log, t_start + timeout_s)
        say(f"{'switch' if switch else 'pipeline'}: engine loaded in {t0 - t_start:.1f} s; generating")
        wait_done(out, len(tasks), proc, worker_log, t_start + timeout_s, say, switch,
                  dead=lambda: r.xlen(keys.dead_letters))
    finally:
        stop.set()
        stop_worker(proc)
        for t in threads:
            t.join(timeout=10)
    if out.error:   # after the last group: the figures would miss what it failed on
        raise _sink_failed(out)
    dead = r.xlen(keys.dead_letters)   # groups, as the figures beside it (the counter counts trajectories)
    return pipeline_figures(out, read_spans(run_dir / "logs" / f"{WORKER_ID}.jsonl"), t0, t0 - t_start, len(tasks),
                            dead, publisher)


def pipeline_figures(out: Sink, spans: dict, t0: float, load_s: float, issued: int, dead_lettered: int,
                     publisher: Publisher | None) -> dict:
    """A pipeline run's figures from its sink's records and its worker's spans (``t0``: the worker running)."""
    calls = [out.calls[k] for k in sorted(out.calls)]
    if len(calls) < 2:
        raise RuntimeError(f"bench rollout: {len(calls)} engine call(s) reached the sink ({dead_lettered} of "
                           f"{issued} groups dead-lettered, see the worker's log): nothing to measure past the "
                           "warm-up call")
    # The first call is a warm-up (both runs leave it out): measured from its last ack to the run's last.
    seconds, cpu_s = calls[-1][2] - calls[0][2], calls[-1][3] - calls[0][3]
    tokens, trajectories = sum(c[0] for c in calls[1:]), sum(c[1] for c in calls[1:])
    rollouts, reloads = spans.get("rollout", []), spans.get("weight_sync", [])
    engine_s = sum(d for _t, d in rollouts[1:])
    reload_s = [d for _t, d in reloads]
    res = {"tokens": tokens, "trajectories": trajectories, "seconds": round(seconds, 3),
           "tokens_per_s": round(tokens / seconds, 1), "trajectories_per_s": round(trajectories / seconds, 2),
           "cpu_s": round(cpu_s, 2), "tokens_per_cpu_s": round(tokens / cpu_s, 1) if cpu_s else None,
           "all_tokens": out.tokens, "warmup_s": round(calls[0][2] - t0, 3), "load_s": round(load_s, 1),
           "call_s": [round(d, 3) for _t, d in rollouts],
           "engine_s": round(engine_s, 3), "reload_s": [round(x, 4) for x in reload_s],
           "other_s": round(seconds - engine_s - sum(reload_s), 3),
           "exactly_once": {"issued_groups": issued, "received_groups": len(out.groups),
                            "entries": out.entries, "distinct_trajectories": len(out.trajectory_ids),
                            "duplicate_trajectories": out.trajectories - len(out.trajectory_ids), "bad": out.bad,
                            "dead_lettered": dead_lettered},
           "group_digests": dict(out.digests)}
    if publisher:
        res["versions"] = publisher.version
        res["publish_s"] = [round(x, 4) for x in publisher.publish_s]
        res.update(calls_after_reload(rollouts, reloads))
    return res


def start_worker(url: str, run_dir: Path, cpus: tuple[int, ...]) -> tuple[subprocess.Popen, Path]:
    """``python -m workers.rollout`` as the agents start it, pinned to ``cpus`` before it imports vLLM."""
    out = run_dir / "logs" / f"{WORKER_ID}.out"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{ENV_URL: url, "PYTHONUNBUFFERED": "1"})   # the URL never goes on argv
    with open(out, "wb") as fh:
        proc = spawn([sys.executable, "-m", "workers.rollout", "--run-dir", str(run_dir), "--worker-id", WORKER_ID],
                     env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    os.sched_setaffinity(proc.pid, cpus)   # its threads, started later, inherit the mask
    return proc, out


def stop_worker(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _worker_failed(proc: subprocess.Popen, worker_log: Path, what: str) -> RuntimeError:
    return _failed(f"the rollout worker {what} (exit code {proc.poll()})", worker_log)


def _failed(what: str, log: Path) -> RuntimeError:
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    return RuntimeError(f"bench rollout: {what}; the end of {log}:\n{tail}")


def wait_running(r, keys: JobKeys, proc: subprocess.Popen, worker_log: Path, deadline: float) -> float:
    """The moment the worker's record says ``running``: its engine is loaded and its stage loop starts."""
    while True:
        raw = r.hget(keys.workers, WORKER_ID)
        if raw and json.loads(raw).get("state") == "running":
            return time.perf_counter()
        if proc.poll() is not None:
            raise _worker_failed(proc, worker_log, "exited before it was running")
        if time.perf_counter() > deadline:
            raise _worker_failed(proc, worker_log, "was not running in time")
        time.sleep(POLL_S)


def _sink_failed(out: Sink) -> RuntimeError:
    return RuntimeError(f"bench rollout: the sink failed: {type(out.error).__name__}: {out.error}")


def wait_done(out: Sink, want: int, proc: subprocess.Popen, worker_log: Path, deadline: float, say,
              switch: bool, dead=lambda: 0) -> None:
    """Until every group is at the sink or dead-lettered (``dead()``: how many are; an environment's error
    dead-letters its group, which never comes); progress about every 10 s."""
    next_say = time.perf_counter() + 10
    while len(out.groups) + dead() < want:
        if out.error:
            raise _sink_failed(out)
        if proc.poll() is not None:
            raise _worker_failed(proc, worker_log, "exited while generating")
        now = time.perf_counter()
        if now > deadline:
            raise _worker_failed(proc, worker_log, f"had sent {len(out.groups)} of {want} groups in time")
        if now > next_say:
            say(f"{'switch' if switch else 'pipeline'}: {len(out.groups)}/{want} groups at the sink")
            next_say = now + 10
        time.sleep(POLL_S)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (``/proc/PID/stat``, in clock ticks)."""
    after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")


def read_spans(path: Path) -> dict[str, list[tuple[float, float]]]:
    """phase -> (start, seconds) of each ``span`` line of a worker's log (``pipeline.observe.trace.span``)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    if not path.exists():
        return spans
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == "span" and "dur_s" in rec:
            spans.setdefault(rec.get("phase", ""), []).append((float(rec["start"]), float(rec["dur_s"])))
    return spans


def calls_after_reload(calls: list[tuple[float, float]], reloads: list[tuple[float, float]]) -> dict:
    """Engine calls (warm-up left out) right after a reload against the others: what a reload costs the
    calls that follow it (a prefix cache to rebuild), beyond its own seconds."""
    after, other = [], []
    for prev, (start, dur) in zip(calls, calls[1:]):
        (after if any(prev[0] < t < start for t, _d in reloads) else other).append(dur)
    mean = statistics.fmean
    return {"after_reload_call_s": round(mean(after), 3) if after else None,
            "other_call_s": round(mean(other), 3) if other else None}


# --- the three runs and the figures ------------------------------------------------------------------------


def engine_cpus(spec: RolloutBenchSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the engine's CPUs, the rest for the CLI process and Redis) within this process's own mask."""
    mine = sorted(os.sched_getaffinity(0))
    cpus = tuple(spec.cpus) or (mine[-1],)
    bad = [c for c in cpus if c not in mine]
    if bad:
        raise ValueError(f"--cpus {','.join(map(str, bad))}: not among this process's CPUs {mine}")
    return cpus, tuple(c for c in mine if c not in cpus)


@contextmanager
def pinned(cpus: tuple[int, ...]):
    """This process (and what it starts: Redis) on ``cpus`` for the while; all its CPUs again after."""
    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_bench(spec: RolloutBenchSpec, say=lambda line: None) -> dict:
    """``rounds`` alternations of the direct and pipeline runs, then (unless ``spec.switch`` is off) the
    switch run; the JSON shape of ``--json``."""
    base = f"bench-rollout-{os.getpid()}"
    cfg = bench_config(spec, base)
    check_spec(spec, cfg)
    cpus, rest = engine_cpus(spec)
    problems = job_problems(cfg)
    say(f"engine on CPU {','.join(map(str, cpus))}; Redis, feeder and sink on {','.join(map(str, rest)) or 'it too'}")
    try:
        policy_dir = prepare_policy(cfg, sys.stderr)
    except RunFailed as exc:   # the policy the config names is not there, or does not fit: bad input (exit 2)
        raise ValueError(str(exc)) from None
    tasks = first_tasks(cfg, problems, spec.prompts)
    rounds, switch = [], None
    with (pinned(rest), tempfile.TemporaryDirectory(prefix="libra-bench-rollout-") as tmp,
          EmbeddedRedis(Path(tmp) / "redis") as server):
        for k in range(spec.rounds):
            tag = f"round {k + 1}/{spec.rounds}"
            say(f"{tag} direct: loading the engine (~20 s), then {len(tasks)} prompts x {cfg.rollout.group_size} "
                "samples")
            direct = run_direct(cfg, policy_dir, tasks, cpus, spec.timeout_s, Path(tmp) / f"direct-{k}.out")
            say(f"{tag} direct: {_rate_line(direct)}")
            say(f"{tag} pipeline: starting a rollout worker (~20 s to load its engine)")
            pipe = run_pipeline(server.url, bench_config(spec, f"{base}-pipe-{k}"), Path(tmp) / f"pipeline-{k}",
                                policy_dir, problems, tasks, cpus, spec.timeout_s, switch=False, say=say)
            say(f"{tag} pipeline: {_rate_line(pipe)}; ratio {pipe['tokens_per_s'] / direct['tokens_per_s']:.3f}")
            rounds.append({"direct": direct, "pipeline": pipe})
        if spec.switch:
            say("switch: the pipeline again, publishing new weights after every step's batch")
            switch = run_pipeline(server.url, bench_config(spec, f"{base}-switch"), Path(tmp) / "switch",
                                  policy_dir, problems, tasks, cpus, spec.timeout_s, switch=True, say=say)
            say(f"switch: {switch['versions']} versions published; reloads "
                + ", ".join(f"{x:.3f}" for x in switch["reload_s"]) + " s")
    return summarise(spec, cfg, cpus, rounds, switch)


def check_spec(spec: RolloutBenchSpec, cfg: config_mod.Config) -> None:
    """ValueError naming the flag or setting that makes the comparison unfair or the run impossible."""
    from workers.feeder import admission_limit

    per_call, group = cfg.rollout.groups_per_call, cfg.rollout.group_size
    if spec.prompts < 2 * per_call or spec.rounds < 1:
        raise ValueError(f"--prompts must be at least 2 x rollout.groups_per_call = {2 * per_call} (the first "
                         "engine call is a warm-up, left out of both runs) and --rounds at least 1")
    if not 0 < spec.timeout_s < float("inf"):   # nan fails this too, and would turn the hang guard off
        raise ValueError(f"--timeout {spec.timeout_s}: give a finite number of seconds > 0")
    limit, call = admission_limit(cfg), per_call * group
    if limit < 2 * call:
        raise ValueError(
            f"the feeder admits {limit} trajectories in flight (streams.max_queue_size, and (learner.max_staleness"
            f" + 1) x learner.batch_size), under two engine calls of rollout.groups_per_call x group_size = {call}:"
            " the worker's calls would hold fewer groups than the direct run's, and the two would not compare; "
            f"raise those settings to admit at least {2 * call}, or lower rollout.groups_per_call")


def _rate_line(run: dict) -> str:
    return (f"{run['tokens']:,} tokens in {run['seconds']:.2f} s = {run['tokens_per_s']:,.0f} tokens/s "
            f"(after a warm-up call of {run['warmup_s']:.2f} s)")


def summarise(spec: RolloutBenchSpec, cfg: config_mod.Config, cpus: tuple[int, ...], rounds: list[dict],
              switch: dict | None) -> dict:
    """Medians over the rounds; the ratio is the median of each round's pipeline/direct."""
    for rd in rounds:
        d, pl = rd["direct"], rd["pipeline"]
        rd["ratio"] = round(pl["tokens_per_s"] / d["tokens_per_s"], 3)
        rd["cpu_ratio"] = (round(pl["tokens_per_cpu_s"] / d["tokens_per_cpu_s"], 3)
                           if pl["tokens_per_cpu_s"] and d["tokens_per_cpu_s"] else None)
        rd["overhead_share"] = round(pl["other_s"] / pl["seconds"], 4)
        rd["same_tokens"] = same_tokens(d, pl)
    med = statistics.median
    pipe_traj_s = med(rd["pipeline"]["trajectories_per_s"] for rd in rounds)
    batch = cfg.learner.batch_size
    step_s = batch / pipe_traj_s
    ratio = med(rd["ratio"] for rd in rounds)
    res = {
        "direct_tokens_per_s": round(med(rd["direct"]["tokens_per_s"] for rd in rounds), 1),
        "pipeline_tokens_per_s": round(med(rd["pipeline"]["tokens_per_s"] for rd in rounds), 1),
        "ratio": round(ratio, 3),
        # Less disturbed by other work on a shared machine than the wall-clock ratio: tokens per CPU second
        # of the engine's process (the worker's includes its Redis client, decoding and encoding).
        "cpu_ratio": _median_or_none([rd["cpu_ratio"] for rd in rounds]),
        # The pipeline's wall time outside its engine calls: reads, decoding, encoding, writes, waits.
        "overhead_share": round(med(rd["overhead_share"] for rd in rounds), 4),
        "same_tokens": all(rd["same_tokens"] for rd in rounds),
        "step": {"batch_size": batch, "seconds": round(step_s, 3),
                 "definition": "the pipeline's time to generate one batch of learner.batch_size trajectories "
                               "at its measured rate (the median round's)"},
        "rounds": [{side: _no_digests(run) for side, run in rd.items()} for rd in rounds],
        "exactly_once": _exactly_once([rd["pipeline"] for rd in rounds] + ([switch] if switch else [])),
        "targets": {"ratio_at_least": TARGET_RATIO, "switch_share_below": TARGET_SWITCH_SHARE},
        "engine": {"groups_per_call": cfg.rollout.groups_per_call, "group_size": cfg.rollout.group_size,
                   "max_turns": cfg.rollout.max_turns, "max_tokens_per_turn": cfg.rollout.max_tokens_per_turn,
                   "dtype": cfg.rollout.dtype, "threads": 1, "cpus": list(cpus)},
        # a --set may carry a URL with a password
        "spec": redact_tree(asdict(spec)), "load_avg": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }
    met = ratio >= TARGET_RATIO
    if switch is not None:
        reloads = switch["reload_s"]
        mean = statistics.fmean(reloads) if reloads else 0.0
        share = mean / step_s
        res["switch"] = {**_no_digests(switch), "reloads": len(reloads), "reload_s_mean": round(mean, 4),
                         "reload_s_max": round(max(reloads, default=0.0), 4),
                         "publish_s_mean": round(statistics.fmean(switch["publish_s"] or [0.0]), 4),
                         "share_of_step": round(share, 4)}
        met = met and bool(reloads) and share < TARGET_SWITCH_SHARE
    res["targets"]["met"] = met
    return res


def same_tokens(direct: dict, pipeline: dict) -> bool:
    """Whether the pipeline generated, for every group it delivered, exactly the direct run's tokens (a
    dead-lettered group is compared on neither side)."""
    got, want = pipeline.get("group_digests") or {}, direct.get("group_digests") or {}
    return bool(got) and all(want.get(pid) == d for pid, d in got.items())


def _no_digests(run: dict) -> dict:
    """A run's figures without its per-group digests (hundreds of lines in the JSON, compared already)."""
    return {k: v for k, v in run.items() if k != "group_digests"} if isinstance(run, dict) else run


def _median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def _exactly_once(runs: list[dict]) -> dict:
    """The sink's counts over every pipeline run: each issued group received, no trajectory twice."""
    eo = [r["exactly_once"] for r in runs]
    issued = sum(e["issued_groups"] for e in eo)
    received = sum(e["received_groups"] for e in eo)
    dupes = sum(e["duplicate_trajectories"] for e in eo)
    dead = sum(e["dead_lettered"] for e in eo)   # accounted for: the environment's error, in its dead letter
    return {"issued_groups": issued, "received_groups": received,
            "distinct_trajectories": sum(e["distinct_trajectories"] for e in eo), "duplicate_trajectories": dupes,
            "dead_lettered": dead, "ok": received + dead == issued and dupes == 0}


# --- command line ------------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    """Register ``rollout`` on the ``bench`` subcommand's subparsers (called by pipeline.cli)."""
    d = RolloutBenchSpec()
    p = subparsers.add_parser(
        "rollout", help="a real rollout worker's tokens/s in the pipeline vs the same engine called directly",
        description="Generate the same prompts with the same engine on the same CPUs twice: through a real "
                    "rollout worker (feeder -> worker -> a sink that acknowledges, on an embedded Redis) and "
                    "by calling the engine and episode loop directly; then once more while new weights are "
                    "published after every step. Reports tokens/s, their ratio and a reload's share of a step.")
    p.add_argument("config", nargs="?", default=d.config, help=f"job config (default {d.config})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, as for libra-ctl run (repeatable)")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per run (each a group of samples)")
    p.add_argument("--cpus", help="the engine's CPUs, e.g. 1 or 2,3 (default: the last CPU)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="alternations of the direct and pipeline runs")
    p.add_argument("--no-switch", action="store_true", help="skip the version-switch run")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds one run may take, load included")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON to OUT")
    p.set_defaults(func=cmd_bench_rollout)


def cmd_bench_rollout(args) -> int:
    def say(line: str) -> None:
        print(f"bench rollout: {line}", file=sys.stderr, flush=True)

    try:
        cpus = tuple(int(c) for c in args.cpus.split(",")) if args.cpus else ()
    except ValueError:
        say(f"--cpus {args.cpus!r}: give CPU numbers separated by commas, e.g. 1 or 2,3")
        return 2
    spec = RolloutBenchSpec(config=args.config, overrides=tuple(args.overrides), prompts=args.prompts, cpus=cpus,
                            rounds=args.rounds, switch=not args.no_switch, timeout_s=args.timeout)
    bad_out = argtypes.unwritable("--json", args.json)
    if bad_out:
        say(bad_out)
        return 2
    try:
        result = run_bench(spec, say)
    except (ValueError, config_mod.ConfigError) as exc:
        say(str(exc))
        return 2
    except RuntimeError as exc:   # a run that failed: what failed, and the end of its process's output
        say(str(exc).removeprefix("bench rollout: "))
        return 1
    print(format_result(result))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        except OSError as exc:   # the figures are printed above all the same
            say(f"--json {args.json}: not written: {exc.strerror or exc}")
            return 1
    return 0 if result["exactly_once"]["ok"] else 1


def format_result(res: dict) -> str:
    lines = [f"{'run':<14}{'tokens':>9}{'seconds':>9}{'tokens/s':>10}{'traj':>6}{'engine s':>10}{'other s':>9}"
             f"{'CPU s':>8}{'tokens/CPU s':>14}"]
    for k, rd in enumerate(res["rounds"], 1):
        for name in ("direct", "pipeline"):
            r = rd[name]
            engine, other = (r["engine_s"], r["other_s"]) if name == "pipeline" else (r["seconds"], 0.0)
            lines.append(f"{f'{k} {name}':<14}{r['tokens']:>9,}{r['seconds']:>9.2f}{r['tokens_per_s']:>10,.0f}"
                         f"{r['trajectories']:>6}{engine:>10.2f}{other:>9.2f}{r['cpu_s']:>8.2f}"
                         f"{r['tokens_per_cpu_s'] or 0:>14,.0f}")
    lines.append(f"ratio pipeline/direct {res['ratio']:.3f} (median of {len(res['rounds'])} rounds: "
                 + ", ".join(f"{rd['ratio']:.3f}" for rd in res["rounds"])
                 + f"; target >= {res['targets']['ratio_at_least']}); per CPU second {_x(res['cpu_ratio'])}; "
                 f"outside the engine {res['overhead_share']:.1%} of the pipeline's time")
    lines.append(f"the same tokens generated on both paths: {res['same_tokens']}")
    step = res["step"]
    lines.append(f"step: {step['batch_size']} trajectories at the pipeline's rate = {step['seconds']:.2f} s")
    s = res.get("switch")
    if s:
        lines.append(f"switch: {s['versions']} versions published, {s['reloads']} reloads of "
                     f"{s['reload_s_mean']:.3f} s mean ({s['reload_s_max']:.3f} max) = {s['share_of_step']:.2%} "
                     f"of a step (target < {res['targets']['switch_share_below']:.0%}); publication "
                     f"{s['publish_s_mean']:.3f} s (the learner's side)")
        lines.append(f"        engine call after a reload {_s(s['after_reload_call_s'])}, other calls "
                     f"{_s(s['other_call_s'])}; the switch run {s['tokens_per_s']:,.0f} tokens/s")
    eo = res["exactly_once"]
    lines.append(f"sink: {eo['received_groups']}/{eo['issued_groups']} groups, {eo['distinct_trajectories']} "
                 f"distinct trajectories, {eo['duplicate_trajectories']} twice; load average "
                 f"{res['load_avg'][0]:.2f} on {res['cpu_count']} CPUs; targets met: {res['targets']['met']}")
    return "\n".join(lines)


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"
