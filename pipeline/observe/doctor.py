"""``libra-ctl doctor``: name the bottleneck, with its evidence and a suggested action.

It follows the field guide's troubleshooting order (logs, then inputs, then
resources, then the balance of the pipeline) and its table of symptoms over a
window of metric samples, learner steps and log lines. ``diagnose`` is a pure
function of those that runs the checks of ``pipeline.observe.doctor_checks``,
so each symptom is tested by injecting it; ``gather`` collects them from a
live job (Redis and its run directory) or from a finished run's directory
alone. Run by a user from any machine that reaches the job's Redis, or on a
copied run directory. Where several jobs share the Redis, each running job
gets its own diagnosis unless ``--job`` names one.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline import argtypes
from pipeline.logs import output_lines
from pipeline.observe.doctor_checks import CHECKS, SCALE, SEVERITY, STEPS, Diagnosis, Thresholds, Window, get_in


def diagnose(samples: list[dict], logs: list = (), *, steps: list[dict] = (), config: dict | None = None,
             dead_letter_reasons: dict | None = None, thresholds: Thresholds = Thresholds(),
             scale: str = SCALE, since: float | None = None) -> Diagnosis:
    """Findings over one window: metric samples, learner steps, log lines (structlog dicts or raw text).

    ``config`` is the run's resolved config (the manifest's ``config``), used
    to name the knob in each action; ``dead_letter_reasons`` maps a reason to
    its count among recent dead letters; ``scale`` is the command line an
    action suggests for pinning counts (``libra-ctl scale --job J`` where
    several jobs run, as ``scale`` refuses one without ``--job`` then); ``since``: the window's start (else
    its first sample's time), from which the agent's crash lines count.
    """
    w = Window(list(samples), list(steps), list(logs), config or {}, dead_letter_reasons or {}, thresholds,
               scale, since)
    d = Diagnosis()
    for checks in CHECKS:
        checks(w, d).run()
    # The primary finding is the first: troubleshooting order, critical before warning within a step.
    order = {s: i for i, s in enumerate(STEPS)}
    d.findings.sort(key=lambda f: (order[f.step], SEVERITY[f.severity]))
    d.checks.sort(key=lambda c: order[c.step])
    d.window = w.extent()
    return d


# --- gathering a window ---------------------------------------------------------------------------------


@dataclass
class Inputs:
    job: str | None
    run_dir: Path | None
    samples: list[dict]
    steps: list[dict]
    logs: list
    config: dict | None
    reasons: dict
    source: str  # "live" | "run directory"
    shared: bool = False  # several jobs run on its Redis: a suggested scale command needs --job
    since: float | None = None  # the window's start (unix s): the logs' crashes are counted from it

    @property
    def scale(self) -> str:
        """The scale command this job's actions suggest."""
        return f"{SCALE} --job {self.job}" if self.shared and self.job else SCALE


def read_logs(run_dir: Path | None, since: float | None = None, out_tail: int = 400) -> list:
    """structlog records of the window, and the tails of the workers' raw output (tracebacks live there)."""
    if run_dir is None:
        return []
    from pipeline.observe.trace import read_log_records, unix_time

    records = [r for r in read_log_records(run_dir)
               if since is None or (unix_time(r.get("timestamp")) or since) >= since]
    raw = []
    for path in sorted((run_dir / "logs").glob("*.out")):
        # the output of the process's latest start only: a restarted worker appends to the same file
        lines = output_lines(path)[-out_tail:]
        raw += [f"{path.stem}: {line}" for line in lines if line.strip()]
    return records + raw


def _config_of(run_dir: Path | None) -> dict | None:
    try:
        return json.loads((run_dir / "manifest.json").read_text())["config"] if run_dir else None
    except (OSError, ValueError, KeyError):
        return None


def gather_live(r, job: str, run_dir: Path | None, window_s: float, sample_s: float) -> Inputs:
    """One live job's window (``gather_live_jobs`` of that job alone)."""
    return gather_live_jobs(r, {job: run_dir}, window_s, sample_s)[0]


def gather_live_jobs(r, jobs: dict[str, Path | None], window_s: float, sample_s: float) -> list[Inputs]:
    """The windows of live jobs (name -> run directory, None: the one Redis names), in the order given.

    The jobs no sampler recorded are sampled here for ``sample_s``, all in the
    same seconds: several jobs cost one wait, not one each.
    """
    from pipeline.observe.metrics import read_samples

    since = time.time() - window_s
    samples = {job: read_samples(r, job, since=since) for job in jobs}
    unrecorded = [job for job, got in samples.items() if len(got) < Thresholds.min_samples]
    if unrecorded and sample_s > 0:
        for job, taken in sample_now(r, unrecorded, sample_s).items():
            samples[job] += taken
    return [_live_inputs(r, job, run_dir, since, samples[job]) for job, run_dir in jobs.items()]


