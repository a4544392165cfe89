"""``libra-ctl baseline`` and ``libra-ctl experiment``: one job over seeds, then one variable at a time.

``baseline CONFIG --repeat K`` runs the job K times with ``job.seed`` = base,
base+1, ... (each a real ``libra-ctl run`` in a child process), records the
spread over seeds of the four metric kinds in
``runs/experiments/<id>/baseline.json`` and warns when the seeds disagree on
held-out success by more than the effect one hopes to detect: the field
guide says to fix such an environment before tuning anything.

``experiment CONFIG --vary KEY=v1,v2 --repeat K`` runs every value x seed
(``--set KEY=v``), then judges each value against the baseline (a recorded
one with ``--baseline DIR``, else the first value's runs): the comparison
table, the field guide's verdict, and ``experiment.json``, ``table.md``,
``report.html`` and ``curves.svg`` in its directory.

Runs go ``--parallel`` at a time. Each has a runs directory of its own under
the experiment's (``run.runs_dir``), hence its own embedded Redis (``libra-ctl
run`` starts one in the run directory when no Redis URL is set), and, on a
GPU machine, its own GPUs (``LIBRA_GPUS``); with more than one at a time the
controllers' Prometheus port is turned off (``control.metrics_port = 0``).
Runs on a Redis given by URL share it and its controller, so they go one at
a time. Ctrl-C (or SIGTERM) sends SIGINT to the running runs' process groups,
waits for them to stop their workers, and writes what finished.

The figures, spread and verdict are ``pipeline.observe.compare``; the page
and the SVG are ``pipeline.observe.compare_report``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import argtypes, cgroup
from pipeline import config as config_mod
from pipeline.config import Config, check_path
from pipeline.dataplane.lifeline import raise_interrupt, spawn
from pipeline.dataplane.redisconn import resolve_url
from pipeline.observe import compare
from pipeline.observe.measures import read_jsonl, write_json

CORES_PER_RUN = 2       # cores one CPU run keeps busy (engine, learner, reward, feeder, Redis)
STOP_WAIT_S = 120.0     # a run stopped with SIGINT has this long to stop its workers, then SIGKILL
POLL_S = 0.5
PLAIN_EVERY_S = 30.0    # a progress line this often when stderr is not a terminal
LOG_TAIL = 15           # lines of a failed run's log shown and recorded
STEP_READ_BYTES = 1 << 20   # metrics.jsonl is read for the current step this much at a time
# Keys that differ between the runs of an experiment and its recorded baseline by design.
PER_RUN_KEYS = {"job.seed", "run.runs_dir", "tracking.run_name", "tracking.group", "control.metrics_port"}
INVOCATION = "invocation.json"   # how an experiment was started: what ``libra-ctl resume DIR`` runs again


class ExperimentError(ValueError):
    """Bad input found before any run starts (exit 2)."""


@dataclass
class RunSpec:
    """One run of an experiment: a value of the varied key (or the baseline) and a seed."""

    group: str          # "learner.lr=1e-3", or "baseline"
    value: str | None
    seed: int
    sets: list[str]     # every --set of the run
    name: str           # tracking.run_name
    home: Path          # the run's own runs directory
    log: Path           # its output
    steps: int
    resume_dir: Path | None = None   # set when an experiment resumes: the run directory it continues

    @property
    def tag(self) -> str:
        return f"{self.group} seed {self.seed}"


@dataclass
class Outcome:
    spec: RunSpec
    code: int | None    # None: never started (interrupted first)
    wall_s: float = 0.0
    error: str | None = None   # why it could not start (no log was written)


@dataclass
class Plan:
    """Everything decided before the first run starts."""

    config: str
    specs: list[RunSpec]
    parallel: int
    devices: list[list[str]] = field(default_factory=list)   # LIBRA_GPUS of each concurrent run; [] on CPU
    notes: list[str] = field(default_factory=list)


# --- planning (pure but for loading the config) ----------------------------------------------------------


def parse_vary(text: str) -> tuple[str, list[str]]:
    """``KEY=v1,v2,...`` -> (key, values); a comma inside a value's brackets, braces or quotes (a list or
    a string, as ``--set`` takes them: ``KEY=[1,2],[3,4]``) does not split it."""
    key, sep, rest = text.partition("=")
    values = [v.strip() for v in split_top_level(rest)] if sep else []
    if not key.strip() or not values or any(not v for v in values):
        raise ExperimentError(f"--vary {text!r}: expected KEY=v1,v2,..., e.g. --vary learner.lr=5e-4,1e-3")
    if len(set(values)) != len(values):
        raise ExperimentError(f"--vary {text!r}: a value appears twice")
    return key.strip(), values


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """``text`` split at each ``sep`` outside brackets, braces and quotes (an unclosed one keeps the rest
    whole: the value's own parse then says what is wrong with it)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            if c == quote and text[i - 1] != "\\":
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth = max(depth - 1, 0)
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def slug(text: str) -> str:
    """A file name from a label: letters, digits and ``._-`` kept, ``=`` as ``-``, the rest ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.replace("=", "-")).strip("_") or "run"


def short_slug(label: str, most: int = 100) -> str:
    """``slug(label)``, cut to ``most`` characters with a hash of the whole when longer: a file name, never one
    the file system refuses (a long varied value, a path)."""
    name = slug(label)
    return name if len(name) <= most else f"{name[:most]}-{hashlib.sha1(label.encode()).hexdigest()[:8]}"


def default_parallel(per_run: int, devices: list[str], cpus: int) -> int:
    """How many runs fit at once: the GPUs over a run's slots, else the cores over ``CORES_PER_RUN``."""
    if devices:
        return max(1, len(devices) // max(per_run, 1))
    return max(1, cpus // CORES_PER_RUN)


def choose_parallel(asked: int | None, per_run: int, devices: list[str], cpus: int,
                    shared_redis: bool) -> tuple[int, list[list[str]], list[str]]:
    """(runs at once, the GPUs of each, notes): ``asked`` or the default, within what the machine holds."""
    notes = []
    if shared_redis:
        if asked and asked > 1:
            notes.append("the runs share the Redis given by URL (and its controller): one at a time")
        return 1, [], notes
    n = asked or default_parallel(per_run, devices, cpus)
    if not devices:
        return n, [], notes
    fit = len(devices) // max(per_run, 1)
    if fit < 1:
        return 1, [], [f"a run needs {per_run} GPUs and {len(devices)} are visible: one at a time, on all of them"]
    if n > fit:
        notes.append(f"--parallel {n} needs {n * per_run} GPUs, {len(devices)} visible: {fit} at a time")
        n = fit
    if n == 1:
        return 1, [], notes
    return n, [devices[i * per_run:(i + 1) * per_run] for i in range(n)], notes


def visible_devices(env=os.environ) -> list[str]:
    """The GPUs runs may use: ``$LIBRA_GPUS``, else those NVML counts; [] on a CPU machine."""
    from pipeline.control.agent import GPUS_ENV, nvml_gpu_count

    if env.get(GPUS_ENV, "").strip():
        return [g.strip() for g in env[GPUS_ENV].split(",") if g.strip()]
    return [str(i) for i in range(nvml_gpu_count())]


def plan_runs(config: str, sets: list[str], groups: list[tuple[str, str | None, list[str]]], repeat: int,
              exp_id: str, exp_dir: Path, parallel: int) -> list[RunSpec]:
    """Every run: each group (label, value, its extra --set) times ``repeat`` seeds from the config's ``job.seed``.

    Each config is loaded here, so a bad value stops the experiment (ConfigError,
    exit 2) before anything runs.
    """
    check_counts(repeat, parallel)
    specs = []
    port_off = parallel > 1 and not any(s.partition("=")[0].strip() == "control.metrics_port" for s in sets)
    slugs = [short_slug(label) for label, _value, _extra in groups]
    for (label, value, extra), name_of in zip(groups, slugs):
        if slugs.count(name_of) > 1:   # data/a_b and data/a/b: one directory and one log each, not shared
            name_of += "-" + hashlib.sha1(label.encode()).hexdigest()[:8]
        cfg = config_mod.load(config, sets + extra)
        for seed in range(cfg.job.seed, cfg.job.seed + repeat):
            name = f"{cfg.job.name}-{label}-seed{seed}"
            home = (exp_dir / "runs" / f"{name_of}-seed{seed}").resolve()
            run_sets = sets + extra + [f"job.seed={seed}", f"run.runs_dir={json.dumps(str(home))}",
                                       f"tracking.run_name={json.dumps(name)}",
                                       f"tracking.group={json.dumps(exp_id)}"]
            if port_off:   # every run starts its own controller: one port each would collide
                run_sets.append("control.metrics_port=0")
            config_mod.load(config, run_sets)   # the run's own settings (its seed, its paths): bad ones stop here
            specs.append(RunSpec(label, value, seed, run_sets, name, home,
                                 exp_dir / "logs" / f"{name_of}-seed{seed}.log", cfg.job.steps))
    return specs


def make_plan(config: str, sets: list[str], groups, repeat: int, exp_id: str, exp_dir: Path,
              asked: int | None) -> Plan:
    cfgs = [config_mod.load(config, sets + extra) for _label, _value, extra in groups]
    shared = any(resolve_url(c.redis.url) is not None for c in cfgs)
    devices = [] if shared else visible_devices()
    parallel, groups_of_devices, notes = choose_parallel(asked, max(c.slots_at_start() for c in cfgs), devices,
                                                        usable_cpus(), shared)
    parallel = min(parallel, len(groups) * repeat)   # a run alone keeps its metrics port
    specs = plan_runs(config, sets, groups, repeat, exp_id, exp_dir, parallel)
    return Plan(config, specs, parallel, groups_of_devices, notes)


def usable_cpus() -> int:
    """The cores this process may run on: fewer than the machine has under a cpuset or ``taskset``, or a CPU
    quota (``docker --cpus``, a Kubernetes CPU limit: ``cgroup.cpu_quota``, rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0)) or 1
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1
    quota = cgroup.cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def experiment_dir(out: str | None, cfg: Config, what: str) -> tuple[Path, str]:
    """``--out`` or ``<runs_dir>/experiments/<time>-<job>-<what>``: a directory that holds no experiment yet."""
    if out:
        path = Path(out)
        bad = argtypes.unwritable("--out", out, directory=True)   # a file there or above it, or no permission
        if bad:
            raise ExperimentError(bad)
        if any((path / f).exists() for f in ("experiment.json", "baseline.json", INVOCATION)):
            raise ExperimentError(f"{path} already holds an experiment; choose another --out (or continue that "
                                  f"one: libra-ctl resume {path})")
        path.mkdir(parents=True, exist_ok=True)
        return path, path.resolve().name   # "--out ." names the directory it is, not ""
    base = Path(cfg.run.runs_dir) / "experiments" / slug(f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.job.name}-{what}")
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path, path.name
        except FileExistsError:   # another experiment started this second
            n += 1
            path = base.with_name(f"{base.name}-{n}")


# --- progress ---------------------------------------------------------------------------------------------


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def eta_s(total: int, done: int, parallel: int, durations: list[float],
          running: list[tuple[float, float | None]]) -> float | None:
    """Seconds left: runs still to start, and the rest of the running ones, ``parallel`` at a time.

    A run's length is the mean of the finished ones; before any finished, the
    running ones' elapsed time over their share of steps done. ``running``:
    (elapsed s, share of steps done or None) per running run.
    """
    if durations:
        per_run = sum(durations) / len(durations)
    else:
        guesses = [el / share for el, share in running if share and share > 0.05]
        if not guesses:
            return None
        per_run = sum(guesses) / len(guesses)
    left = sum(max(per_run - el, 0.0) for el, _share in running)
    queued = max(total - done - len(running), 0)
    return (left + queued * per_run) / max(parallel, 1)


def progress_line(done: int, total: int, running: list[str], elapsed: float, eta: float | None,
                  width: int = 20) -> str:
    filled = int(width * done / total) if total else width
    now = " · ".join(running) if running else "starting"
    return (f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total} runs · {now} · "
            f"{fmt_duration(elapsed)} elapsed · ETA {fmt_duration(eta)}")


_STEPS: dict[Path, tuple[int, int]] = {}   # metrics.jsonl -> (bytes read, the last learner step in them)


def current_step(home: Path) -> int | None:
    """The last learner step of the run under ``home`` (0 before its first), from its metrics.jsonl.

    Each call reads only what was appended since the last one (whole lines;
    the line being written is read next time): a step logged long before the
    sampler's latest lines is still found, and a long file is read once."""
    for path in home.glob("*/metrics.jsonl"):
        offset, step = _STEPS.get(path, (0, 0))
        try:
            with open(path, "rb") as f:
                if f.seek(0, os.SEEK_END) < offset:   # written again from the start
                    offset, step = 0, 0
                f.seek(offset)
                while chunk := f.read(STEP_READ_BYTES):
                    whole = chunk.rfind(b"\n") + 1
                    if whole == 0 and len(chunk) == STEP_READ_BYTES:   # one line longer than a read
                        chunk += f.readline()
                        whole = chunk.rfind(b"\n") + 1
                    for line in chunk[:whole].splitlines():
                        if b'"learner_step"' in line:
                            try:
                                step = int(json.loads(line)["step"])
                            except (ValueError, KeyError, TypeError):
                                continue
                    offset += whole
                    if whole < len(chunk) and (len(chunk) < STEP_READ_BYTES or whole == 0):
                        break   # at the end: a line still being written (any length), read whole next time
                    f.seek(offset)
        except OSError:
            return None
        _STEPS[path] = (offset, step)
        return step
    return None


class Progress:
    """A progress bar redrawn in place on a terminal; a plain line every ``PLAIN_EVERY_S`` otherwise."""

    def __init__(self, total: int, parallel: int, out):
        self.total, self.parallel, self.out = total, parallel, out
        self.tty = out.isatty()
        self.t0 = time.monotonic()
        self.durations: list[float] = []
        self.last_plain = -math.inf
        self.drawn = False

    def say(self, line: str) -> None:
        if self.tty and self.drawn:
            print("\r\033[K", end="", file=self.out)
            self.drawn = False
        print(line, file=self.out, flush=True)

    def show(self, done: int, running: list[tuple[RunSpec, float]]) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last_plain < PLAIN_EVERY_S:
            return
        parts, shares = [], []
        for spec, started in running:
            step = current_step(spec.home)
            parts.append(f"{spec.tag}: " + (f"step {step}/{spec.steps}" if step is not None else "starting"))
            shares.append((now - started, step / spec.steps if step is not None and spec.steps else None))
        line = progress_line(done, self.total, parts, now - self.t0,
                             eta_s(self.total, done, self.parallel, self.durations, shares))
        if self.tty:   # one line, cut to the terminal's width, or \r could not redraw it
            width = shutil.get_terminal_size().columns - 1
            print("\r\033[K" + (line if len(line) <= width else line[:width - 1] + "…"), end="", file=self.out,
                  flush=True)
            self.drawn = True
        else:
            print(line, file=self.out, flush=True)
            self.last_plain = now


# --- running ---------------------------------------------------------------------------------------------


def tail(path: Path, lines: int = LOG_TAIL) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def start_run(config: str, spec: RunSpec, devices: list[str] | None) -> subprocess.Popen:
    """``libra-ctl run`` of one spec in its own process group, output to its log; it dies with us (lifeline).

    A spec with ``resume_dir`` is ``libra-ctl resume`` of that run directory instead, its output added to the log.
    """
    from pipeline.control.agent import GPUS_ENV

    spec.home.mkdir(parents=True, exist_ok=True)
    spec.log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if devices:
        env[GPUS_ENV] = ",".join(devices)
    argv = [sys.executable, "-m", "pipeline.cli", "run", config, *sum((["--set", s] for s in spec.sets), [])]
    if spec.resume_dir is not None:
        argv = [sys.executable, "-m", "pipeline.cli", "resume", str(spec.resume_dir)]
    with open(spec.log, "a" if spec.resume_dir is not None else "w") as log:
        if spec.resume_dir is not None:
            print(f"\n--- libra-ctl resume {spec.resume_dir} ({time.strftime('%Y-%m-%d %H:%M:%S')}) ---", file=log,
                  flush=True)
        # start_new_session: a Ctrl-C at the terminal reaches us alone; we pass it on as SIGINT to the group
        return spawn(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                     start_new_session=True)


def stop_runs(procs: list[subprocess.Popen], wait_s: float | None = None) -> list[int]:
    """SIGINT to each run's process group (a run stops its workers and Redis in order), SIGKILL after ``wait_s``.

    All are asked at once, then waited for. A second Ctrl-C while waiting
    kills the groups still there.
    """
    for proc in procs:
        _signal_group(proc, signal.SIGINT)
    deadline = time.monotonic() + (STOP_WAIT_S if wait_s is None else wait_s)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            codes.append(proc.wait())
        except KeyboardInterrupt:   # the second Ctrl-C: every group still there goes now, not one per Ctrl-C
            deadline = 0.0
            _signal_group(proc, signal.SIGKILL)
            codes.append(proc.wait())
    return codes


def stop_run(proc: subprocess.Popen, wait_s: float | None = None) -> int:
    return stop_runs([proc], wait_s)[0]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)   # the run leads its group (start_new_session): only ours are reached
    except ProcessLookupError:
        pass   # it has ended already


class Runner:
    """Runs a plan's specs, ``parallel`` at a time, reporting each end; ``run()`` returns every outcome."""

    def __init__(self, plan: Plan, out=None, kept: dict[int, Outcome] | None = None):
        """``kept``: outcomes of runs that finished before the experiment was resumed (by plan index)."""
        self.plan, self.out = plan, out or sys.stderr   # looked up now: a test may have replaced sys.stderr
        self.progress = Progress(len(plan.specs), plan.parallel, self.out)
        self.outcomes: dict[int, Outcome] = dict(kept or {})
        self.pending = deque((i, s) for i, s in enumerate(plan.specs) if i not in self.outcomes)
        self.free: list[list[str] | None] = list(plan.devices) or [None] * plan.parallel   # GPUs of a free place
        self.running: dict[int, tuple[RunSpec, subprocess.Popen, float, list[str] | None]] = {}

    def run(self) -> tuple[list[Outcome], bool]:
        """(outcomes in plan order, interrupted); a spec never started has ``code`` None."""
        # Ctrl-C, and SIGTERM as Ctrl-C, even when we were started with SIGINT ignored (a background job of a
        # script): a signal we catch is reset to its default in the runs we start, so they can be stopped too.
        previous = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        interrupted = False
        try:
            while self.pending or self.running:
                self._start_ready()
                self._reap()
                self.progress.show(len(self.outcomes), [(s, t) for s, _p, t, _d in self.running.values()])
                if self.pending or self.running:
                    time.sleep(POLL_S)
        except KeyboardInterrupt:
            interrupted = True
            self._stop_all()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return [self.outcomes.get(i, Outcome(s, None)) for i, s in enumerate(self.plan.specs)], interrupted

    def _start_ready(self) -> None:
        while self.pending and self.free:
            (i, spec), dev = self.pending.popleft(), self.free.pop(0)
            try:
                proc = start_run(self.plan.config, spec, dev)
            except OSError as exc:   # its directory or log cannot be made: recorded as a failed run, the rest go on
                self.free.append(dev)
                why = f"could not start: {exc.strerror or exc}"
                self.outcomes[i] = Outcome(spec, 127, 0.0, why)
                self.progress.say(f"FAILED {spec.tag}: {why}")
                continue
            self.running[i] = (spec, proc, time.monotonic(), dev)
            self.progress.say(("resumed" if spec.resume_dir is not None else "started") + f" {spec.tag}"
                              + (f" on GPUs {','.join(dev)}" if dev else "") + f" (log: {spec.log})")

    def _reap(self) -> None:
        for i, (spec, proc, started, dev) in list(self.running.items()):
            if proc.poll() is None:
                continue
            del self.running[i]
            self.free.append(dev)
            self.outcomes[i] = o = Outcome(spec, proc.returncode, time.monotonic() - started)
            if o.code == 0:
                if spec.resume_dir is None:   # a resumed run's time is only its remainder, no run's length
                    self.progress.durations.append(o.wall_s)
                self.progress.say(f"finished {spec.tag} in {fmt_duration(o.wall_s)}")
            else:
                self.progress.say(f"FAILED {spec.tag} (exit {o.code}); last lines of {spec.log}:\n"
                                  + "\n".join("  | " + line for line in tail(spec.log).splitlines()))

    def _stop_all(self) -> None:
        self.progress.say(f"interrupted: stopping {len(self.running)} running run(s) (SIGINT; up to "
                          f"{STOP_WAIT_S:.0f}s each to stop its workers)")
        codes = stop_runs([proc for _s, proc, _t, _d in self.running.values()])
        for (i, (spec, _proc, started, _dev)), code in zip(self.running.items(), codes):
            self.outcomes[i] = Outcome(spec, code, time.monotonic() - started)
            self.progress.say(f"stopped {spec.tag} (exit {code}); its run directory stays")
        self.running.clear()


# --- resuming -----------------------------------------------------------------------------------------------


def record_invocation(exp_dir: Path, kind: str, exp_id: str, config: str, sets: list[str], **options) -> None:
    """What ``resume`` needs to plan the same runs again: the command's input, the directory it ran in, and a
    digest of the config file (runs still to go must not take an edited one)."""
    write_json(exp_dir / INVOCATION, {"kind": kind, "id": exp_id, "config": config, "cwd": os.getcwd(),
                                      "config_sha256": _digest(Path(config)), "sets": sets, "options": options})


def hold(exp_dir: Path):
    """The experiment's lock (``DIR/.lock``, this pid in it), held while the file stays open; ExperimentError if
    another process holds it: that experiment still runs, and a resume would run its runs a second time."""
    f = open(exp_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise ExperimentError(f"{exp_dir} is still running (libra-ctl experiment or baseline, pid {holder}); "
                              "resume it once that process has ended") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pick_up(plan: Plan) -> dict[int, Outcome]:
    """The runs of a resumed experiment that finished before (kept as they are, by plan index); the ones that
    started and did not finish are set to resume their run directory (``RunSpec.resume_dir``); the rest start
    afresh."""
    from pipeline.run import finished_summary

    kept = {}
    for i, spec in enumerate(plan.specs):
        run_dir = run_dir_of(spec)
        if run_dir is None:
            continue
        if finished_summary(run_dir, spec.steps) is not None:
            kept[i] = Outcome(spec, 0)
        else:
            spec.resume_dir = run_dir
    return kept


def resume(exp_dir: str, stdout=None, err=None) -> int:
    """``libra-ctl resume DIR`` of an experiment or baseline directory: its finished runs are kept, the ones it
    stopped are resumed from their checkpoints (``libra-ctl resume``), the ones never started start; then the
    whole is judged and written as if it had run at once. Returns the exit code."""
    err = err or sys.stderr
    home = Path(check_path("experiment directory", exp_dir)).resolve()
    try:
        inv = json.loads((home / INVOCATION).read_text())
    except FileNotFoundError:
        raise ExperimentError(f"{home} holds no {INVOCATION}: not a directory libra-ctl experiment or baseline "
                              "wrote (or one from before experiments could be resumed)") from None
    except ValueError as exc:
        raise ExperimentError(f"{home / INVOCATION} is damaged ({exc}); the experiment cannot be resumed") from None
    try:
        os.chdir(inv["cwd"])   # the config and the paths in it are as the experiment saw them
    except OSError as exc:
        raise ExperimentError(f"the experiment ran in {inv['cwd']}, which is gone ({exc.strerror})") from None
    config = inv["config"]
    try:
        same = _digest(Path(config)) == inv["config_sha256"]
    except OSError as exc:
        raise ExperimentError(f"the experiment's config {config} cannot be read ({exc.strerror})") from None
    if not same:
        raise ExperimentError(f"{config} changed since the experiment started: the runs still to go would not be "
                              "the ones planned; put it back as it was, or start a new experiment")
    record = home / ("baseline.json" if inv["kind"] == "baseline" else "experiment.json")
    try:
        last = json.loads(record.read_text())
    except (OSError, ValueError):
        last = None
    runs = (last.get("runs") if inv["kind"] == "baseline" else
            [r for g in last.get("groups", []) if g.get("label") != "baseline" or "recorded" not in g
             for r in g.get("runs", [])]) if isinstance(last, dict) else None
    if runs and not last.get("interrupted") and all(r.get("ok") for r in runs):
        print(f"{inv['kind']} {inv['id']} already finished (every run; its figures are in {record}): nothing to "
              "resume", file=err)
        return 0
    opts, at = inv["options"], (home, inv["id"])
    if inv["kind"] == "baseline":
        return baseline(config, inv["sets"], repeat=opts["repeat"], parallel=opts["parallel"], effect=opts["effect"],
                        stdout=stdout, err=err, resuming=at)
    return experiment(config, inv["sets"], opts["vary"], repeat=opts["repeat"], baseline_dir=opts["baseline_dir"],
                      target=opts["target"], parallel=opts["parallel"], effect=opts["effect"], stdout=stdout,
                      err=err, resuming=at)


def say_resumed(plan: Plan, kept: dict[int, Outcome], err) -> None:
    again = sum(1 for s in plan.specs if s.resume_dir is not None)
    print(f"resuming: {len(kept)} run(s) finished before and kept, {again} to resume from their checkpoints, "
          f"{len(plan.specs) - len(kept) - again} to start", file=err, flush=True)


# --- figures of the finished runs --------------------------------------------------------------------------


def run_dir_of(spec: RunSpec) -> Path | None:
    dirs = sorted(p for p in spec.home.glob("*") if (p / "manifest.json").exists()) if spec.home.is_dir() else []
    return dirs[-1] if dirs else None


def run_record(o: Outcome) -> dict:
    """What the experiment keeps of one run: who it was, how it ended, and its figures when it finished."""
    spec = o.spec
    run_dir = run_dir_of(spec)
    rec = {"group": spec.group, "value": spec.value, "seed": spec.seed, "run_name": spec.name,
           "run_dir": str(run_dir) if run_dir else None, "log": str(spec.log), "exit_code": o.code, "ok": False}
    summary_path = run_dir / "summary.json" if run_dir else None
    if o.code is None:
        rec["error"] = "not run (interrupted)"
    elif o.code != 0:
        rec["error"] = o.error or tail(spec.log)
    elif summary_path is None or not summary_path.exists():
        rec["error"] = f"exit 0 but no summary.json under {spec.home}"
    else:
        lines = read_jsonl(run_dir / "metrics.jsonl")
        rec.update(compare.run_figures(json.loads(summary_path.read_text()),
                                       [x for x in lines if x.get("kind") == "learner_step"],
                                       [x for x in lines if x.get("kind") == "sample"]))
        rec["ok"] = True
    return rec


def noise_lines(success: list[float], effect: float) -> tuple[bool | None, float | None, list[str]]:
    """(noisy, noise, lines to print) of the final held-out success over seeds."""
    noisy, level = compare.is_noisy(success, effect), compare.noise(success)
    how = "sd" if len(success) >= 3 else "half range"
    if not success:
        return None, None, ["noise: no run finished to measure it"]
    if noisy is None:
        return None, None, ["noise: one seed cannot measure it; run --repeat 2 or more (3 is the field guide's)"]
    line = f"noise: final held-out success varies by {level:.1%} ({how} over {len(success)} seeds)"
    if not noisy:
        return False, level, [line + f", within the effect to detect ({effect:.1%})"]
    return True, level, [line, f"WARNING: that is more than the effect you hope to detect ({effect:.1%}): this "
                               "environment is too noisy to tune on. Fix it first (a larger job.eval_size, more "
                               "job.steps, more seeds) or look for a larger effect (--effect)."]


def print_unfinished(records: list[dict], out) -> None:
    """A line for each run that did not finish: failed (exit code, last log line) or interrupted."""
    for r in records:
        if r["ok"]:
            continue
        how = ("not run" if r["exit_code"] is None else "interrupted" if r["exit_code"] in (130, -2)
               else f"failed (exit {r['exit_code']})")
        last = r["error"].splitlines()[-1] if r.get("error") else ""
        print(f"{how}: {r['group']} seed {r['seed']}: {last} (log: {r['log']})", file=out)


def say_how_to_resume(records: list[dict], interrupted: bool, exp_dir: Path, out) -> None:
    if interrupted or not all(r["ok"] for r in records):
        print(f"to finish the runs that did not (finished ones are kept): libra-ctl resume {exp_dir}", file=out,
              flush=True)


def _exit_code(records: list[dict], interrupted: bool) -> int:
    return 130 if interrupted else 0 if all(r["ok"] for r in records) else 1


# --- libra-ctl baseline -----------------------------------------------------------------------------------


def baseline(config: str, sets: list[str], *, repeat: int = 3, out: str | None = None, parallel: int | None = None,
             effect: float = compare.DEFAULT_EFFECT, stdout=None, err=None,
             resuming: tuple[Path, str] | None = None) -> int:
    """The whole of ``libra-ctl baseline``; returns the exit code. ``resuming``: the directory and id of the
    baseline ``resume`` continues."""
    stdout, err = stdout or sys.stdout, err or sys.stderr
    check_counts(repeat, parallel)
    check_effect(effect)
    cfg = config_mod.load(config, sets)
    exp_dir, exp_id = resuming or experiment_dir(out, cfg, "baseline")
    lock = hold(exp_dir)   # open until this function returns: a resume meanwhile is refused
    plan = make_plan(config, sets, [("baseline", None, [])], repeat, exp_id, exp_dir, parallel)
    if not resuming:   # once the plan stands: a refused one leaves a directory the same command may use again
        record_invocation(exp_dir, "baseline", exp_id, config, sets, repeat=repeat, parallel=parallel, effect=effect)
    kept = pick_up(plan) if resuming else {}
    seeds = [s.seed for s in plan.specs]
    print(f"baseline {exp_id}: {len(plan.specs)} runs of {config} (seeds {seeds[0]}..{seeds[-1]}), "
          f"{plan.parallel} at a time; in {exp_dir}", file=err, flush=True)
    if resuming:
        say_resumed(plan, kept, err)
    for note in plan.notes:
        print(f"note: {note}", file=err)
    outcomes, interrupted = Runner(plan, err, kept).run()
    records = [run_record(o) for o in outcomes]
    agg = compare.aggregate(records)
    success = [r["success_final"] for r in records if r["ok"] and r.get("success_final") is not None]
    noisy, level, lines = noise_lines(success, effect)
    header, rows = compare.spread_table(agg)
    doc = {"kind": "baseline", "id": exp_id, "config": config, "sets": sets, "seeds": seeds,
           "resolved_config": cfg.to_dict(), "created_at": time.time(), "interrupted": interrupted,
           "runs": records, "spread": agg, "target": agg["success_final"]["mean"],
           "noisy": noisy, "noise": level, "effect": effect}
    write_json(exp_dir / "baseline.json", doc)
    (exp_dir / "table.md").write_text(compare.render_markdown(header, rows))
    print(f"\nbaseline {exp_id}: {agg['ok']}/{agg['runs']} runs finished"
          f"{' (interrupted)' if interrupted else ''}; spread over seeds\n", file=stdout)
    print(compare.render_text(header, rows) if rows else "(no run finished)", file=stdout)
    print("\n" + "\n".join(lines), file=stdout)
    print_unfinished(records, stdout)
    print(f"\nrecorded: {exp_dir / 'baseline.json'}; compare against it with "
          f"libra-ctl experiment {config} --vary KEY=v1,v2 --baseline {exp_dir}", file=stdout, flush=True)
    say_how_to_resume(records, interrupted, exp_dir, stdout)
    lock.close()   # written: a resume may go on now
    return _exit_code(records, interrupted)


# --- libra-ctl experiment ---------------------------------------------------------------------------------


def load_baseline(path: str) -> dict:
    f = Path(path) / "baseline.json" if Path(path).is_dir() else Path(path)
    try:
        doc = json.loads(f.read_text())
    except FileNotFoundError:
        raise ExperimentError(f"--baseline {path}: no baseline.json there (libra-ctl baseline writes it)") from None
    except json.JSONDecodeError as exc:
        raise ExperimentError(f"--baseline {path}: {f} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") != "baseline" or not isinstance(doc.get("runs"), list):
        raise ExperimentError(f"--baseline {path}: {f} is not a baseline recorded by libra-ctl baseline")
    return doc


def flat(tree: dict, prefix: str = "") -> dict:
    """A config tree as {dotted key: value}; a table-valued field (``env.options``) stays one value."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and not prefix:
            out.update(flat(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(base: dict, other: dict, key: str) -> list[str]:
    """Keys (dotted) on which a run's config differs from the baseline's, besides the varied key and per-run keys."""
    a, b = flat(base), flat(other)
    table, _, entry = key.rpartition(".")
    for side in (a, b):   # a varied entry of a table-valued setting (env.options.X): the rest of the table counts
        if isinstance(side.get(table), dict):
            side[table] = {k: v for k, v in side[table].items() if k != entry}
    return sorted(k for k in set(a) | set(b) if k != key and k not in PER_RUN_KEYS and a.get(k) != b.get(k))


def judge(groups: list[dict], base: dict, target: float) -> None:
    """Each group's runs put against ``target``, their aggregate, and the verdict against ``base``, in place."""
    for g in [base] + [g for g in groups if g is not base]:
        g["runs"] = [compare.with_target(r, target) if r.get("ok") else r for r in g["runs"]]
        g["aggregate"] = compare.aggregate(g["runs"])
    for g in groups:
        g["verdict"] = ({"outcome": "baseline", "criteria": [], "summary": "the baseline"} if g is base
                        else compare.verdict(base["aggregate"], g["aggregate"]))


TARGET_TOO_LOW = "is no higher than the baseline's held-out success at the start"


def target_warnings(base: dict, target: float) -> list[str]:
    """What to say of ``target`` against the judged baseline: a target every run reaches at the start."""
    start = base["aggregate"]["success_start"]["mean"]
    if start is None or start < target:
        return []
    return [f"the target ({target:.1%}) {TARGET_TOO_LOW} ({start:.1%}): every run reaches it at once; give a "
            "higher --target"]


def check_target(target: float | None) -> None:
    if target is not None and not 0.0 < target <= 1.0:
        raise ExperimentError(f"--target {target:g}: a held-out success rate in (0, 1], e.g. 0.5")


def check_effect(effect: float) -> None:
    if not (math.isfinite(effect) and 0.0 < effect <= 1.0):
        raise ExperimentError(f"--effect {effect:g}: the smallest change in success worth detecting, in (0, 1], "
                              "e.g. 0.05")


def check_counts(repeat: int, parallel: int | None) -> None:
    """--repeat and --parallel, checked before the experiment's directory is made (none is left behind)."""
    if repeat < 1:
        raise ExperimentError(f"--repeat {repeat}: run each value at least once")
    if parallel is not None and parallel < 1:
        raise ExperimentError(f"--parallel {parallel}: run at least 1 at a time")


def experiment(config: str, sets: list[str], vary: str, *, repeat: int = 1, baseline_dir: str | None = None,
               target: float | None = None, out: str | None = None, parallel: int | None = None,
               effect: float = compare.DEFAULT_EFFECT, stdout=None, err=None,
               resuming: tuple[Path, str] | None = None) -> int:
    """The whole of ``libra-ctl experiment``; returns the exit code. ``resuming``: the directory and id of the
    experiment ``resume`` continues."""
    stdout, err = stdout or sys.stdout, err or sys.stderr
    check_target(target)
    check_counts(repeat, parallel)
    check_effect(effect)
    key, values = parse_vary(vary)
    if key in PER_RUN_KEYS - {"job.seed"}:   # a varied seed is where each value's seeds start
        raise ExperimentError(f"--vary {key}: the experiment sets it for every run (paths, names, ports), so its "
                              "values would never reach the runs; vary another key")
    recorded = load_baseline(baseline_dir) if baseline_dir else None
    cfg = config_mod.load(config, sets)
    for v in values:   # a bad value fails here, before the experiment's directory exists
        config_mod.load(config, sets + [f"{key}={v}"])
    exp_dir, exp_id = resuming or experiment_dir(out, cfg, key)
    lock = hold(exp_dir)   # open until this function returns: a resume meanwhile is refused
    plan = make_plan(config, sets, [(f"{key}={v}", v, [f"{key}={v}"]) for v in values], repeat, exp_id, exp_dir,
                     parallel)
    if not resuming:   # once the plan stands: a refused one leaves a directory the same command may use again
        record_invocation(exp_dir, "experiment", exp_id, config, sets, vary=vary, repeat=repeat,
                          baseline_dir=baseline_dir, target=target, parallel=parallel, effect=effect)
    kept = pick_up(plan) if resuming else {}
    warnings = list(plan.notes)
    if recorded:
        diff = config_differences(recorded.get("resolved_config", {}),
                                  config_mod.load(config, sets + [f"{key}={values[0]}"]).to_dict(), key)
        if diff:
            warnings.append(f"these runs differ from the recorded baseline in more than {key}: {', '.join(diff)}")
    print(f"experiment {exp_id}: {key} in {{{', '.join(values)}}} x {repeat} seed(s) = {len(plan.specs)} runs, "
          f"{plan.parallel} at a time; baseline: "
          f"{'recorded in ' + str(baseline_dir) if recorded else f'the first value ({key}={values[0]})'}; "
          f"in {exp_dir}", file=err, flush=True)
    if resuming:
        say_resumed(plan, kept, err)
    for w in warnings:
        print(f"note: {w}", file=err)
    outcomes, interrupted = Runner(plan, err, kept).run()
    records = [run_record(o) for o in outcomes]
    groups = [{"label": f"{key}={v}", "value": v, "runs": [r for r in records if r["value"] == v]} for v in values]
    if recorded:
        base = {"label": "baseline", "value": None, "recorded": str(baseline_dir), "runs": recorded["runs"]}
        groups.insert(0, base)
        base_source = f"recorded in {baseline_dir}"
    else:
        base, base_source = groups[0], "the first value's runs"
    base_success = [r["success_final"] for r in base["runs"] if r.get("ok") and r.get("success_final") is not None]
    if target is not None:
        target_source = "--target"
    elif base_success:
        target = sum(base_success) / len(base_success)
        target_source = "the baseline's mean final held-out success"
    else:
        target, target_source = 1.0, "100%: no baseline run finished, so there is no baseline mean"
    judge(groups, base, target)
    warnings += target_warnings(base, target)
    noisy, level, lines = noise_lines(base_success, effect)
    if noisy:
        warnings.append(" ".join(lines[1:]))
    if interrupted:
        warnings.append("interrupted: runs that did not finish are missing from the figures")
    doc = {"kind": "experiment", "id": exp_id, "config": config, "sets": sets, "key": key, "values": values,
           "repeat": repeat, "seeds": sorted({r["seed"] for r in records}), "created_at": time.time(),
           "interrupted": interrupted, "baseline": {"label": base["label"], "source": base_source},
           "target": target, "target_source": target_source, "noisy": noisy, "noise": level, "effect": effect,
           "floor": compare.NO_WORSE_FLOOR, "warnings": warnings, "groups": groups}
    write_experiment(doc, exp_dir, stdout)
    say_how_to_resume(records, interrupted, exp_dir, stdout)
    lock.close()   # written: a resume may go on now
    return _exit_code(records, interrupted)


def write_experiment(doc: dict, exp_dir: Path, stdout) -> None:
    """experiment.json, table.md, report.html and curves.svg of a judged experiment (the baseline is its first
    group), and the table and verdicts printed."""
    groups, target = doc["groups"], doc["target"]
    base = groups[0]
    write_json(exp_dir / "experiment.json", doc)
    header, rows = compare.comparison_table(groups, target)
    note = (f"\nmean ± sd over seeds {', '.join(map(str, doc['seeds']))}; target {target:.1%} held-out success "
            f"({doc['target_source']}); baseline: {base['label']} ({doc['baseline']['source']}).\n")
    (exp_dir / "table.md").write_text(compare.render_markdown(header, rows) + note)
    from pipeline.observe import compare_report

    page, svg = compare_report.write(doc, exp_dir)
    base_success = [r["success_final"] for r in base["runs"] if r.get("ok") and r.get("success_final") is not None]
    _noisy, _level, lines = noise_lines(base_success, doc["effect"])
    failed = [r for g in groups for r in g["runs"] if not r.get("ok", True)]
    print_experiment(doc, header, rows, lines, failed, exp_dir, page, svg, stdout)


def rejudge(exp_dir: str, target: float | None = None, stdout=None) -> int:
    """Judge a finished experiment again from its records, with another ``target`` or this version's rules,
    without running anything; rewrites its outputs. Returns the exit code."""
    stdout = stdout or sys.stdout
    home = Path(check_path("experiment directory", exp_dir))
    path = home / "experiment.json"
    if not path.is_file():
        raise ExperimentError(f"{home} holds no experiment.json: give a directory libra-ctl experiment wrote")
    try:
        doc = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as exc:
        raise ExperimentError(f"{path} is not JSON ({exc}): cut short or damaged") from None
    if (not isinstance(doc, dict) or doc.get("kind") != "experiment" or not isinstance(doc.get("groups"), list)
            or not doc["groups"] or not all(isinstance(g, dict) and isinstance(g.get("runs"), list)
                                            for g in doc["groups"])):
        raise ExperimentError(f"{path} is not an experiment's record")
    check_target(target)
    if target is not None:
        doc["target"], doc["target_source"] = target, "--target"
    judge(doc["groups"], doc["groups"][0], doc["target"])
    # the warning about the target judged before is replaced
    doc["warnings"] = ([w for w in doc.get("warnings", []) if TARGET_TOO_LOW not in w]
                       + target_warnings(doc["groups"][0], doc["target"]))
    write_experiment(doc, home, stdout)
    return 0


def print_experiment(doc: dict, header, rows, noise: list[str], failed: list[dict], exp_dir: Path, page: Path,
                     svg: Path, out) -> None:
    print(f"\nexperiment {doc['id']}: {doc['key']}, target {doc['target']:.1%} held-out success "
          f"({doc['target_source']})\n", file=out)
    print(compare.render_text(header, rows), file=out)
    print(f"\nverdict against the baseline ({doc['baseline']['label']}, {doc['baseline']['source']}):", file=out)
    for g in doc["groups"]:
        if g["verdict"]["outcome"] == "baseline":
            continue
        print(f"  {g['label']}: {g['verdict']['summary']}", file=out)
        for c in g["verdict"]["criteria"]:
            mark = "ok" if c["ok"] else "??" if c["ok"] is None else "NO"
            print(f"    [{mark}] {c['name']}: {c['detail']}", file=out)
    print("\n" + "\n".join(noise), file=out)
    for w in doc["warnings"]:
        if not w.startswith("WARNING"):
            print(f"note: {w}", file=out)
    print_unfinished(failed, out)
    print(f"\nwritten: {exp_dir / 'experiment.json'}, {exp_dir / 'table.md'}, {page}, {svg}", file=out, flush=True)


# --- the commands -----------------------------------------------------------------------------------------


class _Once(argparse.Action):
    """An option given at most once: a second ``--vary`` was dropped without a word (argparse keeps the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}): an experiment "
                         f"varies one key, so that a difference has one cause; run one experiment per key")
        setattr(namespace, self.dest, values)


def _guarded(fn, args, **kwargs) -> int:
    try:
        return fn(args.config, args.set or [], **kwargs)
    except ExperimentError as exc:
        print(f"libra-ctl {args.command}: {exc}", file=sys.stderr)
        return 2


def cmd_baseline(args) -> int:
    return _guarded(baseline, args, repeat=args.repeat, out=args.out, parallel=args.parallel, effect=args.effect)


def cmd_experiment(args) -> int:
    return _guarded(experiment, args, vary=args.vary, repeat=args.repeat, baseline_dir=args.baseline,
                    target=args.target, out=args.out, parallel=args.parallel, effect=args.effect)


def cmd_rejudge(args) -> int:
    try:
        return rejudge(args.dir, target=args.target)
    except ExperimentError as exc:
        print(f"libra-ctl rejudge: {exc}", file=sys.stderr)
        return 2


def _common(p, repeat: int) -> None:
    p.add_argument("config", help="job TOML file, e.g. examples/quickstart.toml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field in every run (repeatable)")
    p.add_argument("--repeat", type=int, default=repeat, metavar="K",
                   help=f"seeds per value: job.seed = base, base+1, ... (default {repeat})")
    p.add_argument("--out", metavar="DIR", help="the experiment's directory (default: <run.runs_dir>/experiments/<id>)")
    p.add_argument("--parallel", type=int, metavar="N",
                   help="runs at once (default: as many as fit: the GPUs over a run's slots, else the cores / "
                        f"{CORES_PER_RUN})")
    p.add_argument("--effect", type=float, default=compare.DEFAULT_EFFECT, metavar="S",
                   help="the held-out success difference you hope to detect; seeds that disagree by more make the "
                        f"environment too noisy to tune on (default {compare.DEFAULT_EFFECT})")


def add_commands(sub) -> None:
    b = sub.add_parser("baseline", help="run a job over K seeds; the spread of the four metric kinds, a noise check",
                       description="Run CONFIG --repeat times (job.seed = base, base+1, ...), record baseline.json "
                                   "and print the spread over seeds of throughput, slot use, queues and quality; "
                                   "warn when seeds disagree on held-out success by more than --effect.")
    _common(b, repeat=3)
    b.set_defaults(func=cmd_baseline)
    e = sub.add_parser("experiment", help="vary one config key over values x seeds; compare with the baseline",
                       description="Run CONFIG for every value of one key x --repeat seeds, then compare each value "
                                   "against the baseline (--baseline DIR, else the first value): time to the "
                                   "target success, slot busy share and its fluctuation, queues, reward and success; "
                                   "the field guide's verdict; experiment.json, table.md, report.html, curves.svg.")
    _common(e, repeat=3)
    e.add_argument("--vary", required=True, metavar="KEY=v1,v2", action=_Once,
                   help="the one key to vary and its values, e.g. learner.batch_size=128,256")
    e.add_argument("--baseline", metavar="DIR", help="a baseline recorded by libra-ctl baseline (its directory)")
    e.add_argument("--target", type=float, metavar="S",
                   help="held-out success to time (default: the baseline's mean final held-out success)")
    e.set_defaults(func=cmd_experiment)
    j = sub.add_parser("rejudge", help="judge a finished experiment again from its records (another --target)",
                       description="Recompute an experiment's figures to the target, aggregates and verdicts from "
                                   "its experiment.json, without running anything, and rewrite its table, page "
                                   "and curves.")
    j.add_argument("dir", help="the experiment's directory (holding experiment.json)")
    j.add_argument("--target", type=float, metavar="S", help="held-out success to time (default: the recorded one)")
    j.set_defaults(func=cmd_rejudge)
