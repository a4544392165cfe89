"""Child processes that die with the process that started them.

``libra-ctl run`` starts Redis, a controller, an agent and the feeder; the
agent starts the stage workers. When the starter is killed with SIGKILL none
of them may outlive it by more than a few seconds: a stray controller or
agent would keep acting on the job, and ``libra-ctl resume`` would find a
second copy of everything. Two mechanisms, because neither covers all cases:

- ``PR_SET_PDEATHSIG`` (Linux): the kernel sends the child SIGTERM when its
  parent dies. It fires on the death of the parent *thread* that forked the
  child, so ``spawn`` must be called from a thread that lives as long as its
  process (``libra-ctl run`` spawns from its main thread only). A Python
  child sets it itself, first thing (``watch_parent``), rather than in a
  ``preexec_fn``, which is unsafe in a parent with threads (the run has its
  metrics sampler); only the watchdog below, single-threaded, uses one;
- a watchdog thread in the child (every platform), ``watch_parent``: it
  polls ``os.getppid()`` against the pid its starter gave it in
  ``$LIBRA_PARENT_PID`` and sends SIGTERM to its own process once the parent
  is gone. The variable closes the race of a parent that dies before the
  child looks.

SIGTERM, not SIGKILL: a worker stops after the batch in hand (its unacked
entries are replayed), the agent drains, Redis fsyncs its AOF. But an orphan
cannot finish much: its run's Redis is going away with the run, so a batch
in hand has nowhere to go, and a graceful stop that waits on it can run long
on a loaded machine. A process that asks for it (``exit_after_s``: the
workers, the controller, the agent) therefore exits outright that long after
the SIGTERM if it is still there; that is as safe as the kill -9 every
process of a run is built to survive (nothing is acknowledged before it is
stored, checkpoints are written whole or not at all).

The stage workers are the agent's children, but they must outlive an agent
that dies (a fresh agent adopts them: no second copy, no lost batch) and
still end with the run. So they watch the run itself, not their parent:
``libra-ctl run`` names itself in ``$LIBRA_OWNER`` (pid and start time, so a
reused pid is not mistaken for it), every process below it inherits the
variable, and ``watch_owner`` sends SIGTERM to its own process once that
process is gone. A worker of a standalone agent (a Procfile's, a cluster's)
has no owner and watches nothing.

``python -m pipeline.dataplane.lifeline OWNER_PID -- COMMAND...`` runs a
program that cannot watch for itself (redis-server) under a small watchdog
that stops it when OWNER_PID is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PARENT_ENV = "LIBRA_PARENT_PID"
PASS_FDS_ENV = "LIBRA_PASS_FDS"   # descriptors the watchdog passes on to its program (the embedded Redis's lock)
OWNER_ENV = "LIBRA_OWNER"   # "pid:start" of the libra-ctl run every process below it ends with
PR_SET_PDEATHSIG = 1
POLL_S = 0.5
# An orphan still running this long after its SIGTERM exits outright (the agent drains its workers for up to
# its grace first, so its limit is longer than theirs).
ORPHAN_EXIT_S = 20.0


def raise_interrupt(signum, _frame):
    """A signal handler: SIGTERM (a supervisor's stop) ends a command as Ctrl-C does, through its cleanup."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def set_pdeathsig() -> None:
    """SIGTERM to this process when its parent (thread) dies; Linux only, elsewhere nothing."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _preexec_pdeathsig(parent: int) -> None:
    """In a child of a single-threaded parent, between fork and exec (see the module docstring)."""
    set_pdeathsig()
    if os.getppid() != parent:   # the parent died before prctl: the signal will never come
        os._exit(1)


def child_env(env: dict | None = None) -> dict:
    """``env`` (default: ours) with ``$LIBRA_PARENT_PID`` naming this process, for a child to watch."""
    return dict(os.environ if env is None else env, **{PARENT_ENV: str(os.getpid())})


def spawn(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` of a Python child that dies with us once it calls ``watch_parent``."""
    popen_kwargs["env"] = child_env(popen_kwargs.get("env"))
    return subprocess.Popen(argv, **popen_kwargs)


def _orphaned(act, exit_after_s: float | None) -> None:
    """``act()``, then, if asked, exit outright once ``exit_after_s`` have passed and we are still here."""
    act()
    if exit_after_s is not None:
        time.sleep(exit_after_s)
        os._exit(1)


def watch_parent(on_orphan=None, exit_after_s: float | None = None) -> threading.Thread | None:
    """In a child ``spawn`` started: PDEATHSIG, and a watchdog; SIGTERM to ourselves once the parent is gone.

    Does nothing for a process started otherwise (no ``$LIBRA_PARENT_PID``:
    a Procfile's, a shell's). The variable is removed from our environment,
    so a process we start does not watch our parent. ``exit_after_s``: see
    the module docstring.
    """
    raw = os.environ.pop(PARENT_ENV, "")
    if not raw.isdigit():
        return None
    parent = int(raw)
    act = on_orphan or (lambda: os.kill(os.getpid(), signal.SIGTERM))
    set_pdeathsig()   # then look: a parent that died before this is seen by the first poll

    def run():
        while os.getppid() == parent:
            time.sleep(POLL_S)
        _orphaned(act, exit_after_s)

    t = threading.Thread(target=run, daemon=True, name="parent-watchdog")
    t.start()
    return t


def pid_alive(pid) -> bool:
    """Whether a process of this machine has ``pid`` (one we may not signal counts as alive, and so does a
    pid reused since: what waits on it waits on)."""
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def process_start(pid: int) -> int | None:
    """A live process's start time (clock ticks since boot, /proc/PID/stat field 22); None if gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    rest = raw[raw.rindex(")") + 2:].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def own_runs() -> None:
    """Name this process (``libra-ctl run``) the owner of every process started below it."""
    start = process_start(os.getpid())
    if start is not None:
        os.environ[OWNER_ENV] = f"{os.getpid()}:{start}"


def watch_owner(on_orphan=None, exit_after_s: float | None = ORPHAN_EXIT_S) -> threading.Thread | None:
    """SIGTERM to ourselves once the run in ``$LIBRA_OWNER`` is gone; nothing without one (or off Linux).

    Still here ``exit_after_s`` later (None: no limit), we exit outright.
    """
    pid, _, start = os.environ.get(OWNER_ENV, "").partition(":")
    if not (pid.isdigit() and start.isdigit()) or not Path("/proc").is_dir():
        return None
    act = on_orphan or (lambda: os.kill(os.getpid(), signal.SIGTERM))

    def run():
        while process_start(int(pid)) == int(start):
            time.sleep(POLL_S)
        _orphaned(act, exit_after_s)

    t = threading.Thread(target=run, daemon=True, name="owner-watchdog")
    t.start()
    return t


def _run_watched(owner: int, argv: list[str]) -> int:
    """Run ``argv`` until it exits, or until ``owner`` (our parent) is gone: then SIGTERM it and wait."""
    set_pdeathsig()
    # we have no other thread: a preexec_fn is safe here, and the only way for a program that is not ours
    me = os.getpid()
    proc = subprocess.Popen(argv, pass_fds=_inherited_fds(), preexec_fn=lambda: _preexec_pdeathsig(me))
    stop = threading.Event()

    def forward(signum, _frame):
        stop.set()
        if proc.poll() is None:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while proc.poll() is None:
        if not stop.is_set() and os.getppid() != owner:   # reparented: the owner is gone (even unreaped)
            stop.set()
            proc.terminate()
        time.sleep(POLL_S / 5 if stop.is_set() else POLL_S)
    return proc.returncode


def _inherited_fds() -> tuple[int, ...]:
    """The descriptors our starter passed on (a lock file): passed on again to the watched program."""
    raw = os.environ.get(PASS_FDS_ENV, "")
    return tuple(int(x) for x in raw.split(",") if x.isdigit())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: python -m pipeline.dataplane.lifeline OWNER_PID -- COMMAND...", file=sys.stderr)
        return 2
    os.environ.pop(PARENT_ENV, None)
    return _run_watched(int(argv[0]), argv[2:])


if __name__ == "__main__":
    sys.exit(main())
