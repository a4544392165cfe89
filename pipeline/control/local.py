"""A controller and a node agent as child processes of one command (``libra-ctl run``, the live bench).

``start_local_control`` starts ``libra-ctl controller`` and ``libra-ctl agent``
(or only the one of them that is missing on the Redis) as subprocesses; the
returned ``LocalControl`` checks, restarts and stops them.

Both die with the command that started them (``dataplane.lifeline``: SIGTERM
on its death, by PDEATHSIG and by a watchdog). The death of either inside a
run does not end the run: ``check()`` starts it again after a back-off
(1 s, doubling, up to 30 s), counts the restarts and says so; a new
controller takes the lease once the old one's expires, a new agent takes its
node's lock once the old one's expires and adopts the workers the old one
recorded (they outlive it). More than ``MAX_RESTARTS`` exits of one process
within ``RESTART_WINDOW_S`` is a crash loop: the run fails with its last
output.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.control.agent import SlotError, detect_slots
from pipeline.dataplane.lifeline import spawn
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.logs import open_output, output_tail

MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0
BACKOFF_S = (1.0, 30.0)   # first and longest wait before a restart


@dataclass
class Supervised:
    """One process of ours: how to start it, the live one, and its exits."""

    name: str
    argv: list[str]
    proc: subprocess.Popen
    restarts: int = 0
    exits: collections.deque = field(default_factory=collections.deque)   # monotonic times of recent exits
    restart_at: float | None = None


class LocalControl:
    """The controller and one agent as child processes of ``libra-ctl run``; ``stop()`` ends both."""

    def __init__(self, procs: list[Supervised], run_dir: Path, env: dict, say=None):
        self.supervised, self.run_dir, self.env = procs, run_dir, env
        self.say = say or (lambda line: None)

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        return [(s.name, s.proc) for s in self.supervised]

    @property
    def restarts(self) -> dict[str, int]:
        return {s.name: s.restarts for s in self.supervised}

    def check(self) -> None:
        """Restart the controller or the agent if it died (after its back-off); RuntimeError on a crash loop."""
        now = time.monotonic()
        for s in self.supervised:
            if s.proc.poll() is None:
                continue
            if s.restart_at is None:
                self._book(s, now)
            elif now >= s.restart_at:
                s.proc = _start(s.name, s.argv, self.env, self.run_dir)
                s.restart_at = None
                s.restarts += 1
                self.say(f"{s.name} restarted (restart {s.restarts}, pid {s.proc.pid})")

    def _book(self, s: Supervised, now: float) -> None:
        s.exits.append(now)
        while s.exits and now - s.exits[0] > RESTART_WINDOW_S:
            s.exits.popleft()
        log = self.run_dir / "logs" / f"{s.name}.out"
        if len(s.exits) > MAX_RESTARTS:
            raise RuntimeError(f"{s.name} exited {len(s.exits)} times within {RESTART_WINDOW_S:.0f}s, last with "
                               f"code {s.proc.returncode}; see {log}; last output:\n{output_tail(log)}")
        first, longest = BACKOFF_S
        wait = min(first * 2 ** (len(s.exits) - 1), longest)
        s.restart_at = now + wait
        self.say(f"{s.name} exited with code {s.proc.returncode}; restarting in {wait:.0f}s (see {log})")

    def stop(self, timeout_s: float = 60.0) -> None:
        """The controller first (no more actions), then the agent, which drains its workers."""
        for s in self.supervised:
            p = s.proc
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _start(name: str, argv: list[str], env: dict, run_dir: Path) -> subprocess.Popen:
    """``libra-ctl <argv>``, dying with us; its output appended to ``logs/<name>.out``."""
    with open_output(Path(run_dir) / "logs" / f"{name}.out") as out:
        # start_new_session: a Ctrl-C reaches the run alone, which stops its children in order
        return spawn([sys.executable, "-m", "pipeline.cli", *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
                     start_new_session=True)


def cpu_slots(cfg) -> int:
    """The CPU slots a run's own agent offers when it finds no GPU: ``run.slots``, else the slots its workers
    hold at the start."""
    return cfg.run.slots or cfg.slots_at_start()


def own_slots(cfg) -> int:
    """Slots the run's own agent will offer: the GPUs it finds, else ``cpu_slots``."""
    try:
        return len(detect_slots(None))
    except SlotError:
        return cpu_slots(cfg)


def start_local_control(cfg, run_dir: Path, redis_url: str, *, slots: int | None = None,
                        node: str | None = None, interval_s: float | None = None, controller: bool = True,
                        agent: bool = True, say=None) -> LocalControl:
    """Start ``libra-ctl controller`` and ``libra-ctl agent`` for a local run; returns their handle.

    ``slots``: CPU slots for the agent; None: the GPUs it finds (``LIBRA_GPUS``
    or NVML), or, with none, one CPU slot per rollout and learner worker of
    ``cfg``. The job's state hash must already name ``run_dir`` (the
    controller reads the manifest from there); the controller then starts the
    stage workers through the agent, from the config's counts.
    ``controller`` / ``agent``: False leaves that one out (one already runs on the Redis).
    ``say``: where restarts are reported (a line each).
    """
    if interval_s is None:
        interval_s = cfg.control.interval_s
    if slots is None:
        try:
            detect_slots(None)
        except SlotError:
            slots = cpu_slots(cfg)
    env = dict(os.environ, **{ENV_URL: redis_url, "PYTHONUNBUFFERED": "1"})   # never on argv: ps shows it
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    agent_argv = ["agent"] + (["--slots", str(slots)] if slots else []) + (["--node", node] if node else [])
    control = getattr(cfg, "control", None)
    port, host = getattr(control, "metrics_port", 0), getattr(control, "metrics_host", "127.0.0.1")
    controller_argv = ["controller", "--interval", str(interval_s), "--metrics-port", str(port), "--metrics-host", host]
    wanted = ([("controller", controller_argv)] if controller else []) + ([("agent", agent_argv)] if agent else [])
    procs = [Supervised(name, argv, _start(name, argv, env, Path(run_dir))) for name, argv in wanted]
    return LocalControl(procs, Path(run_dir), env, say)
