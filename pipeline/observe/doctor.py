"""``libra-ctl doctor``: name the bottleneck, with its evidence and a suggested action.

It follows the field guide's troubleshooting order (logs, then inputs, then
resources, then the balance of the pipeline) and its table of symptoms over a
window of metric samples, learner steps and log lines. ``diagnose`` is a pure
function of those that runs the checks of ``pipeline.observe.doctor_checks``,
so each symptom is tested by injecting it; ``gather`` collects them from a
live job (Redis and its run directory) or from a finished run's directory
alone. Run by a user from any machine that reaches the job's Redis, or on a
copied run directory.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline.observe.doctor_checks import CHECKS, SEVERITY, STEPS, Diagnosis, Thresholds, Window, get_in


def diagnose(samples: list[dict], logs: list = (), *, steps: list[dict] = (), config: dict | None = None,
             dead_letter_reasons: dict | None = None, thresholds: Thresholds = Thresholds()) -> Diagnosis:
    """Findings over one window: metric samples, learner steps, log lines (structlog dicts or raw text).

    ``config`` is the run's resolved config (the manifest's ``config``), used
    to name the knob in each action; ``dead_letter_reasons`` maps a reason to
    its count among recent dead letters.
    """
    w = Window(list(samples), list(steps), list(logs), config or {}, dead_letter_reasons or {}, thresholds)
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


def read_logs(run_dir: Path | None, since: float | None = None, out_tail: int = 400) -> list:
    """structlog records of the window, and the tails of the workers' raw output (tracebacks live there)."""
    if run_dir is None:
        return []
    from pipeline.observe.trace import read_log_records, unix_time

    records = [r for r in read_log_records(run_dir)
               if since is None or (unix_time(r.get("timestamp")) or since) >= since]
    raw = []
    for path in sorted((run_dir / "logs").glob("*.out")):
        lines = path.read_text(errors="replace").splitlines()[-out_tail:]
        raw += [f"{path.stem}: {line}" for line in lines if line.strip()]
    return records + raw


def _config_of(run_dir: Path | None) -> dict | None:
    try:
        return json.loads((run_dir / "manifest.json").read_text())["config"] if run_dir else None
    except (OSError, ValueError, KeyError):
        return None


def gather_live(r, job: str, run_dir: Path | None, window_s: float, sample_s: float) -> Inputs:
    from pipeline.dataplane.keys import JobKeys
    from pipeline.observe.metrics import MetricsSampler, read_samples

    keys = JobKeys(job)
    since = time.time() - window_s
    samples = read_samples(r, job, since=since)
    if len(samples) < Thresholds.min_samples and sample_s > 0:
        # No sampler recorded this job: take a short window ourselves, without recording it.
        sampler = MetricsSampler(r, job, None, from_start=False)
        n = max(Thresholds.min_samples, int(sample_s))
        for i in range(n):
            samples.append(sampler.collect())
            if i < n - 1:
                time.sleep(sample_s / (n - 1))
    steps = [json.loads(f[b"data"]) for _i, f in r.xrange(keys.metrics, min=f"{int(since * 1000)}-0")
             if f.get(b"kind") == b"learner_step"]
    if run_dir is None:
        rd = r.hget(keys.state, "run_dir")
        run_dir = Path(rd.decode()) if rd and Path(rd.decode()).is_dir() else None
    reasons = Counter()
    for _i, f in r.xrevrange(keys.dead_letters, count=200):
        reasons[f.get(b"reason", b"?").decode(errors="replace")[:120]] += 1
    return Inputs(job, run_dir, samples, steps, read_logs(run_dir, since), _config_of(run_dir), dict(reasons), "live")


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
                  "run directory")


# --- libra-ctl doctor ---------------------------------------------------------------------------------------


def format_diagnosis(d: Diagnosis, inp: Inputs, window_s: float) -> str:
    out = [f"libra-ctl doctor: job {inp.job}  ({inp.source}, last {window_s:.0f} s: {d.window['samples']} samples, "
           f"{d.window['learner_steps']} learner steps, {d.window['log_lines']} log lines)"]
    p = d.primary
    out.append(f"\nbottleneck: {p.bottleneck} - {p.symptom}" if p else "\nno bottleneck found: the pipeline "
               "looks balanced in this window")
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


def cmd_doctor(args) -> int:
    window = args.window
    inp = _inputs(args, window)
    if inp is None:
        return 2
    d = diagnose(inp.samples, inp.logs, steps=inp.steps, config=inp.config, dead_letter_reasons=inp.reasons)
    if args.json:
        print(json.dumps({"job": inp.job, "source": inp.source,
                          "run_dir": str(inp.run_dir) if inp.run_dir else None, **d.to_dict()}, indent=2))
    else:
        print(format_diagnosis(d, inp, window))
    return 0 if d.healthy else 1


def _inputs(args, window: float) -> Inputs | None:
    import redis

    from pipeline.dataplane.redisconn import find_redis_url
    from pipeline.dataplane.keys import JOBS, JobKeys
    from pipeline.dataplane.redisconn import connect
    from pipeline.redaction import is_redacted

    run_dir = Path(args.run) if args.run else None
    url = args.redis
    if url is None and run_dir is not None and (run_dir / "redis.url").exists():
        url = (run_dir / "redis.url").read_text().strip()
        if is_redacted(url):
            url = None   # the file keeps no password: the full URL comes from $LIBRA_REDIS_URL
    try:
        r = connect(url or find_redis_url(None), socket_connect_timeout=2)
        r.ping()
    except (redis.ConnectionError, FileNotFoundError, SystemExit):
        r = None
    if r is None:
        if run_dir is None:
            print("libra-ctl doctor: no Redis to read; pass --run RUN_DIR for a finished run, or --redis URL")
            return None
        return gather_run_dir(run_dir, window)
    job = args.job
    if job is None:
        names = sorted(n.decode() for n in r.smembers(JOBS))
        running = [n for n in names if r.hget(JobKeys(n).state, "phase") in (b"running", b"trained")]
        job = (running or names or [None])[-1]
        if run_dir is not None:
            cfg = _config_of(run_dir)
            job = get_in(cfg, "job", "name", default=job)
    if job is None:
        if run_dir is not None:
            return gather_run_dir(run_dir, window)
        print("libra-ctl doctor: no job on this Redis; pass --job J or --run RUN_DIR")
        return None
    phase = r.hget(JobKeys(job).state, "phase")
    if phase not in (b"running", b"trained"):
        # A finished job: its record is the run directory (the last window of the run, not of the clock).
        rd = run_dir or (Path(r.hget(JobKeys(job).state, "run_dir").decode())
                         if r.hget(JobKeys(job).state, "run_dir") else None)
        if rd is not None and rd.is_dir():
            return gather_run_dir(rd, window)
        return gather_live(r, job, run_dir, window, 0)
    return gather_live(r, job, run_dir, window, args.sample_s)


def add_commands(sub) -> None:
    p = sub.add_parser("doctor", help="name the bottleneck of a job, with evidence and a suggested action")
    p.add_argument("--job", help="job name (default: the running job)")
    p.add_argument("--run", help="run directory (logs, manifest; the whole input when its Redis is gone)")
    p.add_argument("--redis", help="Redis URL (default: $LIBRA_REDIS_URL, the run's, or the newest local run's)")
    p.add_argument("--window", type=float, default=300.0, help="seconds of history to judge (default 300)")
    p.add_argument("--sample-s", type=float, default=10.0,
                   help="when no samples were recorded, sample the live job this long first (0: don't)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
