"""Bugs a second review of one day's changes found in them: the progress reader at a long unfinished line,
``libra-ctl scale``'s room note, and ``.ci/run``'s unix:// URL with a password."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline import experiment as ex
from pipeline.control.allocation import AGENT_DEAD_S
from pipeline.control.commands import room_for
from pipeline.dataplane.keys import AGENTS, JOBS, JobKeys
from pipeline.dataplane.worker import EXTERNAL

REPO = Path(__file__).resolve().parents[1]


class _Hang(Exception):
    pass


def _alarm(_signum, _frame):
    raise _Hang()


# --- the progress reader ---------------------------------------------------------------------------------


def test_current_step_returns_at_a_long_line_still_being_written(tmp_path, monkeypatch):
    """metrics.jsonl ends in a line longer than one read (``STEP_READ_BYTES``) that is still being written (no
    newline yet; or a writer killed mid-line): ``current_step`` returns the last whole step (3) and reads the
    long line whole next time. Before, it looped for ever, reading the same bytes again: the line made the
    chunk longer than a read, so the end-of-file test never held. The read size is made small here."""
    monkeypatch.setattr(ex, "STEP_READ_BYTES", 64)
    run = tmp_path / "20260101-000000-x"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, 4):
            f.write(json.dumps({"kind": "learner_step", "step": s}) + "\n")
        f.write('{"kind": "sample", "pad": "' + "x" * 300)   # the sampler's line, half written
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, 10.0)   # hang guard only
    try:
        step = ex.current_step(tmp_path)
    except _Hang:
        step = "hung"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    ex._STEPS.clear()
    assert step == 3, step


# --- libra-ctl scale's note: room_for ---------------------------------------------------------------------------


def _agent(r, node: str, n: int, heartbeat: float) -> None:
    r.hset(AGENTS, node, json.dumps({"node": node, "host": node, "pid": 1,
                                     "slots": [{"index": i} for i in range(n)], "heartbeat": heartbeat}))


def test_pin_room_leaves_out_other_jobs_placements_on_dead_agents(r):
    """Agent a (2 slots) is dead (its heartbeat older than AGENT_DEAD_S) and its placement record still names
    job other's 2 workers there (the controller has not re-placed them yet, or is down); agent b (2 slots) is
    live and empty. Pinning job j to 2 slots fits: the controller counts only live agents' slots that other
    jobs hold, and so does ``room_for`` (room 2). Before, it subtracted the dead agent's placements too: room
    0, and ``scale`` printed a false note."""
    now = time.time()
    _agent(r, "a", 2, now - AGENT_DEAD_S - 60)
    _agent(r, "b", 2, now)
    r.sadd(JOBS, "j", "other")
    for job in ("j", "other"):
        r.hset(JobKeys(job).state, mapping={"phase": "running"})
    r.hset(JobKeys("other").placement, mapping={
        "rollout-a-0": json.dumps({"role": "rollout", "node": "a", "slots": [0]}),
        "learner-0": json.dumps({"role": "learner", "node": "a", "slots": [1]})})
    need, room, held = room_for(r, "j", {"rollout": 1, "reward": 1, "learner": 1})[:3]
    assert need == 2
    assert room == 2, (need, room, held)


def test_pin_room_counts_only_external_workers_the_controller_counts(r):
    """Job j has one external rollout worker that was asked to drain (``JobKeys.external_drain``; still alive,
    finishing its batch): the controller no longer counts it (``external_counts``: ``counted`` only), so a pin
    of rollout=3 learner=1 needs 4 agent slots (loop.py ``_pin_slots``: ``agents_share(pinned, ext_n)``). One
    live agent offers 3: the controller trims the pin, and ``room_for`` says need 4 > room 3 (the note).
    Before, it subtracted every live external worker, draining ones too: need 3, room 3, no note."""
    now = time.time()
    _agent(r, "b", 3, now)
    r.sadd(JOBS, "j")
    r.hset(JobKeys("j").state, mapping={"phase": "running"})
    r.hset(JobKeys("j").workers, "rollout-h-ext0", json.dumps({
        "role": "rollout", "state": "running", "node": "h", "pid": 1, "slots": [], "heartbeat": now,
        "managed": EXTERNAL}))
    r.sadd(JobKeys("j").external_drain, "rollout-h-ext0")
    need, room, _held = room_for(r, "j", {"rollout": 3, "reward": 1, "learner": 1})[:3]
    assert room == 3
    assert need == 4, need


# --- .ci/run and a unix:// URL with a password ----------------------------------------------------------------


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_ci_run_passes_a_unix_urls_password_to_redis_cli(tmp_path):
    """``LIBRA_TEST_REDIS7_URL=unix://:secret@/path/redis.sock?db=15``, a socket server with requirepass, which
    the suite itself accepts (redis-py reads the password from the URL): ``.ci/run`` asks the server its
    version with the password and goes on to the tests. Before, the unix:// branch dropped the password, the
    server answered NOAUTH, and CI stopped ("answers as Redis ?"). Runs a copy of .ci/run beside stub
    redis-cli, redis-server, chromium and scripts/test (nothing real is started or tested)."""
    root = tmp_path / "repo"
    (root / ".ci").mkdir(parents=True)
    (root / "scripts").mkdir()
    shutil.copy(REPO / ".ci" / "run", root / ".ci" / "run")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stubs = {
        "scripts/test": "#!/usr/bin/env bash\necho TESTS-RAN\n",
        "bin/chromium": "#!/usr/bin/env bash\nexit 0\n",
        "bin/redis-server": "#!/usr/bin/env bash\necho 'Redis server v=7.2.4 sha=0'\n",
        # answers its version only when given the password (-a secret, $REDISCLI_AUTH, or in a -u URL)
        "bin/redis-cli": ("#!/usr/bin/env bash\n"
                          "[ \"${REDISCLI_AUTH:-}\" = secret ] && { printf 'redis_version:7.2.4\\r\\n'; exit 0; }\n"
                          "for a in \"$@\"; do case \"$a\" in secret|*:secret@*) "
                          "printf 'redis_version:7.2.4\\r\\n'; exit 0;; esac; done\n"
                          "echo 'NOAUTH Authentication required.'\n"),
    }
    for rel, text in stubs.items():
        p = (root / rel) if rel.startswith("scripts") else tmp_path / rel
        p.write_text(text)
        p.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    env.update(PATH=f"{bin_}:{os.environ['PATH']}",
               LIBRA_TEST_REDIS7_URL=f"unix://:secret@{tmp_path}/redis.sock?db=15")
    out = subprocess.run(["bash", str(root / ".ci" / "run")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "TESTS-RAN" in out.stdout, (out.returncode, out.stdout, out.stderr)