def sample_now(r, jobs: list[str], sample_s: float) -> dict[str, list[dict]]:
    """A short window of samples of each job, taken side by side over ``sample_s`` and recorded nowhere."""
    from pipeline.observe.metrics import MetricsSampler

    samplers = {job: MetricsSampler(r, job, None, from_start=False) for job in jobs}
    out: dict[str, list[dict]] = {job: [] for job in jobs}
    n = max(Thresholds.min_samples, int(sample_s))
    for _ in range(n):   # each sample measures from the one before, the first from the samplers' start
        time.sleep(sample_s / n)
        for job, sampler in samplers.items():
            out[job].append(sampler.collect())
    return out


def _live_inputs(r, job: str, run_dir: Path | None, since: float, samples: list[dict]) -> Inputs:
    """The rest of a live job's window: learner steps, dead-letter reasons, logs and config."""
    from pipeline.dataplane.keys import JobKeys

    keys = JobKeys(job)
    steps = [json.loads(f[b"data"]) for _i, f in r.xrange(keys.metrics, min=f"{int(since * 1000)}-0")
             if f.get(b"kind") == b"learner_step"]
    if run_dir is None:
        rd = r.hget(keys.state, "run_dir")
        run_dir = Path(rd.decode()) if rd and Path(rd.decode()).is_dir() else None
    reasons = Counter()
    for _i, f in r.xrevrange(keys.dead_letters, count=200):
        reasons[f.get(b"reason", b"?").decode(errors="replace")[:120]] += 1
    return Inputs(job, run_dir, samples, steps, read_logs(run_dir, since), _config_of(run_dir), dict(reasons), "live",
                  since=since)


def gather_run_dir(run_dir: Path, window_s: float) -> Inputs:
    from pipeline.observe.measures import read_jsonl

    lines = read_jsonl(run_dir / "metrics.jsonl")
    end = max((x.get("at", 0) for x in lines), default=None)
    since = end - window_s if end else None
    keep = lambda x: since is None or x.get("at", 0) >= since
    samples = [x for x in lines if x.get("kind") == "sample" and keep(x)]
    steps = [x for x in lines if x.get("kind") == "learner_step" and keep(x)]
    config = _config_of(run_dir)
    return Inputs(get_in(config, "job", "name"), run_dir, samples, steps, read_logs(run_dir, since), config, {},
                  "run directory", since=since)


# --- libra-ctl doctor ---------------------------------------------------------------------------------------


def format_diagnosis(d: Diagnosis, inp: Inputs, window_s: float) -> str:
    out = [f"libra-ctl doctor: job {inp.job}  ({inp.source}, last {window_s:.0f} s: {d.window['samples']} samples, "
           f"{d.window['learner_steps']} learner steps, {d.window['log_lines']} log lines)"]
    p = d.primary
    balance = next((c.detail for c in d.checks if c.name == "learner wait and backlog"), "")
    out.append(f"\nbottleneck: {p.bottleneck} - {p.symptom}" if p else
               "\nno bottleneck found: the pipeline looks balanced in this window" if d.judged else
               f"\nnothing to judge yet: {balance}")
    out.append("\nchecked, in the field guide's order:")
    for i, c in enumerate(d.checks, 1):
        mark = {"ok": "ok     ", "problem": "PROBLEM", "no data": "no data"}[c.status]
        out.append(f"  {i:>2}. {c.step:<9} {c.name:<26} {mark}  {c.detail}")
    for f in d.findings:
        out.append(f"\n[{f.severity}] {f.symptom}  (bottleneck: {f.bottleneck})")
        for e in f.evidence:
            out.append(f"    evidence: {e}")
        if f.check_first:
            out.append(f"    check first: {f.check_first}")
        out.append(f"    action: {f.action}")
    return "\n".join(out)


def format_overview(results: list[tuple[Inputs, Diagnosis]]) -> str:
    """One line naming each job's bottleneck, above the per-job sections when several jobs were diagnosed."""
    named = [f"{inp.job}: {d.primary.bottleneck if d.primary else 'balanced' if d.judged else 'nothing to judge'}"
             for inp, d in results]
    return f"libra-ctl doctor: {len(results)} jobs ({'; '.join(named)})"


def cmd_doctor(args) -> int:
    """Diagnose the named job, else every running job (one section each); exit 1 if any has a finding, else 2
    if any window held too little to judge."""
    window = args.window
    inputs = _inputs(args, window)
    if inputs is None:
        return 2
    results = [(inp, diagnose(inp.samples, inp.logs, steps=inp.steps, config=inp.config,
                              dead_letter_reasons=inp.reasons, scale=inp.scale, since=inp.since))
               for inp in inputs]
    healthy = all(d.healthy for _inp, d in results)
    if args.json:
        docs = [{"job": inp.job, "source": inp.source, "run_dir": str(inp.run_dir) if inp.run_dir else None,
                 **d.to_dict()} for inp, d in results]
        # one job: its diagnosis, as always; several: each job's, and whether all are healthy
        print(json.dumps(docs[0] if len(docs) == 1 else {"healthy": healthy, "jobs": docs}, indent=2))
    else:
        sections = [format_diagnosis(d, inp, window) for inp, d in results]
        print("\n\n".join(([format_overview(results)] if len(results) > 1 else []) + sections))
    if healthy:
        return 0
    return 1 if any(d.findings for _inp, d in results) else 2


