"""Experiment tracking: a run's metrics as TensorBoard event files and, when wandb is installed, a W&B run.

``libra-ctl run`` and ``libra-ctl resume`` (``pipeline.run``) start one
tracker per run with ``start_tracker``: a daemon thread in the orchestrator
process that follows ``runs/<id>/metrics.jsonl`` by byte offset (the
learner's ``learner_step`` lines, the sampler's ``sample`` lines) and the
job's held-out evaluations in Redis (``JobKeys.eval_results``), and writes
what is new to its sinks:

- TensorBoard event files in ``runs/<id>/tensorboard/`` (``tracking.tensorboard``);
- a W&B run in ``runs/<id>/wandb/`` when ``wandb`` imports and
  ``tracking.wandb`` is not ``off``: offline unless ``$WANDB_MODE`` (for
  ``auto``) or ``tracking.wandb = "online"`` says otherwise.

Three x axes: learner steps (``train/step``) for the per-step lines, seconds
since the run's manifest was written (``sample/elapsed_s``) for the samples,
and the policy version (``eval/policy_version``) for the evaluations.

The run directory stays the source of truth. The tracker keeps its place in
``runs/<id>/tracking.json`` (byte offset, evaluation cursor, W&B run id),
saved after each flush of its sinks, so a resumed run appends: a new event
file in the same directory, the same W&B run id. A sink that fails (wandb
crashes, the disk fills) is reported once and dropped; the run goes on.

The pure parts (``step_scalars``, ``sample_scalars``, ``wandb_mode``,
``JsonlTail``) are tested on plain data (``tests/test_tracking.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import redis
import structlog

from pipeline.config import Config
from pipeline.dataplane.keys import JobKeys
from pipeline.redaction import redact_tree

STATE_FILE = "tracking.json"
POLL_S = 5.0              # seconds between polls of metrics.jsonl and the evaluations
READ_MAX = 4 << 20        # bytes of metrics.jsonl read at a time (a resumed run may have a long backlog)
CLOSE_WAIT_S = 120.0      # how long the end of a run waits for the sinks to flush (W&B online uploads)
WANDB_PROJECT = "libra"   # unless $WANDB_PROJECT names another

STEP_AXIS, SAMPLE_AXIS, EVAL_AXIS = "train/step", "sample/elapsed_s", "eval/policy_version"

# learner_step keys by their section; any other numeric key goes under train/.
STEP_SECTIONS = (("staleness_", "stale"), ("dropped_", "stale"), ("duplicates_", "stale"),
                 ("diversity_", "diversity"), ("tool_", "tools"))
STEP_TIMES = ("wait_s", "train_s", "publish_s")
STEP_SKIP = ("kind", "at", "step")
# sample sections flattened whole; resources are flattened by role, node and GPU, not per worker id
# (ids come and go), and quality is not (it aggregates the learner steps logged one by one).
SAMPLE_SECTIONS = ("throughput", "queues", "allocation", "workers", "counters")

log = structlog.get_logger("tracking")


# --- what is logged ------------------------------------------------------------------------------


def run_name(cfg: Config) -> str:
    return cfg.tracking.run_name or f"{cfg.job.name}-seed{cfg.job.seed}"


def wandb_mode(setting: str, env: Mapping[str, str]) -> str | None:
    """The W&B mode for ``tracking.wandb``, or None for no W&B run (off, disabled, or not installed)."""
    if setting == "off" or importlib.util.find_spec("wandb") is None:
        return None
    mode = (env.get("WANDB_MODE") or "offline") if setting == "auto" else setting
    return None if mode == "disabled" else mode


def _flatten(prefix: str, value, out: dict[str, float]) -> None:
    """Every numeric scalar under ``value`` as ``prefix/key/...``; strings, booleans and None are left out."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}", v, out)


def step_section(key: str) -> str:
    if key in STEP_TIMES:
        return "time"
    return next((section for start, section in STEP_SECTIONS if key.startswith(start)), "train")


