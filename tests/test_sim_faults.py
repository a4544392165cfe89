"""Simulated workers and sim jobs under faults: a learner restore does not move the workload's phases, and a
sim job refuses settings its workers or the controller cannot run, before anything is created.

Against the suite's Redis, with the sim workers' stages built in the test process.
"""

from __future__ import annotations

import time

import pytest
import structlog

from pipeline.dataplane import messages
from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.worker import CostMeter, WorkerContext, load_run_config
from pipeline.sim.job import prepare_sim_run
from pipeline.sim.worker import Clock, CostModel, SimLearner, SimRollout, sim_settings
from pipeline.sim.workload import load_workload

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import sim_job, write_workload
except ModuleNotFoundError:
    from test_sim_workers import sim_job, write_workload


def _ctx(r, run_dir, job, worker, role):
    return WorkerContext(cfg=load_run_config(run_dir), run_dir=run_dir, keys=JobKeys(job), r=r, worker_id=worker,
                         role=role, log=structlog.get_logger(), node="n")


def _model(run_dir, seed=1):
    sim = sim_settings(run_dir)
    return CostModel(load_workload(sim["workload"], sim.get("job")), seed=seed)


TWO_PHASES = [
    {"until_step": 3, "prompt_tokens": 100, "response_tokens": {"median": 200, "p99": 400, "max": 800}},
    {"until_step": 6, "prompt_tokens": 20000, "response_tokens": {"median": 200, "p99": 400, "max": 800}},
]


def test_a_restored_learner_does_not_move_rollout_into_the_next_phase_early(r, redis_url, tmp_path):
    """Phases follow the learner *step* the weights hold (the des engine's version is the step count). A
    learner restored after step 2 publishes step 2's weights under version 3: rollout on them is still in
    phase 1 (``until_step = 3``) and a group costs ~4 x (100 + ~200) tokens. Before, the phase was looked up
    by the version number: phase 2's 20,000-token prompts, and every learner restart (a resize under libra)
    moved the phase boundaries one step earlier."""
    run_dir = sim_job(r, redis_url, tmp_path, time_scale=1e6, job={"steps": 6}, phase=TWO_PHASES)
    keys = JobKeys("simtest")
    # two committed steps, as the learner's commit leaves them
    r.hset(keys.sim_learner, mapping={"step": 2, "version": 2})
    r.hset(keys.policy, mapping={"version": 2, "step": 2})
    lctx = _ctx(r, run_dir, "simtest", "learner-0", "learner")
    SimLearner(lctx, _model(run_dir), Clock(1e6), CostMeter(r, keys, "learner-0", "learner"), gpus=1)
    assert int(r.hget(keys.policy, "step")) == 2        # the restore: step 2's weights ...
    assert int(r.hget(keys.policy, "version")) == 3     # ... under a new version number
    rctx = _ctx(r, run_dir, "simtest", "rollout-n-0", "rollout")
    stage = SimRollout(rctx, _model(run_dir), Clock(1e6), CostMeter(r, keys, "rollout-n-0", "rollout"))
    out = stage.generate([messages.Prompt("p@0", "Q", 1, 0.0)])
    tokens = out[0].extra["sim_tokens"]
    assert tokens < 4 * 20000, f"a group on step 2's weights was charged phase 2's lengths: {tokens:.0f} tokens"


@pytest.mark.parametrize("scale", [0.0, -5.0, float("nan"), float("inf")])
def test_prepare_sim_run_refuses_a_time_scale_the_workers_cannot_run(r, redis_url, tmp_path, scale):
    """A time scale that is not a finite number > 0 is refused before a run or a running job is created.
    Before, the job was created, its workers died at start (or slept for ever), and ``libra-ctl sim-job``
    waited for a ``trained`` that never came."""
    wl = write_workload(tmp_path / "w.toml", job={"steps": 4})
    with pytest.raises(ValueError):
        prepare_sim_run(r, wl, tmp_path / "runs", job="badscale", time_scale=scale, redis_url=redis_url)
    assert r.hget(JobKeys("badscale").state, "phase") is None


