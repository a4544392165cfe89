"""`libra-ctl dlq` as an operator uses it: two commands on the same dead letter at once, and a full Redis.
A review of docs/guarantees.md found each a fault (the docstrings say what happened before).

Real components only: a private redis-server (a free port), the sim backend's real feeder and
rollout processes (``pipeline.sim.worker``, the production ``run_stage`` loop), a genuine dead letter made by the
rollout stage's own reclaim (an entry delivered more than ``streams.max_deliveries`` times), and the real
``libra-ctl dlq`` / ``libra-ctl audit`` commands as subprocesses.

Two operators (or a retried script) acting on the same dead letter at the same moment are made deterministic
with ``CLIENT PAUSE … WRITE``: both commands read the dead letter, and their writes run once the pause ends, as
they would if the two commands had simply overlapped (10 s: time for both to start on a loaded machine).
"""

from __future__ import annotations

import json
import re
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from pipeline.dataplane.keys import GROUP_ROLLOUT, JobKeys
from pipeline.sim.job import prepare_sim_run
from tests.test_sim_workers import ROOT, start, stop_all, wait_for, write_workload

LIBRA_CTL = str(ROOT / ".venv" / "bin" / "libra-ctl")
REDIS_SERVER = "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else shutil.which("redis-server")


@pytest.fixture
def own_redis(tmp_path):
    """A private redis-server (its maxmemory is changed), shut down at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(tmp_path), "--daemonize", "yes", "--pidfile", str(tmp_path / "redis.pid")],
                   check=True)
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    for _ in range(50):
        try:
            r.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.1)
    yield r, url
    try:
        r.shutdown(nosave=True)
    except redis.RedisError:
        pass


def _ctl(url: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    return subprocess.run([LIBRA_CTL, *argv, "--redis", url], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _job_with_a_dead_letter(r, url: str, tmp_path: Path, job: str) -> tuple[Path, str, str]:
    """A sim job whose feeder issued 24 prompts and whose rollout stage dead-lettered one of them for
    ``exceeded max_deliveries`` (a consumer that died holding it, delivered 5 times, idle for long). Every
    worker is stopped again; returns the run directory, the dead letter's id and the prompt's entry id."""
    wl = write_workload(tmp_path / "w.toml", job={"steps": 4})
    keys = JobKeys(job)
    run_dir = prepare_sim_run(r, wl, tmp_path / "runs", job=job, time_scale=20.0, redis_url=url)
    procs = [start("feeder", run_dir, "feeder-0", url)]
    try:
        wait_for(lambda: r.xlen(keys.prompts) >= 24, 60, "the feeder's first 24 prompts")
    finally:
        stop_all(procs)
    # a rollout worker that read one prompt and died: 5 deliveries, idle far past rollout_min_idle_s
    (entry_id, _f), = r.xreadgroup(GROUP_ROLLOUT, "rollout-dead-0", {keys.prompts: ">"}, count=1)[0][1]
    r.execute_command("XCLAIM", keys.prompts, GROUP_ROLLOUT, "rollout-dead-0", 0, entry_id,
                      "IDLE", 10**9, "RETRYCOUNT", 5)
    procs = [start("rollout", run_dir, "rollout-n-0", url)]
    try:
        wait_for(lambda: r.xlen(keys.dead_letters) >= 1, 60, "the rollout stage's dead letter")
        wait_for(lambda: int(r.hget(keys.counters, "generated") or 0) >= 4 * 23, 60, "the other 23 groups")
    finally:
        stop_all(procs)
    (dl_id, fields), = r.xrange(keys.dead_letters)
    assert fields[b"reason"].startswith(b"exceeded max_deliveries"), fields[b"reason"]
    assert fields[b"id"] == entry_id and int(fields[b"trajectories"]) == 4
    return run_dir, dl_id.decode(), entry_id.decode()


def _concurrently(r, argvs: list[list[str]], url: str) -> list[subprocess.CompletedProcess]:
    """Run the commands at once; their reads happen during a 10 s write pause, their writes after it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    r.execute_command("CLIENT", "PAUSE", 10000, "WRITE")
    procs = [subprocess.Popen([LIBRA_CTL, *a, "--redis", url], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in argvs]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=60)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def test_a_dead_letter_replayed_by_two_overlapping_commands_goes_back_once(own_redis, tmp_path):
    """guarantees.md: ``dlq replay`` puts a dead letter "back onto its source stream (and out of the DLQ)";
    exactly-once effect and the audit's ``issued = trained + dropped_stale + dead_lettered + in_flight``
    need one copy back, and ``dead_lettered_replayed`` to grow by the 4 trajectories it stood for. Before,
    both commands said "replayed 1": the prompt went back twice, the counter grew by 8, and the audit failed
    (issued 96 != 100)."""
    r, url = own_redis
    job = "rvdlq1"
    keys = JobKeys(job)
    run_dir, dl_id, _entry = _job_with_a_dead_letter(r, url, tmp_path, job)
    before = r.xlen(keys.prompts)

    results = _concurrently(r, [["dlq", "replay", dl_id, "--job", job]] * 2, url)

    replayed = sum("replayed 1 dead letters" in p.stdout for p in results)
    # the other found it gone: at its transaction (the usual overlap) or, had it started late, at its read
    assert sum("gone meanwhile" in p.stderr or "no dead letter" in p.stderr for p in results) == 1, \
        [p.stderr for p in results]
    assert r.xlen(keys.dead_letters) == 0
    # the dead letter is on its source stream once, and counted back into the feeder's in-flight once
    assert r.xlen(keys.prompts) == before + 1, (
        f"the prompt went back {r.xlen(keys.prompts) - before} times; both commands said "
        f"{[p.stdout.strip() or p.stderr.strip() for p in results]}")
    assert int(r.hget(keys.counters, "dead_lettered_replayed")) == 4
    assert replayed == 1
    audit = _ctl(url, "audit", "--job", job, "--run", str(run_dir), "--json")
    assert audit.returncode == 0, audit.stdout[-2000:]