def step_scalars(line: dict) -> dict[str, float]:
    """The numeric scalars of a ``learner_step`` line, tagged ``section/key`` (e.g. ``train/loss``)."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if key not in STEP_SKIP:
            _flatten(f"{step_section(key)}/{key}", value, out)
    return out


def sample_scalars(sample: dict) -> dict[str, float]:
    """The numeric scalars of a ``sample`` line: throughput, queues, allocation, workers, counters, resources."""
    out: dict[str, float] = {}
    for section in SAMPLE_SECTIONS:
        _flatten(section, sample.get(section), out)
    res = sample.get("resources") or {}
    for role, figures in (res.get("by_role") or {}).items():
        _flatten(f"resources/{role}", figures, out)
    _flatten("resources/node", res.get("node"), out)
    for i, gpu in enumerate(res.get("gpus") or []):
        _flatten(f"resources/gpu{gpu.get('index', i)}", {k: v for k, v in gpu.items() if k != "index"}, out)
    return out


def eval_scalars(fields: dict) -> tuple[int, dict[str, float], float | None]:
    """(policy version, scalars, unix time) of an ``eval_results`` entry; an evaluation that judged no
    episode (``n`` 0) has no success rate to log, only its count."""
    at = fields.get(b"at")
    n = fields.get(b"n")
    judged = n is None or int(n) > 0
    return (int(fields[b"version"]),
            {**({"eval/success_rate": float(fields[b"success_rate"])} if judged else {}),
             "eval/prompts": float(n or 0)},
            float(at) if at else None)


# --- following metrics.jsonl ---------------------------------------------------------------------


class JsonlTail:
    """The complete lines appended to a JSONL file since ``offset``; a partial last line waits for its end.

    A line longer than ``READ_MAX`` is skipped whole once it is complete (no
    metric row is that long; reading it would hold the tail there for good).
    """

    def __init__(self, path: Path, offset: int = 0):
        self.path, self.offset = path, offset

    def read(self) -> list[dict]:
        rows: list[dict] = []
        while True:
            try:
                with open(self.path, "rb") as f:
                    if os.fstat(f.fileno()).st_size < self.offset:
                        self.offset = 0   # not the file we were reading: start it again
                    f.seek(self.offset)
                    chunk = f.read(READ_MAX)
                    if len(chunk) == READ_MAX and b"\n" not in chunk:
                        end = _line_end(f)
                        if end is None:
                            return rows   # the long line is still being written
                        self.offset = end
                        continue
            except FileNotFoundError:
                return rows
            complete = chunk[:chunk.rfind(b"\n") + 1]
            self.offset += len(complete)
            rows += _parse(complete)
            if len(chunk) < READ_MAX or not complete:
                return rows


def _line_end(f) -> int | None:
    """The offset just past the next newline from ``f``'s position, None when the file ends first."""
    while chunk := f.read(READ_MAX):
        at = chunk.find(b"\n")
        if at >= 0:
            return f.tell() - len(chunk) + at + 1
    return None


def _parse(data: bytes) -> list[dict]:
    rows = []
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue   # a line cut short by a crash, then continued by the next writer
        if isinstance(row, dict):
            rows.append(row)
    return rows


# --- sinks -----------------------------------------------------------------------------------------


