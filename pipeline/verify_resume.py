"""``libra-ctl verify-resume CONFIG [--hard]``: kill a run mid-way, resume it, and check nothing was lost or restarted.

Runs the job CONFIG (``libra-ctl run`` in a child process, a fresh run
directory), waits until the learner has written a checkpoint and trained
some steps past it, then kills the learner with SIGKILL (its node agent
restarts it, and it restores the checkpoint) or, with ``--hard``, the whole
run with SIGKILL: the ``libra-ctl run`` process and every process under it,
Redis, controller, agent and workers, as a power cut would; then
``libra-ctl resume`` continues it. Once the run has finished it checks the
accounting and the curves (``pipeline.observe.resume_checks``), prints a
verdict with a sparkline, draws ``verify-resume.png`` in the run directory
and exits 0 on PASS, 1 on FAIL, 2 on bad input.

It only ever kills processes it started: the run's child process and that
process's descendants.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from pipeline import argtypes, config as config_mod
from pipeline.logs import STDERR, STDOUT
from pipeline.config import Config
from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.redisconn import EmbeddedRedis, connect, resolve_url
from pipeline.observe import resume_checks as rc

POLL_S = 0.2
KILL_WAIT_S = 30.0
RUN_LINE = re.compile(r"^run (\S+): ")   # what libra-ctl run prints first: "run <id>: preparing the policy"


class VerifyError(RuntimeError):
    """The run could not be driven to the checks (it failed, or ended before the kill)."""


class BadPlan(ValueError):
    """A config whose run cannot be killed between two checkpoints."""


@dataclass
class Kill:
    mode: str                # "learner" (SIGKILL of the learner) or "hard" (SIGKILL of the whole run)
    at: float                # wall clock of the kill: learner records after it are the resumed learner's
    checkpoint_step: int     # the latest complete checkpoint at the kill: the one the learner restores
    killed: int              # processes killed


def kill_step(cfg: Config, at_step: int | None = None) -> int:
    """The learner step after which to kill: past the middle checkpoint by half an interval, before the next.

    With ``checkpoint_every = e`` and ``steps = n``: the checkpoint
    ``c = max(e, floor(n/2 / e) * e)`` and the kill once step ``c + max(1, e // 2)``
    is trained, so that steps after ``c`` are replayed and some remain after the kill.
    """
    e, n = cfg.learner.checkpoint_every, cfg.job.steps
    if e < 2:
        raise BadPlan(f"learner.checkpoint_every = {e}: every step is checkpointed, so no kill lands between two "
                      "checkpoints; use --set learner.checkpoint_every=2 or more")
    if at_step is None:
        c = max(e, (n // 2) // e * e)
        at_step = c + max(1, e // 2)
        if at_step >= n:
            at_step = e + max(1, e // 2)
    if at_step <= e or at_step % e == 0 or at_step >= n:
        raise BadPlan(f"kill at step {at_step}: it must come after the first checkpoint (step {e}), between two "
                      f"checkpoints (not a multiple of {e}) and before the last step ({n}); "
                      f"raise job.steps or lower learner.checkpoint_every")
    return at_step


class Child:
    """A ``libra-ctl`` command in its own session; its output is echoed with a prefix and kept."""

    def __init__(self, args: list[str], out):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: list[str] = []
        self.out = out
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            print(f"  | {line.rstrip()}", file=self.out, flush=True)

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise VerifyError(f"`libra-ctl {' '.join(self.proc.args[3:])}` did not finish within {timeout_s:.0f}s; "
                              "killed it") from None
        self.reader.join(timeout=5)
        return code

    def tail(self, n: int = 12) -> str:
        return "\n".join(self.lines[-n:])


def find_run_dir(run: Child, cfg: Config, timeout_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(run.lines):
            m = RUN_LINE.match(line)
            if m:
                return (Path(cfg.run.runs_dir) / m.group(1)).resolve()
        if run.proc.poll() is not None:
            raise VerifyError(f"the run exited with {run.proc.returncode} before it named its directory:\n{run.tail()}")
        time.sleep(POLL_S)
    raise VerifyError(f"the run named no run directory within {timeout_s:.0f}s")


def wait_for_kill_point(run: Child, run_dir: Path, at_step: int, timeout_s: float) -> None:
    """Until the learner has trained ``at_step`` with a complete checkpoint before it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            raise VerifyError(f"the run exited with {run.proc.returncode} before step {at_step}, the kill point:\n"
                              f"{run.tail()}")
        last = max((r["step"] for r in rc.learner_steps(run_dir)), default=0)
        ckpt = rc.latest_complete_step(run_dir)
        if ckpt is not None and last >= at_step and last > ckpt:
            return
        time.sleep(POLL_S)
    raise VerifyError(f"the learner did not reach step {at_step} within {timeout_s:.0f}s")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_learner(run: Child, run_dir: Path) -> Kill:
    """SIGKILL the learner process under the run (rank 0, ``python -m workers.learner``)."""
    learners = [p for p in descendants(run.proc.pid) if _is_learner(p)]
    if not learners:
        raise VerifyError("no learner process under the run to kill")
    checkpoint = rc.latest_complete_step(run_dir)
    for p in learners:
        p.send_signal(signal.SIGKILL)
    _wait_gone(learners)
    at = time.time()     # a record stamped before the learner was gone is the killed learner's
    # A checkpoint being renamed into place as the signal landed is complete, and is the one restored.
    return Kill("learner", at, rc.latest_complete_step(run_dir) or checkpoint, len(learners))


def _is_learner(p: psutil.Process) -> bool:
    try:
        cmd = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return "-m" in cmd and "workers.learner" in cmd


def kill_run(run: Child, run_dir: Path) -> Kill:
    # the kill's time is when the last process stood stopped: a step the learner ended while the others were
    # being stopped (seconds on a loaded machine) is the killed run's, though stamped after the kill began
    n, at = kill_tree(run.proc.pid)
    run.proc.wait()
    return Kill("hard", at, rc.latest_complete_step(run_dir), n)


def kill_tree(pid: int) -> tuple[int, float]:
    """SIGKILL ``pid`` and every process under it, at once; returns how many, and when all stood stopped.

    Each process is stopped (SIGSTOP) before its children are listed, so none
    can start one that is missed; then all are killed together, so none sees
    another die first and reacts (a supervisor restarting a worker).
    """
    stopped: dict[int, psutil.Process] = {}
    todo = [pid]
    while todo:
        try:
            p = psutil.Process(todo.pop())
            p.suspend()
            stopped[p.pid] = p
            todo += [c.pid for c in p.children() if c.pid not in stopped]
        except psutil.NoSuchProcess:
            continue
    all_stopped = time.time()
    for p in stopped.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_gone(list(stopped.values()))
    return len(stopped), all_stopped


def _wait_gone(procs: list[psutil.Process]) -> None:
    """Until each has exited (a zombie has: its parent may be gone, and nobody here reaps it)."""
    deadline = time.monotonic() + KILL_WAIT_S
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            raise VerifyError(f"process {p.pid} was sent SIGKILL and did not exit within {KILL_WAIT_S:.0f}s")


# --- the checks ---------------------------------------------------------------------------------


def open_job_redis(cfg: Config, run_dir: Path):
    """A client of the finished run's Redis: its embedded server restarted from its AOF, or the external one."""
    recorded = json.loads((run_dir / "manifest.json").read_text()).get("redis", {})
    if recorded.get("embedded", resolve_url(cfg.redis.url) is None):
        try:
            server = EmbeddedRedis(run_dir / "redis", maxmemory=cfg.redis.maxmemory,
                                   appendfsync=cfg.redis.appendfsync).start()
        except RuntimeError as exc:   # another server holds the directory, or the AOF does not load
            raise VerifyError(f"cannot restart the run's Redis for the checks: {exc}") from None
        return connect(server.url), server
    return connect(resolve_url(cfg.redis.url) or recorded["url"]), None


def read_evals(r, keys: JobKeys) -> list[dict]:
    return [{"tag": f[b"tag"].decode(), "version": int(f[b"version"]), "success_rate": float(f[b"success_rate"]),
             "n": int(f.get(b"n", 0)), "at": float(f.get(b"at", 0))} for _i, f in r.xrange(keys.eval_results)]


def judge(cfg: Config, run_dir: Path, kill: Kill, finished: rc.Check) -> tuple[list[rc.Check], rc.Split, list[dict]]:
    """Every check on the finished run: accounting first, then the curves."""
    keys = JobKeys(cfg.job.name)
    split = rc.split_at(rc.learner_steps(run_dir), kill.at, kill.checkpoint_step, cfg.job.steps)
    r, server = open_job_redis(cfg, run_dir)
    try:
        audit_check, _a = rc.check_audit(r, cfg.job.name, run_dir)
        checks = [finished, audit_check, rc.check_checkpoints(run_dir, split.final),
                  rc.check_offsets(r, keys, run_dir, cfg.streams.max_message_bytes)]
        evals = read_evals(r, keys)
    finally:
        if server is not None:
            server.stop()
    ckpt_version = int(rc.checkpoint_state(run_dir, kill.checkpoint_step)["version"])
    checks += [rc.check_weights(run_dir, kill.at), rc.check_steps(split), rc.check_versions(split, ckpt_version)]
    checks += curve_checks(split, evals, kill, ckpt_version)
    return checks, split, evals


def curve_checks(split: rc.Split, evals: list[dict], kill: Kill, ckpt_version: int) -> list[rc.Check]:
    win, final = rc.windows(split), split.final
    out = []
    for key, name in (("reward_mean", "reward"), ("success_rate", "batch success")):
        levels = [rc.step_level(final, win[w], key) if win else None for w in ("initial", "checkpoint", "resumed")]
        out.append(rc.check_level(name, *levels))
    restored = split.post[0]["policy_version"] - 1 if split.post else ckpt_version + 1
    out.append(rc.check_level("held-out eval", *rc.eval_levels(evals, kill.at, ckpt_version, restored)))
    return out


# --- the command --------------------------------------------------------------------------------


def verify_resume(config: str, overrides: list[str], *, hard: bool = False, at_step: int | None = None,
                  json_out: str | None = None, timeout_s: float = 3600.0, out=STDOUT, err=STDERR) -> int:
    """The whole of ``libra-ctl verify-resume``; returns the exit code."""
    cfg = config_mod.load(config, overrides)   # a ConfigError is the CLI's exit 2
    try:
        target = kill_step(cfg, at_step)
    except BadPlan as exc:
        print(f"libra-ctl verify-resume: {exc}", file=err)
        return 2
    how = "SIGKILL of the whole run" if hard else "SIGKILL of the learner"
    print(f"verify-resume: running {config}; {how} once step {target} is trained", file=err, flush=True)
    children = [Child(["run", config, *sum((["--set", s] for s in overrides), [])], err)]
    run, run_dir, kill = children[0], None, None
    try:
        run_dir = find_run_dir(run, cfg, timeout_s)
        wait_for_kill_point(run, run_dir, target, timeout_s)
        kill = kill_run(run, run_dir) if hard else kill_learner(run, run_dir)
        print(f"verify-resume: killed {kill.killed} process(es) after step "
              f"{max(r['step'] for r in rc.learner_steps(run_dir))}; checkpoint {kill.checkpoint_step} "
              f"to restore", file=err, flush=True)
        finished = finish(children, run_dir, hard, timeout_s, err)
        checks, split, evals = judge(cfg, run_dir, kill, finished)
    except VerifyError as exc:
        _end(children, signal.SIGKILL)
        checks, split, evals = [rc.Check("run", False, str(exc))], None, []
    except Exception as exc:   # noqa: BLE001 - the run lives in its own session: never leave it behind
        _end(children, signal.SIGKILL)
        checks, split, evals = [rc.Check("run", False, f"verify-resume could not go on: "
                                                       f"{type(exc).__name__}: {exc}")], None, []
    except KeyboardInterrupt:
        # the children run in their own sessions: Ctrl-C reaches only us. SIGTERM stops a run in order.
        _end(children, signal.SIGTERM)
        print(f"\nverify-resume: interrupted; the run was stopped{f' ({run_dir})' if run_dir else ''}", file=err)
        return 130
    return report(cfg, config, overrides, run_dir, kill, checks, split, evals, json_out, out)


def _end(children: list[Child], sig: int) -> None:
    """Stop the children still running: SIGTERM lets a run stop its workers; SIGKILL takes the whole tree."""
    for c in children:
        if c.proc.poll() is None:
            if sig == signal.SIGKILL:
                kill_tree(c.proc.pid)
            else:
                c.proc.send_signal(sig)
            c.proc.wait()


def finish(children: list[Child], run_dir: Path, hard: bool, timeout_s: float, err) -> rc.Check:
    """Let the run finish (the learner restarted by its agent), or resume it after a hard kill."""
    run = children[0]
    if not hard:
        code = run.wait(timeout_s)
        if code != 0:
            raise VerifyError(f"the run exited with {code} after the learner was killed:\n{run.tail()}")
        return rc.Check("run", True, "finished after the learner was killed (its agent restarted it)")
    print(f"verify-resume: libra-ctl resume {run_dir}", file=err, flush=True)
    resumed = Child(["resume", str(run_dir)], err)
    children.append(resumed)
    code = resumed.wait(timeout_s)
    if code != 0:
        raise VerifyError(f"libra-ctl resume exited with {code}:\n{resumed.tail()}")
    return rc.Check("run", True, "killed whole with SIGKILL, then `libra-ctl resume` finished it")


def report(cfg: Config, config: str, overrides: list[str], run_dir: Path | None, kill: Kill | None,
           checks: list[rc.Check], split: rc.Split | None, evals: list[dict], json_out: str | None, out) -> int:
    failed = [c.name for c in checks if c.ok is False]
    verdict = "FAIL" if failed else "PASS"
    where = f" ({run_dir})" if run_dir else ""
    lines = [f"verify-resume: {verdict}{where}"]
    if kill and split:
        lines.append(f"  {'SIGKILL of the whole run' if kill.mode == 'hard' else 'SIGKILL of the learner'} after "
                     f"step {split.kill_step}; resumed from checkpoint {split.checkpoint_step}; "
                     f"{cfg.job.steps} steps in all")
    lines += [c.line() for c in checks]
    plot_path = None
    if split and run_dir:
        lines += rc.spark_lines(split, "reward_mean", "reward") + rc.spark_lines(split, "success_rate", "success")
        try:
            plot_path = draw(run_dir, split, evals, kill, verdict)
            lines.append(f"  plot: {plot_path}")
        except ImportError:   # matplotlib is an extra: the verdict stands without its picture
            lines.append("  plot: skipped, matplotlib is not installed (pip install -e '.[plot]')")
    if failed:
        lines.append(f"FAILED: {', '.join(failed)}")
    print("\n".join(lines), file=out, flush=True)
    if json_out:
        doc = {"verdict": verdict, "failed": failed, "config": config, "overrides": overrides,
               "run_dir": str(run_dir) if run_dir else None, "kill": asdict(kill) if kill else None,
               "kill_step": split.kill_step if split else None,
               "checks": [asdict(c) for c in checks], "plot": str(plot_path) if plot_path else None}
        Path(json_out).write_text(json.dumps(doc, indent=2))
    return 1 if failed else 0


def draw(run_dir: Path, split: rc.Split, evals: list[dict], kill: Kill, verdict: str) -> Path:
    version_step = {0: 0, **{r["policy_version"]: r["step"] for r in split.pre + split.post}}
    if split.post:
        version_step[split.post[0]["policy_version"] - 1] = split.checkpoint_step   # the restore's own version
    how = "kill -9 of the run, libra-ctl resume" if kill.mode == "hard" else "SIGKILL of the learner, agent restart"
    return rc.plot(run_dir / "verify-resume.png", split, evals, version_step,
                   f"verify-resume {verdict}: {run_dir.name} ({how})")


def cmd_verify_resume(args) -> int:
    bad_out = argtypes.unwritable("--json", args.json)   # checked before a run of minutes, not after it
    if bad_out:
        print(f"libra-ctl verify-resume: {bad_out}", file=sys.stderr)
        return 2
    return verify_resume(args.config, args.set or [], hard=args.hard, at_step=args.kill_at_step,
                         json_out=args.json, timeout_s=args.timeout)


def add_commands(sub) -> None:
    p = sub.add_parser("verify-resume", help="run a job, kill it mid-run, resume it; check accounting and curves")
    p.add_argument("config", help="job TOML file, e.g. examples/quickstart.toml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--hard", action="store_true",
                   help="kill the whole run (libra-ctl run and every process under it) with SIGKILL, then "
                        "libra-ctl resume it (default: SIGKILL the learner; its agent restarts it)")
    p.add_argument("--kill-at-step", type=argtypes.count, metavar="N",
                   help="kill once step N is trained (default: half a checkpoint interval past the middle checkpoint)")
    p.add_argument("--json", metavar="OUT", help="write the verdict as JSON to OUT")
    p.add_argument("--timeout", type=argtypes.seconds, default=3600.0, metavar="S",
                   help="give up on each phase (run to the kill, run to the end, resume) after S seconds")
    p.set_defaults(func=cmd_verify_resume)