def test_a_dead_letter_purged_by_two_overlapping_commands_is_counted_once(own_redis, tmp_path):
    """guarantees.md: a purge keeps "a small record of what the dead letter carried ... so ``libra-ctl audit``
    still counts those trajectories as dead-lettered"; its ids must be accounted once, not twice. Before, both
    commands said "purged 1" and left a record each: the audit counted its ids twice."""
    r, url = own_redis
    job = "rvdlq2"
    keys = JobKeys(job)
    run_dir, dl_id, _entry = _job_with_a_dead_letter(r, url, tmp_path, job)
    before = json.loads(_ctl(url, "audit", "--job", job, "--run", str(run_dir), "--json").stdout)
    assert before["dead_lettered"] == 4 and before["ok"], before["problems"]

    results = _concurrently(r, [["dlq", "purge", dl_id, "--job", job, "--yes"]] * 2, url)

    assert r.xlen(keys.dead_letters) == 0
    assert r.xlen(keys.dead_letters_purged) == 1, (
        f"{r.xlen(keys.dead_letters_purged)} purge records for one dead letter; the commands said "
        f"{[p.stdout.strip() or p.stderr.strip() for p in results]}")
    after = _ctl(url, "audit", "--job", job, "--run", str(run_dir), "--json")
    a = json.loads(after.stdout)
    assert a["dead_lettered"] == 4 and a["checks"]["ids"]["accounted_twice"] == 0, a["problems"]
    assert after.returncode == 0, a["problems"]


