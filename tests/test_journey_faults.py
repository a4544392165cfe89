"""What a new user following README.md met: a mistyped --job, the README's order of dlq arguments, a pin the
pool cannot hold, and the figures and the resume of a resumed or finished run."""

from __future__ import annotations

import pytest

from pipeline import cli
from pipeline.control.loop import Controller
from pipeline.dataplane.keys import JOBS
from pipeline.observe import compare

from tests.test_controller import fake_agent
from tests.test_sim_workers import sim_job

JOB = "simtest"


# --- a mistyped --job ----------------------------------------------------------------------------------


def test_status_with_an_unknown_job_names_the_jobs_not_no_jobs(r, redis_url, capsys):
    """``libra-ctl status --job nope`` on a Redis whose job is ``quickstart`` should refuse as ``events``,
    ``doctor`` and ``scale`` do (exit 2, "no job 'nope' on this Redis; its jobs: quickstart"). Before, it
    printed "no jobs on this Redis" and exited 0: false (there is a job), and it hid the typo."""
    r.sadd(JOBS, "quickstart")
    rc = cli.main(["status", "--job", "nope", "--redis", redis_url])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2 and "quickstart" in text, (rc, text)


def test_top_once_with_an_unknown_job_refuses(r, redis_url, capsys):
    """``libra-ctl top --once --job nope`` refuses like ``events --job nope`` (exit 2, naming the jobs).
    Before, it exited 0 and drew a frame for a job that never ran: "phase None  policy vNone"."""
    r.sadd(JOBS, "quickstart")
    rc = cli.main(["top", "--once", "--job", "nope", "--redis", redis_url])
    out = capsys.readouterr()
    text = out.out + out.err
    assert "vNone" not in text and rc == 2, (rc, text)


# --- dlq: the README's order of arguments ----------------------------------------------------------------


def test_dlq_show_takes_the_id_after_the_job_option():
    """The README lists ``libra-ctl dlq list|show|replay|purge --job J``; an id after that (``dlq show --job J
    1-0``) works. Before, argparse refused it ("unrecognized arguments: 1-0"): it matches the positional
    ``action`` and ``ids`` together, so only ``dlq show 1-0 --job J`` worked."""
    p = cli.build_parser()
    try:
        args = p.parse_args(["dlq", "show", "--job", "j", "1-0"])
    except SystemExit as exc:
        pytest.fail(f"dlq show --job j 1-0 rejected by argparse (exit {exc.code})")
    assert args.action == "show" and args.ids == ["1-0"]


# --- scale past the pool -------------------------------------------------------------------------------


def test_scale_beyond_the_live_slots_says_it_cannot_run(r, redis_url, tmp_path, capsys):
    """A pin the live agents' slots cannot hold (``scale rollout=3`` on 2 CPU slots) is said: ``scale`` notes
    the slots it needs and those there are, and the controller's event is ``pinned_trimmed`` with what was
    asked. Before, ``scale`` printed "pinned ... rollout=3", the controller fitted the pin to the pool
    without a word, and ``status`` showed "pinned rollout=3 running rollout=1" for ever."""
    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    jobs = fake_agent(r, "n1", 2)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    jobs.run_pending()
    capsys.readouterr()
    rc = cli.main(["scale", "rollout=3", "--job", JOB, "--redis", redis_url])
    out = capsys.readouterr()
    text = (out.out + out.err).lower()
    assert rc == 0 and "need 4 agent slots" in text and "offer simtest 2" in text, (rc, text)
    ctl.tick()
    from pipeline.control.events import read_events

    trimmed = [e for e in read_events(r, JOB) if e.get("reason") == "pinned_trimmed"]
    assert trimmed and trimmed[-1]["asked"]["rollout"] == 3 and trimmed[-1]["to"]["rollout"] < 3, trimmed


# --- a resumed run's figures -----------------------------------------------------------------------------


