"""What the controller knows of a job: its Redis state, its manifest and its ``[control]`` settings.

``load_job`` reads a running job's run directory and config; ``JobInfo.spec``
turns them into the allocator's ``JobSpec``. The settings themselves are
``pipeline.config.ControlConfig``, the one definition; ``control_settings``
parses them from a manifest, and ``plan_config`` / ``role_bounds`` map them
onto the allocator's knobs. Called by the reconcile loop and the live bench.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import redis

from pipeline import config as config_mod
from pipeline.config import ControlConfig
from pipeline.control import allocator
from pipeline.control.allocation import live_agents
from pipeline.dataplane.keys import JOBS, JobKeys
from pipeline.dataplane.keys import ROLES


def control_settings(raw: dict | None) -> ControlConfig:
    """A ``[control]`` table (from a config or a manifest) over the defaults; ValueError names a bad key."""
    cfg = config_mod.from_dict(raw or {}, ControlConfig, "control.")
    config_mod.validate_control(cfg)
    return cfg


def plan_config(ctl: ControlConfig) -> allocator.PlanConfig:
    return allocator.PlanConfig(horizon_s=ctl.horizon_s, cooldown_s=ctl.cooldown_s,
                                stale_drop_budget=ctl.stale_drop_budget)


def role_bounds(ctl: ControlConfig, backend: str) -> dict[str, allocator.RoleBounds]:
    """Fewest and most slots per role for a job on ``backend`` (vllm | sim).

    Either backend's learner runs one rank per slot it holds, so its bounds
    are ``control.min_learner`` / ``max_learner`` on both.
    """
    out = {r: allocator.RoleBounds(getattr(ctl, f"min_{r}"), getattr(ctl, f"max_{r}")) for r in ROLES}
    if not ctl.reward_on_slots:
        out["reward"] = allocator.RoleBounds(0, 0)
    return out


@dataclass(frozen=True)
class JobInfo:
    """What the controller knows of a job from its Redis state and manifest."""

    name: str
    run_dir: str
    backend: str                 # vllm | sim
    batch_size: int
    group_size: int
    max_staleness: int
    initial: dict                # role -> count from the config
    control: ControlConfig
    steps: int = 0               # learner steps the job runs (0: not known)
    publish_every: int = 1       # learner steps per published version

    def spec(self) -> allocator.JobSpec:
        return allocator.JobSpec(name=self.name, batch_size=self.batch_size, max_staleness=self.max_staleness,
                                 reward_on_gpu=self.control.reward_on_slots,
                                 learner_scaling_exponent=self.control.learner_scaling_exponent,
                                 publish_every=self.publish_every,
                                 publish_every_max=self.control.publish_every_max,
                                 bounds=role_bounds(self.control, self.backend), min_slots=self.control.min_slots,
                                 max_slots=self.control.max_slots, priority=self.control.priority)


def config_spec(cfg: config_mod.Config) -> allocator.JobSpec:
    """The allocator's view of a job from its config, before it runs (admission)."""
    return JobInfo(name=cfg.job.name, run_dir="", backend="vllm", batch_size=cfg.learner.batch_size,
                   group_size=cfg.rollout.group_size, max_staleness=cfg.learner.max_staleness,
                   initial={"rollout": cfg.rollout.workers, "reward": cfg.reward.workers,
                            "learner": cfg.learner.workers},
                   control=cfg.control, publish_every=cfg.learner.publish_every).spec()


def check_admission(r: redis.Redis, cfg: config_mod.Config, own_slots: int) -> None:
    """Refuse (``allocator.AdmissionError``) a job whose minimum the pool cannot hold beside the running jobs'.

    The pool is the live agents' slots, or, with none yet, the ``own_slots``
    the run's own agent will offer. A job of the same name (a resume, a
    restart) is not counted twice.
    """
    agents = live_agents(r)
    gpus = sum(len(rec["slots"]) for rec in agents.values()) if agents else own_slots
    others = []
    for raw in r.smembers(JOBS):
        name = raw.decode()
        if name == cfg.job.name or (r.hget(JobKeys(name).state, "phase") or b"").decode() not in ("running",
                                                                                                  "trained"):
            continue
        info = load_job(r, name)
        if info is not None and info.control.mode == "auto":
            others.append(info.spec())
    allocator.admit(allocator.Inventory(gpus=gpus, switch_cost_s=cfg.control.switch_cost_s),
                    others + [config_spec(cfg)])


def load_job(r: redis.Redis, job: str) -> JobInfo | None:
    """The job's run directory and config (from its manifest); None while it has no run directory."""
    raw = r.hget(JobKeys(job).state, "run_dir")
    if not raw:
        return None
    run_dir = raw.decode()
    try:
        manifest = json.loads((Path(run_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = manifest["config"]
    backend = "sim" if manifest.get("sim") else cfg.get("rollout", {}).get("backend", "vllm")
    return JobInfo(name=job, run_dir=run_dir, backend=backend, batch_size=cfg["learner"]["batch_size"],
                   group_size=cfg["rollout"]["group_size"], max_staleness=cfg["learner"]["max_staleness"],
                   initial={"rollout": cfg["rollout"]["workers"], "reward": cfg["reward"]["workers"],
                            "learner": cfg["learner"]["workers"]},
                   control=control_settings(manifest.get("control") or cfg.get("control")),
                   steps=int(cfg.get("job", {}).get("steps", 0)),
                   publish_every=int(cfg["learner"].get("publish_every", 1)))
