"""What a user running pools by the docs met: the Procfile's default refused, a pin beside an external learner
idling a slot, a restarted pool line losing its id, a traceback on Ctrl-C, a doubled prefix.

Each docstring says what should happen; "Before" says what happened until the fix."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.config import ControlConfig
from pipeline.control.allocator import RoleBounds
from pipeline.control.loop import Controller, JobView


def _view(mode: str, target: dict, pinned: dict, ext_n: dict) -> JobView:
    info = SimpleNamespace(name="j", initial={"rollout": 1, "reward": 1, "learner": 1}, control=ControlConfig())
    jc = SimpleNamespace(info=info, last_reason=None)
    alloc = {"mode": mode, "target": target, "pinned": pinned}
    bounds = {r: RoleBounds() for r in ("rollout", "reward", "learner")}
    return JobView(jc=jc, alloc=alloc, ext={}, ext_n=ext_n, bounds=bounds)


def test_pinned_learner_count_with_external_learner_does_not_idle_a_slot():
    """`libra-ctl scale rollout=2 reward=1 learner=2` on a job whose learner is an external pool
    worker (`libra-ctl worker learner`), with 2 free agent slots beside it.

    The external learner fixes the learner at one process (docs/elastic.md), so the pin's
    rollout=2 fits the two agent slots (3 slots: 2 agent + the external learner's).
    Before: `decide` trims the pin with learner=2 first (rollout cut to 1), then overrides learner to
    the external 1: target rollout=1 learner=1, one agent slot left idle and a rollout worker drained
    (seen live: event `pinned_trimmed`, status `0:-`).
    """
    view = _view("pinned", {"rollout": 2, "reward": 1, "learner": 1},
                 {"rollout": 2, "reward": 1, "learner": 2}, {"learner": 1})
    target, _ = Controller.decide(None, view, 3, None, learner_room=2)
    assert target["learner"] == 1
    assert target["rollout"] == 2, target


def test_scale_bad_count_names_the_command_once(monkeypatch, capsys):
    """`libra-ctl scale --job J bogus=1` prints one line `libra-ctl scale: 'bogus=1': write role=N ...`.

    Before: it printed `libra-ctl scale: libra-ctl scale: 'bogus=1': ...`: parse_counts puts the prefix in
    the BadInput and cmd_scale's `except ValueError` prints it again.
    """
    from pipeline.control import commands

    monkeypatch.setattr(commands, "find_redis_url", lambda url: "redis://unused")
    monkeypatch.setattr(commands, "connect", lambda url: None)
    monkeypatch.setattr(commands, "pick_job", lambda r, job: "j")
    args = SimpleNamespace(redis=None, job="j", auto=False, counts=["bogus=1"], wait=None)
    assert commands.cmd_scale(args) == 2
    err = capsys.readouterr().err
    assert "bogus=1" in err
    assert err.count("libra-ctl scale:") == 1, err


def test_procfile_defaults_admit_the_quickstart(r):
    """README "Quick start"/docs/elastic.md: `.venv/bin/honcho start` on the root Procfile runs the quick start
    (agent with `--slots ${LIBRA_AGENT_SLOTS:-2}`, plus the rollout/reward/learner pool lines).

    The job is admitted: the agent's default slots hold the job's minimum (the pool lines join once it runs).
    Before: the pool lines only register once the job runs, so `check_admission` sees a pool of 1 (the agent's
    one slot) and `libra-ctl run` exits 2: "job 'quickstart' refused: ... needs at least 2 slots ... a pool
    of 1"; honcho then stops every line. Seen live 3 times out of 3 (embedded Redis and a Redis by URL).
    """
    import json
    import re
    import time
    from pathlib import Path

    from pipeline import config as config_mod
    from pipeline.control.job import check_admission
    from pipeline.control.local import own_slots
    from pipeline.dataplane.keys import AGENTS

    root = Path(__file__).resolve().parents[1]
    slots = int(re.search(r"--slots \$\{LIBRA_AGENT_SLOTS:-(\d+)\}", (root / "Procfile").read_text()).group(1))
    r.hset(AGENTS, "vm", json.dumps({"node": "vm", "host": "h", "pid": 1, "started_at": time.time(),
                                     "heartbeat": time.time(),
                                     "slots": [{"index": i, "device": None} for i in range(slots)]}))
    cfg = config_mod.load(str(root / "examples/quickstart.toml"), ["job.steps=4", "job.eval_size=32"])
    check_admission(r, cfg, own_slots(cfg))   # raises AdmissionError now


def test_sim_job_ctrl_c_is_a_message_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C on `libra-ctl sim-job ...` (docs/elastic.md "Try it") while it prints progress.

    A one-line message and exit 130, as `libra-ctl run` does ("interrupted; ...").
    Before: KeyboardInterrupt escapes cmd_sim_job and main(): a Python traceback ending in
    `time.sleep(2.0)` in pipeline/sim/job.py run_sim_job (seen live).
    """
    from pipeline.sim import job as sim_job

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sim_job, "run_sim_job", interrupted)
    monkeypatch.setattr(sim_job, "find_redis_url", lambda url: "redis://unused")
    args = SimpleNamespace(counts=[], control=None, redis=None, workload="examples/bench/steady.toml",
                           runs_dir="runs", job="sim", time_scale=100.0, steps=2, node=None)
    try:
        rc = sim_job.cmd_sim_job(args)
    except KeyboardInterrupt:   # caught here: escaping would abort the whole pytest session
        import pytest
        pytest.fail("KeyboardInterrupt escaped cmd_sim_job (a traceback for the user)")
    assert rc == 130


