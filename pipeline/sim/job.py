"""A sim job: a bench workload run on the live control plane with the sim worker backend.

``prepare_sim_run`` writes the run directory, its manifest (with the ``sim``
section the workers read) and the job's fresh Redis state; the live bench
(``pipeline.sim.bench_live``) and ``libra-ctl sim-job`` (``run_sim_job``) call
it, then the controller starts the stage workers (``pipeline.sim.worker``)
through the agents.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

import redis

from pipeline import config as config_mod, manifest as manifest_mod
from pipeline.logs import STDERR
from pipeline.control import actions
from pipeline.control.allocation import allocation_status, live_agents, pin
from pipeline.control.commands import parse_counts
from pipeline.control.job import control_settings
from pipeline.dataplane.jobs import reset_job
from pipeline.dataplane.keys import JOBS, JobKeys
from pipeline.dataplane.lifeline import raise_interrupt
from pipeline.dataplane.redisconn import connect, find_redis_url
from pipeline.dataplane.streams import ensure_groups
from pipeline.sim.workload import Workload, load_workload

SIM_PROMPTS = "examples/data/calc_train.jsonl"  # prompt ids for the feeder; the sim ignores their text


def sim_config(wl: Workload, *, job: str, max_queue_size: int | None = None,
               reward_workers: int = 1, extra: dict | None = None) -> config_mod.Config:
    """A job config matching the workload's [job] table (batch, group, staleness, steps, seed)."""
    j = wl.job
    root = Path(__file__).resolve().parents[2]
    raw = {
        "job": {"name": job, "seed": j.seed, "steps": j.steps, "eval_every": 0,
                "train_prompts": str(root / SIM_PROMPTS), "eval_prompts": str(root / SIM_PROMPTS)},
        "rollout": {"group_size": j.group_size},
        "reward": {"workers": reward_workers},
        "learner": {"batch_size": j.batch_size, "max_staleness": j.max_staleness, "publish_every": 1},
        # in flight: what the learner can train within the staleness bound (the DES admits as much)
        "streams": {"max_queue_size": max_queue_size or j.batch_size * (j.max_staleness + 1), "block_ms": 200},
    }
    for section, values in (extra or {}).items():
        raw.setdefault(section, {}).update(values)
    cfg = config_mod.from_dict(raw)
    config_mod.validate(cfg)
    return cfg


def prepare_sim_run(r: redis.Redis, workload: str | Path, runs_dir: str | Path, *, job: str = "sim",
                    time_scale: float = 50.0, redis_url: str = "", max_queue_size: int | None = None,
                    reward_workers: int = 1, control: dict | None = None, steps: int | None = None,
                    seed: int | None = None, workload_job: str | None = None) -> Path:
    """Create a run directory and the job's Redis state for a sim job; returns the run directory.

    The caller then may pin the allocation (``control.allocation.pin``) and has
    an agent start the feeder; the controller starts the stage workers.
    ``control`` is the job's control settings (``pipeline.config.ControlConfig``);
    ``steps`` cuts the run short of the workload's; ``seed`` replaces its [job] seed.
    ``workload_job`` names one [[jobs]] entry of a multi-job workload: the job runs
    that entry, and the manifest's ``sim`` section names it for the workers.
    """
    if not 0 < time_scale < math.inf:   # nan fails this too
        raise ValueError(f"time_scale {time_scale}: give a finite number > 0 (simulated seconds per wall second)")
    if control:
        control_settings(control)   # a bad key raises here, not in the controller's every tick
    wl = load_workload(workload, workload_job)
    job_over = {**({"steps": steps} if steps is not None else {}), **({"seed": seed} if seed is not None else {})}
    extra = {"run": {"runs_dir": str(runs_dir)}, **({"job": job_over} if job_over else {})}
    cfg = sim_config(wl, job=job, max_queue_size=max_queue_size, reward_workers=reward_workers, extra=extra)
    run_dir = manifest_mod.new_run_dir(cfg).resolve()
    manifest = manifest_mod.write_manifest(run_dir, cfg, argv=sys.argv, redis_url=redis_url, embedded=False,
                                           policy_dir="", bad_prompt_lines=[])
    manifest["sim"] = {"workload": str(Path(workload).resolve()), "time_scale": float(time_scale),
                       **({"job": workload_job} if workload_job else {})}
    if control:
        # the manifest's control settings win over the config's defaults (control.job.load_job)
        manifest["control"] = control
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    keys = JobKeys(job)
    reset_job(r, keys)
    r.sadd(JOBS, job)
    r.hset(keys.state, mapping={"phase": "running", "run_dir": str(run_dir), "started_at": time.time(),
                                "pid": os.getpid(), "host": socket.gethostname()})
    r.hset(keys.policy, mapping={"version": 0, "path": "", "step": 0, "published_at": time.time()})
    ensure_groups(r, keys)
    return run_dir


