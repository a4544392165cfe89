"""An orphan whose graceful stop hangs still ends (``lifeline``'s ``exit_after_s``).

A process of a killed run gets SIGTERM when its starter dies. Its graceful
stop can outlast the run by far on a loaded machine (a batch in hand, a
Redis that is going away), so the workers, the controller and the agent
exit outright ``exit_after_s`` after it. The child here ignores SIGTERM, the
worst case of a hung stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import signal, sys, time
    from pipeline.dataplane.lifeline import watch_parent
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a graceful stop that never ends
    limit = None if sys.argv[1] == "none" else float(sys.argv[1])
    watch_parent(exit_after_s=limit)
    print("ready", flush=True)
    time.sleep(600)
""")

# The middle process starts the child with lifeline.spawn and is then killed, as `libra-ctl run` is by kill -9.
MIDDLE = textwrap.dedent("""
    import subprocess, sys, time
    from pipeline.dataplane.lifeline import spawn
    child = spawn([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _orphan(limit: str) -> psutil.Process:
    """A child that ignores SIGTERM, orphaned by the SIGKILL of its parent; returns the child."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, CHILD, limit], env=env, stdout=subprocess.PIPE,
                              text=True)
    child = psutil.Process(int(middle.stdout.readline()))
    middle.send_signal(signal.SIGKILL)
    middle.wait()
    return child


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_orphan_that_hangs_on_sigterm_exits_after_its_limit():
    child = _orphan("1.0")
    t0 = time.monotonic()
    # the watchdog polls every 0.5 s, then waits 1 s: a generous bound that still fails when nothing exits
    deadline = t0 + 30.0
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not _running(child), "the orphan ignored SIGTERM and was never made to exit"
    finally:
        if _running(child):
            child.kill()


def test_without_a_limit_the_same_orphan_stays():
    """The contrast: SIGTERM alone does not end it (what the limit is for)."""
    child = _orphan("none")
    try:
        time.sleep(3.0)   # the SIGTERM came within 0.5 s; a process it could stop would be gone
        assert _running(child)
    finally:
        child.kill()