def _connect(url: str | None, run_dir: Path | None):
    """The Redis to read: ``url``, else the run's (``--run``), else the usual search; None when none answers."""
    import redis

    from pipeline.dataplane.redisconn import BadRedisUrl, connect, find_redis_url, refusal
    from pipeline.redaction import is_redacted

    if url is None and run_dir is not None and (run_dir / "redis.url").exists():
        url = (run_dir / "redis.url").read_text().strip()
        if is_redacted(url):
            url = None   # the file keeps no password: the full URL comes from $LIBRA_REDIS_URL
    try:
        # a host gone silent answers with a timeout, not a refusal: the run directory is read instead
        r = connect(url or find_redis_url(None), socket_connect_timeout=2, socket_timeout=5)
        r.ping()
    except (redis.ConnectionError, redis.TimeoutError, BadRedisUrl, FileNotFoundError, SystemExit) as exc:
        if isinstance(exc, redis.ConnectionError) and refusal(exc):
            if run_dir is None:
                raise   # up, and refusing the URL's credentials or certificates: said, not read around
            print(f"libra-ctl doctor: Redis {refusal(exc)}; reading the run directory instead", file=sys.stderr)
        return None
    return r


def jobs_to_diagnose(r, job: str | None, run_dir: Path | None) -> list[str]:
    """``--job``; else the job of ``--run``; else every running job; else the job started last on the Redis.

    A ``--job`` this Redis has never run, without a run directory to read,
    raises BadInput (a typo is not a healthy job).
    """
    from pipeline.control.commands import all_jobs, known_job, running_jobs

    if job is not None:
        return [job if run_dir is not None else known_job(r, job)]
    named = get_in(_config_of(run_dir), "job", "name") if run_dir is not None else None
    if named:
        return [named]
    from pipeline.dataplane.keys import JobKeys

    def started_at(name: str) -> float:
        try:
            return max(float(x or 0) for x in r.hmget(JobKeys(name).state, ["started_at", "resumed_at"]))
        except ValueError:
            return 0.0

    return running_jobs(r) or sorted(all_jobs(r), key=started_at)[-1:]


def _inputs(args, window: float) -> list[Inputs] | None:
    """One window per job to diagnose; None (with a message) when there is nothing to read.

    Where several jobs run on the Redis, each window is marked ``shared``, so
    its suggested scale command names the job (even when ``--job`` picked one).
    """
    from pipeline.control.commands import running_jobs

    run_dir = Path(args.run) if args.run else None
    if run_dir is not None and not (run_dir / "manifest.json").is_file():
        print(f"libra-ctl doctor: {run_dir} is not a run directory (no manifest.json there); runs are under "
              "runs/ by default")
        return None
    r = _connect(args.redis, run_dir)
    if r is None:
        if run_dir is None:
            print("libra-ctl doctor: no Redis to read; pass --run RUN_DIR for a finished run, or --redis URL")
            return None
        return [gather_run_dir(run_dir, window)]
    jobs = jobs_to_diagnose(r, args.job, run_dir)
    if not jobs:
        if run_dir is not None:
            return [gather_run_dir(run_dir, window)]
        print("libra-ctl doctor: no job on this Redis; pass --job J or --run RUN_DIR")
        return None
    running = running_jobs(r)
    live = {j: run_dir for j in jobs if j in running}
    found = dict(zip(live, gather_live_jobs(r, live, window, args.sample_s)))
    inputs = [found[j] if j in found else _finished(r, j, run_dir, window) for j in jobs]
    for inp in inputs:
        inp.shared = len(running) > 1
    return inputs


def _finished(r, job: str, run_dir: Path | None, window: float) -> Inputs:
    """A finished job: its record is the run directory (the last window of the run, not of the clock)."""
    from pipeline.dataplane.keys import JobKeys

    recorded = r.hget(JobKeys(job).state, "run_dir")
    rd = run_dir or (Path(recorded.decode()) if recorded else None)
    if rd is not None and rd.is_dir():
        return gather_run_dir(rd, window)
    return gather_live(r, job, run_dir, window, 0)


def add_commands(sub) -> None:
    p = sub.add_parser("doctor", help="name the bottleneck of each job, with evidence and a suggested action")
    p.add_argument("--job", help="job name (default: every running job, one diagnosis each)")
    p.add_argument("--run", help="run directory (logs, manifest; the whole input when its Redis is gone)")
    p.add_argument("--redis", help="Redis URL (default: $LIBRA_REDIS_URL, the run's, or the newest local run's)")
    p.add_argument("--window", type=argtypes.seconds, default=300.0, help="seconds of history to judge (default 300)")
    p.add_argument("--sample-s", type=argtypes.seconds_or_none, default=10.0,
                   help="when no samples were recorded, sample the live job this long first (0: don't)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