def test_prepare_sim_run_does_not_treat_steps_0_as_the_whole_workload(r, redis_url, tmp_path):
    """``--steps 0`` is refused as any step count below 1 is. Before, 0 was taken for "not given" and the
    job ran every step of the workload."""
    wl = write_workload(tmp_path / "w.toml", job={"steps": 40})
    with pytest.raises(ValueError):
        run_dir = prepare_sim_run(r, wl, tmp_path / "runs", job="zero", steps=0, redis_url=redis_url)
        pytest.fail(f"steps=0 accepted: the job runs {load_run_config(run_dir).job.steps} steps")


def test_prepare_sim_run_refuses_control_settings_the_controller_cannot_read(r, redis_url, tmp_path):
    """A misspelt ``[control]`` key (``--control '{"cooldown": 5}'``) is refused before the job is created.
    Before, it went into the manifest: the controller failed to load the job on every tick, no stage worker
    started, and ``libra-ctl sim-job`` waited for ever."""
    from pipeline.control.job import control_settings

    with pytest.raises(ValueError):
        control_settings({"cooldown": 5})        # what the controller does with it
    wl = write_workload(tmp_path / "w.toml", job={"steps": 4})
    with pytest.raises(ValueError):
        prepare_sim_run(r, wl, tmp_path / "runs", job="badctl", redis_url=redis_url, control={"cooldown": 5})
    assert r.hget(JobKeys("badctl").state, "phase") is None


def _sim_job_until_its_phase_changes(r, redis_url, tmp_path, job: str, phase: dict):
    """``run_sim_job`` of ``job`` in a thread, beside an agent; once it runs, the job's state is set to ``phase``;
    returns what ended the call, within 20 s."""
    import io
    import threading

    from pipeline.control.agent import Agent, Slot
    from pipeline.sim.job import run_sim_job

    agent = Agent(r, redis_url, f"{job}-n", [Slot(0, None)], grace_s=5.0).start()
    out, got = io.StringIO(), {}

    def run():
        try:
            run_sim_job(redis_url, write_workload(tmp_path / "w.toml", job={"steps": 6}),
                        runs_dir=str(tmp_path / "runs"), job=job, time_scale=1e3, node=f"{job}-n", out=out)
        except BaseException as exc:   # noqa: BLE001 - the test reads what ended the call
            got["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 30
        while f"sim job {job}" not in out.getvalue() and t.is_alive():
            assert time.monotonic() < deadline, "sim-job did not start"
            time.sleep(0.1)
        r.hset(JobKeys(job).state, mapping=phase)
        t.join(20)
        assert not t.is_alive(), f"sim-job kept waiting after the job's state became {phase}"
        return got.get("exc")
    finally:
        agent.shutdown()


def test_sim_job_returns_when_its_job_is_stopped_before_the_last_step(r, redis_url, tmp_path):
    """``libra-ctl sim-job`` waits for the job's phase to reach ``trained``. A job stopped under it (phase
    ``stopped``), or reset by another run of the same name, never gets there: the command now ends with
    SimJobEnded (exit 1) naming the phase. Before, it printed progress forever."""
    from pipeline.sim.job import SimJobEnded

    try:
        exc = _sim_job_until_its_phase_changes(r, redis_url, tmp_path, "simjobstop", {"phase": "stopped"})
        assert isinstance(exc, SimJobEnded) and "phase stopped" in str(exc)
    finally:
        r.hset(JobKeys("simjobstop").state, "phase", "done")


def test_sim_job_leaves_a_later_run_of_its_job_name_alone(r, redis_url, tmp_path):
    """Another run takes the job name while ``libra-ctl sim-job`` waits (its state now names that run's
    directory, phase starting). The sim job ends (SimJobEnded); before, on its way out it marked the job
    done (later stopped) whatever run it now belonged to, and so stopped the new run's workers."""
    from pipeline.sim.job import SimJobEnded

    keys = JobKeys("simjobtaken")
    try:
        exc = _sim_job_until_its_phase_changes(r, redis_url, tmp_path, "simjobtaken", {
            "phase": "starting", "run_dir": str(tmp_path / "runs" / "a-later-run")})
        assert isinstance(exc, SimJobEnded)
        assert r.hget(keys.state, "phase") == b"starting"   # the later run's, untouched
    finally:
        r.hset(keys.state, "phase", "done")
