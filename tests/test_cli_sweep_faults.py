"""The README's command reference run the way a user would, with bad input: faults a review found (the
docstrings say what happened before).

Real CLI subprocesses against a real redis-server of our own (a free port); no mocks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CTL = str(ROOT / ".venv" / "bin" / "libra-ctl")
if not Path(CTL).exists():
    CTL = shutil.which("libra-ctl") or CTL
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT, METRICS_PORT = _free_port(), _free_port()
URL = f"redis://127.0.0.1:{PORT}/0"
STEADY = str(ROOT / "examples" / "bench" / "steady.toml")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LIBRA_REDIS_URL"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def ctl(*args, cwd, timeout=60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([CTL, *map(str, args)], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# --- files: output paths -------------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """The least a run directory needs for report and trace (both work on it: see the sanity checks)."""
    rd = tmp_path / "rd"
    (rd / "logs").mkdir(parents=True)
    (rd / "metrics.jsonl").touch()
    (tmp_path / "afile").write_text("a plain file\n")
    return rd


@pytest.mark.parametrize("argv", [
    ["report", "rd", "-o", "afile/x.html"],
    ["trace", "rd", "-o", "afile/x.json"],
    ["bench", "policy", STEADY, "--modes", "sync", "--json", "afile/x.json"],
])
def test_an_output_path_under_a_plain_file_is_one_line_exit_2_not_a_traceback(run_dir, argv):
    """`-o DIR/NAME` (or `--json`) where DIR is a file: argtypes.unwritable() checks only os.access(parent),
    which a writable *file* passes, so the command does its work and then dies with a NotADirectoryError
    traceback (exit 1) instead of the documented one line and exit 2 up front."""
    cwd = run_dir.parent
    sanity = ctl("report", "rd", "-o", "ok.html", cwd=cwd)
    assert sanity.returncode == 0, sanity.stderr
    p = ctl(*argv, cwd=cwd)
    assert "Traceback" not in p.stderr, p.stderr[-1500:]
    assert p.returncode == 2, (p.returncode, p.stderr[-500:])


def test_report_to_a_symlink_such_as_dev_stdout_writes_through_it_not_over_it(run_dir):
    """`libra-ctl report RUN -o /dev/stdout` (or -o /dev/null, which argtypes.unwritable explicitly admits as "a
    device such as /dev/null") writes a NAME.tmp beside the target and os.replace()s it over the target: the
    symlink (as root: /dev/null or /dev/full itself) is replaced by a regular file and nothing reaches stdout.
    Here a symlink to /proc/self/fd/1 of our own stands for /dev/stdout (so /dev is not touched)."""
    cwd = run_dir.parent
    link = cwd / "stdout"
    link.symlink_to("/proc/self/fd/1")
    p = ctl("report", "rd", "-o", "stdout", cwd=cwd)
    assert p.returncode == 0, p.stderr[-800:]
    assert link.is_symlink(), "the -o symlink was replaced by a regular file"
    assert "<html" in p.stdout.lower(), p.stdout[:300]


# --- docs: the README command reference ----------------------------------------------------------------------


def test_the_readme_command_reference_lists_every_subcommand_with_its_real_flags():
    """README "Command line" block: `rejudge` and `sim-job` are missing; `bench streams [--json]` is shown bare
    though --json takes OUT (`libra-ctl bench streams --json` is an argparse error)."""
    from pipeline.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    block = (ROOT / "README.md").read_text().split("## Command line", 1)[1].split("```")[1]
    mentioned = set(re.findall(r"^libra-ctl ([a-z-]+)", block, re.M)) | set(re.findall(r"/ ([a-z-]+)\b", block))
    assert set(sub.choices) <= mentioned, f"not in the README command block: {sorted(set(sub.choices) - mentioned)}"
    streams = next(a for a in sub.choices["bench"]._actions
                   if isinstance(a, argparse._SubParsersAction)).choices["streams"]
    takes_value = any("--json" in a.option_strings and a.nargs != 0 for a in streams._actions)
    line = next(l for l in block.splitlines() if l.startswith("libra-ctl bench streams"))
    assert not (takes_value and re.search(r"\[--json\]", line)), line


# --- a live control plane with a small sim job -----------------------------------------------------------------


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    """Our own redis-server, an agent (4 slots) and a controller on it, as deploy/Procfile.sim."""
    if not shutil.which("redis-server"):
        pytest.skip("no redis-server")
    work = tmp_path_factory.mktemp("plane")
    redis = subprocess.Popen(["redis-server", "--port", str(PORT), "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while subprocess.run(["redis-cli", "-p", str(PORT), "ping"], capture_output=True, text=True).stdout.strip() \
            != "PONG":
        assert time.time() < deadline, "our redis-server did not start"
        time.sleep(0.1)
    procs = [
        subprocess.Popen([CTL, "agent", "--slots", "4", "--node", "n1", "--redis", URL], cwd=work, env=_env(),
                         stdout=open(work / "agent.log", "w"), stderr=subprocess.STDOUT),
        subprocess.Popen([CTL, "controller", "--interval", "1", "--metrics-port", str(METRICS_PORT),
                          "--redis", URL], cwd=work, env=_env(),
                         stdout=open(work / "controller.log", "w"), stderr=subprocess.STDOUT),
    ]
    from pipeline.control.allocation import live_agents
    from pipeline.dataplane.keys import CONTROLLER_LEASE
    from pipeline.dataplane.redisconn import connect

    r = connect(URL)
    deadline = time.time() + 120   # a loaded machine takes its time to start them
    while not (live_agents(r) and r.exists(CONTROLLER_LEASE)):
        assert time.time() < deadline, "the agent and the controller did not come up"
        time.sleep(0.2)
    yield work
    for p in procs:
        _stop(p)
    redis.terminate()
    redis.wait(10)


def test_worker_with_a_job_name_no_job_can_have_exits_2_at_once(plane):
    """`libra-ctl worker rollout --job 'bad*name'`: every other command refuses such a name at once
    (config.check_name: "use letters, digits, ...") and no job can ever run under it; the worker first waited
    up to 120 s for its Redis (here one that is not up) and only then said so."""
    try:
        p = ctl("worker", "rollout", "--job", "bad*name", "--redis", f"redis://127.0.0.1:{_free_port()}/0",
                cwd=plane, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("libra-ctl worker --job 'bad name' still waiting after 20 s")
    assert p.returncode == 2, (p.returncode, p.stderr)


def test_controller_once_while_another_controller_acts_says_why_it_did_nothing(plane):
    """`libra-ctl controller --once` beside the running controller exits 1 with no output at all."""
    p = ctl("controller", "--once", "--metrics-port", "0", "--redis", URL, cwd=plane, timeout=30)
    assert p.returncode != 0
    assert "another controller holds the lease" in p.stderr, "exit 1 and not a word"


def test_status_json_counters_keep_their_keys_from_the_start_and_a_finished_sim_run_is_not_resumed_as_a_real_run(
        plane):
    """Two findings on one sim job (a sim job costs ~30 s; both need one).

    1. `status --json` "counters" is the raw Redis hash (pipeline/observe/status.py:143), so "trained" and
       "dropped_stale" are absent until the first step (the README's example and `audit --json` always have them):
       a dashboard reading counters["trained"] fails for the first part of every run.
    2. `libra-ctl resume <a finished sim-job run>` is taken for a `libra-ctl run` directory: no summary.json, so
       not "finished"; it builds a real torch policy, starts TensorBoard/W&B and a real feeder, and never returns.
    """
    job = subprocess.Popen([CTL, "sim-job", STEADY, "--job", "simrv", "--time-scale", "100", "--steps", "1",
                            "--runs-dir", "runs", "--redis", URL], cwd=plane, env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    try:
        deadline = time.time() + 60
        while time.time() < deadline and first is None:
            st = ctl("status", "--json", "--redis", URL, cwd=plane)
            assert st.returncode == 0, st.stderr
            for j in json.loads(st.stdout)["jobs"]:
                if j["name"] == "simrv" and j["counters"].get("issued"):
                    first = j["counters"]
            time.sleep(0.5)
        out, _ = job.communicate(timeout=120)
    finally:
        _stop(job)
    assert job.returncode == 0, out[-1500:]
    run_dir = Path(re.search(r"done: (\S+)", out).group(1))
    audit = json.loads(ctl("audit", "--job", "simrv", "--json", "--redis", URL, cwd=plane).stdout)

    problems = []
    assert first is not None
    missing = {"issued", "generated", "scored", "trained", "dropped_stale"} - set(first)
    if missing:
        problems.append(f"status --json counters lacked {sorted(missing)} while the job ran: {first}")
    final = json.loads(ctl("status", "--json", "--redis", URL, cwd=plane).stdout)["jobs"][0]["counters"]
    for k in ("issued", "generated", "scored", "trained"):
        assert final.get(k) == audit[k], (k, final, audit)   # the counts agree once all keys exist

    started = time.time()
    rs = subprocess.Popen([CTL, "resume", str(run_dir)], cwd=plane, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = rs.communicate(timeout=60)
        if rs.returncode not in (0, 2):
            problems.append(f"resume of a finished sim-job run: rc {rs.returncode}: {out[-600:]}")
    except subprocess.TimeoutExpired:
        rs.send_signal(signal.SIGTERM)   # as Ctrl-C would: it stops what it started
        out, _ = rs.communicate(timeout=60)
        problems.append(f"resume of a finished sim-job run still running after {time.time() - started:.0f} s: "
                        f"{out[-600:]}")
    assert not problems, "\n".join(problems)