def test_dlq_commands_on_a_full_redis_say_so_instead_of_a_traceback(own_redis, tmp_path):
    """guarantees.md "Redis full: backpressure, not a crash": with ``maxmemory-policy noeviction`` a full
    Redis refuses writes. Dead letters are "never trimmed automatically", so ``dlq purge`` is what an operator
    reaches for then; ``dlq replay`` / ``purge`` must leave the dead letter whole and say that Redis is full
    in one line (exit non-zero), not die with a Python traceback that dumps the payload's bytes (as both
    did)."""
    r, url = own_redis
    job = "rvdlq3"
    keys = JobKeys(job)
    run_dir, dl_id, _entry = _job_with_a_dead_letter(r, url, tmp_path, job)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        results = {a[1]: _ctl(url, *a) for a in (["dlq", "purge", dl_id, "--job", job, "--yes"],
                                                  ["dlq", "replay", dl_id, "--job", job])}
    finally:
        r.config_set("maxmemory", 0)
    assert r.xlen(keys.dead_letters) == 1 and r.xlen(keys.dead_letters_purged) == 0   # nothing half-done
    for action, p in results.items():
        assert p.returncode != 0
        assert "Traceback" not in p.stderr, f"dlq {action} on a full Redis:\n{p.stderr[-1500:]}"
        assert p.returncode == 1 and "Redis is full" in p.stderr.strip().splitlines()[-1], p.stderr


def _made_dead_letters(r, keys: JobKeys, n: int) -> list[str]:
    """``n`` dead letters of the rollout stage's prompts stream, each a prompt of 4 trajectories."""
    from pipeline.dataplane.streams import dead_letter

    for i in range(n):
        pipe = r.pipeline(transaction=True)
        dead_letter(pipe, keys, keys.prompts, f"1-{i}".encode(), "test", payload=b"payload-%d" % i,
                    deliveries=5, trajectories=4)
        pipe.execute()
    return [i.decode() for i, _f in r.xrange(keys.dead_letters)]


def test_two_replays_of_overlapping_ids_each_say_what_they_replayed(own_redis):
    """Command 1 replays B, command 2 replays A and B, at once. A review of this session's fix found that the
    command which came to read B after the other had taken it ended "no dead letter B", exit 1, after it had
    replayed A, with no word of A. Now every id is read before any is replayed, and one lost at the take is
    "gone meanwhile": both commands exit 0, each saying what it replayed, and each id goes back once."""
    r, url = own_redis
    job, keys = "dlqtwo", JobKeys("dlqtwo")
    a, b = _made_dead_letters(r, keys, 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    r.execute_command("CLIENT", "PAUSE", 10000, "WRITE")
    procs = [subprocess.Popen([LIBRA_CTL, "dlq", "replay", *ids, "--job", job, "--redis", url], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for ids in ([b], [a, b])]
    outs = [p.communicate(timeout=60) + (p.returncode,) for p in procs]
    assert r.xlen(keys.dead_letters) == 0 and r.xlen(keys.prompts) == 2
    assert int(r.hget(keys.counters, "dead_lettered_replayed")) == 8
    assert [rc for _o, _e, rc in outs] == [0, 0], outs
    said = [int(re.search(r"replayed (\d+) dead letters", o).group(1)) for o, _e, _rc in outs]
    assert sum(said) == 2 and sum("gone meanwhile" in e for _o, e, _rc in outs) == 1, outs


def test_a_replay_naming_a_missing_id_replays_none_of_them(own_redis):
    """``dlq purge A GONE`` checked every id before any went; ``dlq replay A GONE`` replayed A, then died "no
    dead letter GONE" (exit 1) without a word of A: told the command failed, the operator could not tell that A
    was back on its stream. Now replay checks them all first, as purge does."""
    r, url = own_redis
    job, keys = "dlqgone", JobKeys("dlqgone")
    a, = _made_dead_letters(r, keys, 1)
    p = _ctl(url, "dlq", "replay", a, "9999999999999-0", "--job", job)
    assert p.returncode == 1 and "no dead letter 9999999999999-0" in p.stderr, p
    assert r.xlen(keys.prompts) == 0 and r.xlen(keys.dead_letters) == 1