def test_pool_line_restarted_after_a_crash_gets_its_id_back(r):
    """docs/elastic.md: a pool worker takes `<role>-<node>-ext<k>`, "the lowest k no live worker holds, so a
    line started again on its node gets its id (and its consumer's pending entries) back".

    A line restarted right after its process was killed (kill -9, OOM; a supervisor restarts it
    within a second) gets `rollout-<node>-ext0` back: the old pid is gone on this very node.
    Before: the dead process's record still has a fresh heartbeat (< STALE_S = 10 s), so the restart
    gets `ext1` (seen live: rollout-x-ext1 beside a dead rollout-x-ext0 counted `running`, the agents
    running one rollout fewer), and a restarted learner line exits 2: "learner-0 is held by the live
    worker pid N on x" while pid N is dead.
    """
    import json
    import subprocess
    import time

    from pipeline.dataplane.keys import JobKeys
    from pipeline.dataplane.worker import EXTERNAL, claim_external_id, this_node

    node = this_node()
    dead = subprocess.Popen(["true"])
    dead.wait()   # reaped: its pid names no process
    keys = JobKeys("j")
    r.hset(keys.workers, "rollout-%s-ext0" % node, json.dumps({
        "id": "rollout-%s-ext0" % node, "role": "rollout", "pid": dead.pid, "node": node, "slots": [],
        "state": "running", "heartbeat": time.time() - 1.0, "managed": EXTERNAL}))
    assert claim_external_id(r, keys, "rollout", node) == "rollout-%s-ext0" % node


def test_worker_says_it_waits_for_redis(monkeypatch, capsys):
    """`libra-ctl worker rollout --job J` with no Redis up yet (a pool line started before the server).

    It says at once what it waits for, where, and for how long, then fails with the way out.
    Before: nothing at all for 120 s, then the failure.
    """
    import socket

    from pipeline import cli

    with socket.socket() as s:             # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(cli, "REDIS_WAIT_S", 0.5)
    args = SimpleNamespace(node="n", redis=f"redis://127.0.0.1:{port}", job="j", role="rollout", worker_id=None)
    assert cli.cmd_worker(args) == 1
    out, err = capsys.readouterr()
    assert out.count("waiting up to") == 1 and f"127.0.0.1:{port}" in out
    assert "no Redis answered" in err