class SimJobEnded(RuntimeError):
    """The job's phase left ``running`` without reaching ``trained``: no more steps will come."""


def run_sim_job(url: str, workload: str | Path, *, runs_dir: str = "runs", job: str = "sim",
                time_scale: float = 50.0, steps: int | None = None, node: str | None = None,
                pinned: dict | None = None, control: dict | None = None, out=STDERR) -> Path:
    """``libra-ctl sim-job``: a sim job on the running agents and controller, from start to ``done``.

    Prepares the run, pins ``pinned`` counts (else the allocator decides), has the
    agent of ``node`` (else the first live one) start the feeder, prints
    progress until the learner has trained every step, then marks the job done
    (the controller drains its workers). Raises SimJobEnded when the job's phase
    leaves ``running`` first (stopped, or reset by another run of the same name).
    """
    r = connect(url)
    agents = live_agents(r)
    if not agents or (node and node not in agents):
        raise SystemExit(f"sim-job: no live agent{' on ' + node if node else ''}; start one with libra-ctl agent")
    node = node or sorted(agents)[0]
    run_dir = prepare_sim_run(r, workload, runs_dir, job=job, time_scale=time_scale, redis_url=url,
                              control=control, steps=steps)
    if pinned:
        pin(r, job, pinned)
    actions.ensure(r, node, {"job": job, "worker": "feeder-0", "role": "feeder", "slots": [],
                                  "run_dir": str(run_dir), "backend": "sim"})
    keys, t0 = JobKeys(job), time.monotonic()
    print(f"sim job {job}: {run_dir}", file=out, flush=True)
    try:
        while (phase := r.hget(keys.state, "phase")) != b"trained":
            if phase != b"running":   # stopped, reset or taken over by another run: it will never train
                raise SimJobEnded(f"sim-job: job {job} left the running phase before its last step "
                                  f"(phase {phase.decode() if phase else 'gone'}); see {run_dir / 'logs'}")
            time.sleep(2.0)
            trained = int(r.hget(keys.counters, "trained") or 0)
            roles = allocation_status(r, job)["roles"]
            rate = trained / ((time.monotonic() - t0) * time_scale)
            print(f"  step {int(r.hget(keys.policy, 'step') or 0):>5}  trained {trained:>7}  "
                  f"{rate:7.2f} traj/s (virtual)  " + " ".join(f"{k}={v}" for k, v in sorted(roles.items())),
                  file=out, flush=True)
    finally:   # done once trained; an interrupt or a failure leaves the job stopped (the agents stop its workers)
        phase, owner = r.hmget(keys.state, ["phase", "run_dir"])
        if owner is None or owner.decode() == str(run_dir):   # not a later run's of the same name
            r.hset(keys.state, "phase", "done" if phase == b"trained" else "stopped")
    return run_dir


def cmd_sim_job(args) -> int:
    signal.signal(signal.SIGTERM, raise_interrupt)   # a supervisor's stop ends the job as Ctrl-C does
    try:
        pinned = parse_counts(args.counts) if args.counts else None
        control = json.loads(args.control) if args.control else None
        run_dir = run_sim_job(find_redis_url(args.redis), args.workload, runs_dir=args.runs_dir, job=args.job,
                              time_scale=args.time_scale, steps=args.steps, node=args.node, pinned=pinned,
                              control=control)
    except ValueError as exc:   # a bad flag, workload or control setting: said before anything starts
        print(f"sim-job: {exc}", file=sys.stderr)
        return 2
    except SimJobEnded as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # the job is marked stopped on the way out (run_sim_job's finally)
        print(f"\nsim-job: interrupted; job {args.job!r} stopped", file=sys.stderr)
        return 130
    print(f"done: {run_dir} (libra-ctl events --job {args.job}; libra-ctl audit --job {args.job})")
    return 0


def add_commands(sub) -> None:
    j = sub.add_parser("sim-job", help="run a bench workload on the live agents with sim workers (virtual time)")
    j.add_argument("workload", help="workload TOML (docs/workloads.md format), e.g. examples/bench/steady.toml")
    j.add_argument("counts", nargs="*", metavar="ROLE=N", help="pin these counts (default: the allocator decides)")
    j.add_argument("--job", default="sim")
    j.add_argument("--time-scale", type=float, default=50.0, help="simulated seconds per wall second")
    j.add_argument("--steps", type=int, help="stop after this many learner steps (default: the workload's)")
    j.add_argument("--node", help="the agent that starts the feeder (default: the first live one)")
    j.add_argument("--control", help='the job\'s control settings as JSON, e.g. \'{"cooldown_s": 5}\'')
    j.add_argument("--runs-dir", default="runs")
    j.add_argument("--redis")
    j.set_defaults(func=cmd_sim_job)