def test_run_figures_of_a_resumed_run_put_nothing_before_its_start():
    """A resumed run keeps its first start as ``started_at`` (and says ``resumed_at``), and the figures put
    nothing the run recorded before their t0. Before, summary.json's ``started_at`` was the resume's, while
    metrics.jsonl kept the first process's steps and evaluations: on a real quick-start run stopped at step
    7 and resumed, the reward curve sat at -41 s to -26 s for steps 1-8, and a time to target could be
    negative. Here a summary as the resume wrote it before."""
    t = 1_000_000.0
    steps = [{"kind": "learner_step", "step": s, "at": t + 10 + 2 * s, "policy_version": s,
              "trained_total": 256 * s, "dropped_stale_total": 0, "reward_mean": 0.1 * s, "trajectories": 256}
             for s in range(1, 9)]                       # the first process: steps 1-8, then Ctrl-C
    steps += [{"kind": "learner_step", "step": s, "at": t + 100 + 2 * s, "policy_version": s + 1,
               "trained_total": 256 * s, "dropped_stale_total": 0, "reward_mean": 0.1 * s, "trajectories": 256}
              for s in range(9, 13)]                     # the resumed one: steps 9-12
    evals = [{"tag": "start", "version": 0, "success_rate": 0.27, "n": 256, "at": t + 5},
             {"tag": "periodic", "version": 5, "success_rate": 0.45, "n": 256, "at": t + 21},
             {"tag": "final", "version": 13, "success_rate": 0.54, "n": 256, "at": t + 126}]
    summary = {"started_at": t + 95.0,                  # what resume writes: its own start
               "success_rate_start": 0.27, "success_rate_end": 0.54, "eval_prompts": 256,
               "eval_prompts_start": 256, "evals": evals, "trajectories_trained": 3072, "dropped_stale": 0,
               "wall_s": 31.0, "trajectories_per_s": 33.0, "steps": 12}
    fig = compare.run_figures(summary, steps, [])
    negative = [p for p in fig["reward_curve"] + fig["curve"] if p["t_s"] < 0]
    assert not negative, negative
    reached = compare.with_target(fig, 0.40)["time_to_target_s"]
    assert reached is None or reached >= 0, reached


def test_resuming_a_finished_run_says_so_and_leaves_its_figures(tmp_path, capsys):
    """``libra-ctl resume`` of a run that finished (its summary.json says every step trained) says there is
    nothing to resume and exits 0, leaving summary.json as it was. Before, it ran again for a few seconds and
    overwrote summary.json with that process's figures (wall 29.2 s -> 5.1 s, 52.54 trajectories/s -> 0.0)."""
    import json

    from pipeline import config as config_mod
    from pipeline import manifest as manifest_mod
    from pipeline.run import resume_job

    cfg = config_mod.load("examples/quickstart.toml", ["job.steps=6"])
    run_dir = tmp_path / "20260101-000000-quickstart"
    run_dir.mkdir()
    manifest_mod.write_manifest(run_dir, cfg, argv=["libra-ctl", "run"], redis_url="", embedded=True,
                                policy_dir="", bad_prompt_lines=[])
    summary = {"steps": 6, "wall_s": 29.2, "trajectories_per_s": 52.54, "started_at": 1.0}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert resume_job(run_dir, ["libra-ctl", "resume", str(run_dir)]) == 0
    assert "already finished" in capsys.readouterr().err
    assert json.loads((run_dir / "summary.json").read_text()) == summary


def test_audit_and_dlq_of_an_unknown_job_name_the_jobs(r, redis_url, capsys):
    """``audit --job nope`` and ``dlq list --job nope`` exit 2 naming the jobs, as the other commands do.
    Before, audit said "no run directory" (exit 1) and dlq list printed nothing (exit 0). A job with dead
    letters but no run listed is still known, and an empty list says so."""
    r.sadd(JOBS, "quickstart")
    for argv in (["audit", "--job", "nope"], ["dlq", "list", "--job", "nope"]):
        assert cli.main([*argv, "--redis", redis_url]) == 2, argv
        assert "quickstart" in capsys.readouterr().err
    assert cli.main(["dlq", "list", "--job", "quickstart", "--redis", redis_url]) == 0
    assert "no dead letters for job 'quickstart'" in capsys.readouterr().err


def test_a_resumed_run_that_missed_the_target_is_bounded_by_its_whole_time():
    """A run that never reached the target took at least its whole time: for a resumed run that is the last
    point of its curve on the run's clock, not the last process's wall time. Before, the bound was the
    resumed process's ``wall_s`` (31 s here) though the run's evaluations went on to 126 s."""
    fig = {"wall_s": 31.0, "curve": [{"t_s": 5.0, "success": 0.2, "trajectories": 0},
                                     {"t_s": 126.0, "success": 0.3, "trajectories": 3072}]}
    assert compare.with_target(fig, 0.9)["time_to_target_bound_s"] == 126.0
    assert compare.with_target({"wall_s": 31.0, "curve": []}, 0.9)["time_to_target_bound_s"] == 31.0