class TensorBoardSink:
    """Scalars in event files under ``runs/<id>/tensorboard``; a resumed run adds a file to the same directory."""

    name = "tensorboard"

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter   # deferred: torch loads in the tracker's thread

        self.log_dir = log_dir
        self.writer = SummaryWriter(str(log_dir), flush_secs=int(POLL_S))

    def describe(self, name: str, config: dict) -> None:
        self.writer.add_text("run", f"**{name}**\n\n```json\n{json.dumps(config, indent=2)}\n```", 0)

    def log(self, axis: str, x: int, scalars: dict[str, float], at: float | None) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, x, walltime=at)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, summary: dict | None) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per run directory (its id kept in ``tracking.json``); files under ``runs/<id>/wandb``."""

    name = "wandb"

    def __init__(self, run_dir: Path, mode: str, run_id: str, *, project: str, name: str, group: str, job: str,
                 config: dict):
        import wandb

        self.run = wandb.init(
            dir=str(run_dir), mode=mode, id=run_id, resume="allow", reinit="create_new",
            project=project, name=name, group=group or None,
            tags=[job], job_type="train", config=config, notes=f"libra run {run_dir.name}",
            # console="off": the run's terminal is its progress line; W&B would wrap stdout and stderr
            settings=wandb.Settings(console="off", silent=True))
        self.defined: set[str] = set()

    def describe(self, name: str, config: dict) -> None:
        pass   # name and config went to wandb.init

    def log(self, axis: str, x: int, scalars: dict[str, float], at: float | None) -> None:
        # Each row carries its own x; define_metric binds each key to it, so the three axes never mix.
        for key in scalars.keys() - self.defined:
            self.run.define_metric(key, step_metric=axis)
        self.defined |= scalars.keys()
        self.run.log({axis: x, **scalars})

    def flush(self) -> None:
        pass   # wandb writes in its own process

    def close(self, summary: dict | None) -> None:
        for key, value in (summary or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.run.summary[f"run/{key}"] = value
        self.run.finish()


# --- the tracker -----------------------------------------------------------------------------------


class Tracker:
    """Follows one run directory (and its job's evaluations) into TensorBoard and W&B.

    ``poll()`` opens the sinks the first time, then logs what is new;
    ``close()`` polls once more and closes them. Neither raises for a sink.
    """

    def __init__(self, cfg: Config, run_dir: Path, r: redis.Redis | None = None, *,
                 say: Callable[[str], None] | None = None, env: Mapping[str, str] = os.environ):
        self.cfg, self.run_dir, self.r, self.env = cfg, Path(run_dir), r, env
        self.say = say or (lambda line: log.info("tracking", message=line))
        self.state = self._load_state()
        self.tail = JsonlTail(self.run_dir / "metrics.jsonl", self.state["offset"])
        self.sinks: list = []
        self.opened = False
        self.warned: set[str] = set()

    # --- state ---

    def _load_state(self) -> dict:
        try:
            state = json.loads((self.run_dir / STATE_FILE).read_text())
        except (OSError, ValueError):   # none yet, unreadable or cut short: follow the run from its start
            state = {}
        if not isinstance(state, dict):
            state = {}
        return {"offset": 0, "eval_cursor": "0-0", "t0": _created_at(self.run_dir), "wandb_id": None,
                "described": False, **state}

    def _save_state(self) -> None:
        self.state["offset"] = self.tail.offset
        path = self.run_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.state))
            os.replace(tmp, path)   # a crash leaves the old state or the new one, never half of one
        except OSError as exc:
            self.warn_once("state", f"cannot save {path} ({exc}); a resumed run may log some records again")

    def warn_once(self, what: str, message: str) -> None:
        if what not in self.warned:
            self.warned.add(what)
            self.say(f"tracking: {message}")

    # --- sinks ---

    def open(self) -> None:
        self.opened = True
        before = self._described_before()   # looked at before this start's sinks add files of their own
        if self.cfg.tracking.tensorboard:
            self._add_sink("tensorboard", lambda: TensorBoardSink(self.run_dir / "tensorboard"))
        mode = wandb_mode(self.cfg.tracking.wandb, self.env)
        if mode is None and self.cfg.tracking.wandb in ("offline", "online"):
            self.say(f"tracking: tracking.wandb = {self.cfg.tracking.wandb!r} but wandb is not installed "
                     f"(pip install 'libra[wandb]'); no W&B run")
        if mode is not None:
            self.state["wandb_id"] = self.state["wandb_id"] or secrets.token_hex(4)
            self._add_sink("wandb", lambda: WandbSink(
                self.run_dir, mode, self.state["wandb_id"], project=self.env.get("WANDB_PROJECT") or WANDB_PROJECT,
                name=run_name(self.cfg), group=self.cfg.tracking.group, job=self.cfg.job.name,
                config=redact_tree(self.cfg.to_dict())))
        # per sink: a run resumed with W&B turned on describes the W&B run, though TensorBoard was described
        described = self.state["described"]
        done = set(described) if isinstance(described, list) else before if described else set()
        self._each(lambda s: s.describe(run_name(self.cfg), redact_tree(self.cfg.to_dict())),
                   only=lambda s: s.name not in done)
        self.state["described"] = sorted(done | {s.name for s in self.sinks})
        if self.sinks:
            self.say("tracking: " + "; ".join(self._where(s, mode) for s in self.sinks))

    def _described_before(self) -> set[str]:
        """What an older state's ``described: true`` stood for: it was set at the first start whatever sinks
        ran then, so a sink counts as described only where it left files (event files, a W&B run id)."""
        done = set()
        if any((self.run_dir / "tensorboard").glob("events.out.tfevents.*")):
            done.add("tensorboard")
        if self.state.get("wandb_id"):
            done.add("wandb")
        return done

    def _where(self, sink, mode: str | None) -> str:
        if sink.name == "tensorboard":
            return f"TensorBoard events in {sink.log_dir} (tensorboard --logdir {self.run_dir.parent})"
        sync = f", sync with: wandb sync {self.run_dir / 'wandb'}/offline-run-*" if mode == "offline" else ""
        return f"W&B run {self.state['wandb_id']} ({mode}) in {self.run_dir / 'wandb'}{sync}"

    def _add_sink(self, name: str, make: Callable) -> None:
        try:
            self.sinks.append(make())
        except Exception as exc:   # noqa: BLE001 - a third-party library's failure of any kind must not end the run
            self.say(f"tracking: {name} could not start ({type(exc).__name__}: {exc}); the run goes on without it")

    def _each(self, act: Callable, only: Callable = lambda sink: True) -> None:
        """``act(sink)`` for every sink (that ``only`` admits); a sink that raises is reported once and dropped."""
        for sink in [s for s in self.sinks if only(s)]:
            try:
                act(sink)
            except Exception as exc:   # noqa: BLE001 - wandb or the disk may fail any way; metrics.jsonl has it all
                self.sinks.remove(sink)
                self.say(f"tracking: {sink.name} failed ({type(exc).__name__}: {exc}); dropped for the rest "
                         f"of the run (metrics.jsonl has every figure)")

    # --- polling ---

    def poll(self) -> int:
        """Log the lines and evaluations recorded since the last poll; returns how many records were logged."""
        if not self.opened:
            self.open()
        n = 0
        try:
            rows = self.tail.read()
        except OSError as exc:
            rows = []
            self.warn_once("read", f"cannot read {self.tail.path} ({exc}); trying again at each poll")
        for row in rows:
            n += self._log_line(row)
        n += self._log_evals()
        self._each(lambda s: s.flush())
        self._save_state()
        return n

    def _log_line(self, row: dict) -> int:
        at = row.get("at")
        if row.get("kind") == "learner_step" and "step" in row:
            axis, x, scalars = STEP_AXIS, int(row["step"]), step_scalars(row)
        elif row.get("kind") == "sample" and at is not None:
            axis, x, scalars = SAMPLE_AXIS, int(round(at - self.state["t0"])), sample_scalars(row)
        else:
            return 0   # a kind this tracker does not know
        self._each(lambda s: s.log(axis, x, scalars, at))
        return 1

    def _log_evals(self) -> int:
        if self.r is None:
            return 0
        try:
            entries = self.r.xrange(JobKeys(self.cfg.job.name).eval_results, min="(" + self.state["eval_cursor"])
        except redis.RedisError:
            return 0   # Redis is away: the orchestrator says so; these evaluations come at the next poll
        for entry_id, fields in entries:
            version, scalars, at = eval_scalars(fields)
            self._each(lambda s: s.log(EVAL_AXIS, version, scalars, at))
            self.state["eval_cursor"] = entry_id.decode()
        return len(entries)

    def close(self, summary: dict | None = None) -> None:
        """Poll once more, then close the sinks (W&B gets ``summary``'s numbers as its run summary)."""
        self.poll()
        self._each(lambda s: s.close(summary))
        self.sinks = []


def _created_at(run_dir: Path) -> float:
    """When the run began (its manifest's ``created_at``): time zero of the samples' axis."""
    try:
        return float(json.loads((run_dir / "manifest.json").read_text())["created_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return time.time()


# --- running it ------------------------------------------------------------------------------------


class TrackerHandle:
    """A tracker polled every ``interval_s`` in a daemon thread; ``stop()`` polls once more and closes it."""

    def __init__(self, tracker: Tracker, interval_s: float = POLL_S):
        self.tracker, self.interval_s = tracker, interval_s
        self.summary: dict | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="tracker")

    def start(self) -> "TrackerHandle":
        self.thread.start()
        return self

    def _run(self) -> None:
        # Everything the tracker does happens in this thread: W&B's start (up to its init timeout
        # online) never holds the run up, and the sinks never see two threads.
        try:
            self.tracker.poll()
            while not self._stop.wait(self.interval_s):
                self.tracker.poll()
            self.tracker.close(self.summary)
        except Exception as exc:   # noqa: BLE001 - the last guard: tracking never takes the run down with it
            self.tracker.say(f"tracking stopped ({type(exc).__name__}: {exc}); metrics.jsonl has every figure")

    def stop(self, summary: dict | None = None, timeout_s: float = CLOSE_WAIT_S) -> None:
        self.summary = summary
        self._stop.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.tracker.say(f"tracking: the sinks did not close within {timeout_s:.0f}s; TensorBoard or W&B may "
                             f"miss the last records (metrics.jsonl has them)")


def start_tracker(cfg: Config, run_dir: Path, r: redis.Redis | None = None, *,
                  say: Callable[[str], None] | None = None, interval_s: float = POLL_S) -> TrackerHandle | None:
    """Follow ``run_dir`` into TensorBoard and W&B from a daemon thread; None when tracking is off."""
    if not cfg.tracking.tensorboard and cfg.tracking.wandb == "off":
        return None
    return TrackerHandle(Tracker(cfg, run_dir, r, say=say), interval_s).start()
