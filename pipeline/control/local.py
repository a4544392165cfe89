"""A controller and a node agent as child processes of one command (``libra-ctl run``, the live bench).

``start_local_control`` starts ``libra-ctl controller`` and ``libra-ctl agent``
(or only the one of them that is missing on the Redis) as subprocesses; the
returned ``LocalControl`` checks and stops them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.control.agent import SlotError, detect_slots
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.redaction import open_private

class LocalControl:
    """The controller and one agent as child processes of ``libra-ctl run``; ``stop()`` ends both."""

    def __init__(self, procs: list[tuple[str, subprocess.Popen]], run_dir: Path):
        self.procs, self.run_dir = procs, run_dir

    def check(self) -> None:
        """Raise RuntimeError naming the process if the controller or the agent died."""
        for name, p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode}; see {self.run_dir / 'logs' / name}.out")

    def stop(self, timeout_s: float = 60.0) -> None:
        """The controller first (no more actions), then the agent, which drains its workers."""
        for _name, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_local_control(cfg, run_dir: Path, redis_url: str, *, slots: int | None = None,
                        node: str | None = None, interval_s: float | None = None, controller: bool = True,
                        agent: bool = True) -> LocalControl:
    """Start ``libra-ctl controller`` and ``libra-ctl agent`` for a local run; returns their handle.

    ``slots``: CPU slots for the agent; None: the GPUs it finds (``LIBRA_GPUS``
    or NVML), or, with none, one CPU slot per rollout and learner worker of
    ``cfg``. The job's state hash must already name ``run_dir`` (the
    controller reads the manifest from there); the controller then starts the
    stage workers through the agent, from the config's counts.
    ``controller`` / ``agent``: False leaves that one out (one already runs on the Redis).
    """
    if interval_s is None:
        interval_s = cfg.control.interval_s
    if slots is None:
        try:
            detect_slots(None)
        except SlotError:
            slots = getattr(cfg.run, "slots", 0) or cfg.rollout.workers + cfg.learner.workers
    env = dict(os.environ, **{ENV_URL: redis_url, "PYTHONUNBUFFERED": "1"})   # never on argv: ps shows it
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    agent_argv = ["agent"] + (["--slots", str(slots)] if slots else []) + (["--node", node] if node else [])
    procs = []
    control = getattr(cfg, "control", None)
    port, host = getattr(control, "metrics_port", 0), getattr(control, "metrics_host", "127.0.0.1")
    controller_argv = ["controller", "--interval", str(interval_s), "--metrics-port", str(port), "--metrics-host", host]
    wanted = ([("controller", controller_argv)] if controller else []) + ([("agent", agent_argv)] if agent else [])
    for name, argv in wanted:
        with open_private(logs / f"{name}.out") as out:
            procs.append((name, subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv], env=env,
                                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)))
    return LocalControl(procs, Path(run_dir))


