"""``libra-ctl top``: a live terminal view of the jobs on a Redis, refreshed every second.

One block per job (``--job`` keeps one): allocation and pool settings,
streams, rates, learner wait, staleness, reward and diversity, and the
workers with their CPU and memory (from the sampler's newest sample).
Plain ANSI escapes, no curses; Ctrl-C exits; ``--once`` prints one frame
without escapes (for tests and scripts). Run by a user on any machine that
reaches the jobs' Redis.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque

import redis

from pipeline import argtypes
from pipeline.control.allocator import LEARNER_WAIT_THRESHOLD
from pipeline.dataplane.keys import JOBS, JobKeys
from pipeline.observe.measures import rise
from pipeline.observe.status import format_pool, format_slots, job_status

RATE_WINDOW = 10  # snapshots (seconds at the default refresh) the rates average over
BAR = 24
CLEAR, HIDE, SHOW = "\x1b[H\x1b[2J", "\x1b[?25l", "\x1b[?25h"


def snapshot(r: redis.Redis, job: str) -> dict:
    keys = JobKeys(job)
    stats = {k.decode(): json.loads(v) for k, v in r.hgetall(keys.learner_stats).items()}
    newest = r.xrevrange(keys.metric_samples, count=1)
    sample = json.loads(newest[0][1][b"data"]) if newest else None
    return {"t": time.monotonic(), "status": job_status(r, job), "stats": stats, "sample": sample}


class Rates:
    """Per-second rates of the job's counters over the last ``RATE_WINDOW`` snapshots."""

    def __init__(self):
        self.hist: deque = deque(maxlen=RATE_WINDOW + 1)

    def add(self, snap: dict) -> dict:
        self.hist.append((snap["t"], snap["status"]["counters"]))
        dt = self.hist[-1][0] - self.hist[0][0]
        return {k: rise(c.get(k, 0) for _t, c in self.hist) / dt if dt > 0 else None
                for k in ("generated", "scored", "trained", "dropped_stale", "rollout_tokens")}


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _bar(x: float, top: float, width: int = BAR) -> str:
    n = 0 if top <= 0 else min(width, round(width * x / top))
    return "█" * n + "·" * (width - n)


def _paint(text: str, color: str | None, on: bool) -> str:
    codes = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}
    return f"\x1b[{codes[color]}m{text}\x1b[0m" if on and color else text


def _header(st: dict, s: dict, P, steps_total: int | None) -> list[str]:
    roles = "  ".join(f"{k} {v}" for k, v in sorted(st["allocation"]["roles"].items())) or "no live workers"
    step = s.get("step")
    return [
        P(f"libra top  job {st['name']}  phase {st['phase']}  policy v{st['policy_version']}  "
          f"step {step if step is not None else '-'}{'/' + str(steps_total) if steps_total else ''}  "
          f"{time.strftime('%H:%M:%S')}", "bold") + P("   (Ctrl-C quits)", "dim"),
        "",
        f"allocation ({st['allocation']['mode']})  {roles}   pool {format_pool(st['pool'], st['allocation']['mode'])}",
    ]


def _stage_table(stages: list[dict], P) -> list[str]:
    lines = ["", P(f"{'stage':<8} {'length':>7} {'lag':>6} {'pending':>8} {'backlog':>8} {'rate/s':>8}  backlog",
                   "bold")]
    top = max([x["lag"] + x["pending"] for x in stages] + [1])
    for x in stages:
        backlog = x["lag"] + x["pending"]
        lines.append(f"{x['name']:<8} {x['length']:>7} {x['lag']:>6} {x['pending']:>8} {backlog:>8} "
                     f"{x['rate_per_s']:>8.2f}  {_bar(backlog, top)}")
    return lines


def _rate_lines(rates: dict, c: dict) -> list[str]:
    tok = rates.get("rollout_tokens")
    return [
        "",
        f"rates ({RATE_WINDOW}s)   generated {_fmt(rates.get('generated'), '.1f')}/s   scored "
        f"{_fmt(rates.get('scored'), '.1f')}/s   trained {_fmt(rates.get('trained'), '.1f')}/s   "
        f"tokens {_fmt(tok, ',.0f')}/s   dropped stale {_fmt(rates.get('dropped_stale'), '.1f')}/s",
        f"totals       issued {c.get('issued', 0)}   generated {c.get('generated', 0)}   scored "
        f"{c.get('scored', 0)}   trained {c.get('trained', 0)}   dropped stale {c.get('dropped_stale', 0)}   "
        f"dead-lettered {c.get('dead_lettered', 0)}",
    ]


def render(snap: dict, rates: dict, color: bool = False, steps_total: int | None = None) -> str:
    """One job's frame: header, stage table, rates, learner, staleness, diversity, workers."""
    st, s, sample = snap["status"], snap["stats"], snap["sample"] or {}
    P = lambda text, c=None: _paint(text, c, color)
    lines = _header(st, s, P, steps_total) + _stage_table(st["stages"], P)
    if rates.get("trained") is None and sample.get("throughput"):
        rates = _sampled_rates(sample["throughput"])  # one snapshot so far: the sampler's last interval
    lines += _rate_lines(rates, st["counters"])
    wait = _learner_wait(s, sample)
    wait_txt = P(f"{wait:.0%}", "red" if wait > LEARNER_WAIT_THRESHOLD else "green") if wait is not None else "-"
    lines.append(f"learner      wait {wait_txt}   reward {_fmt(s.get('reward_mean'), '.3f')} ± "
                 f"{_fmt(s.get('reward_std'), '.2f')}   success {_fmt(s.get('success_rate'), '.1%')}   "
                 f"loss {_fmt(s.get('loss'), '.4f')}   entropy {_fmt(s.get('entropy'), '.3f')}")
    lines += _staleness_and_diversity(s, sample)
    lines += _worker_table(st["workers"], (sample.get("resources") or {}).get("workers") or {}, P)
    return "\n".join(lines)


def _learner_wait(s: dict, sample: dict) -> float | None:
    """Share of the learner's time spent waiting: the sampler's ratio, else the last step's."""
    wait = (sample.get("queues") or {}).get("learner_wait_ratio")
    if wait is None and s.get("wait_s") is not None:
        busy = s.get("wait_s", 0) + s.get("train_s", 0)
        wait = s["wait_s"] / busy if busy else None
    return wait


def _staleness_and_diversity(s: dict, sample: dict) -> list[str]:
    hist = s.get("staleness_hist") or {}
    n = sum(hist.values()) or 1
    bars = "  ".join(f"{k}:{_bar(v, n, 10)}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])))
    lines = [f"staleness    mean {_fmt(s.get('staleness_mean'), '.2f')}  max {s.get('staleness_max', '-')}   "
             f"{bars}"]
    if s.get("diversity_groups") or (sample.get("quality") or {}).get("diversity_distinct_rate") is not None:
        q = s if s.get("diversity_groups") else sample["quality"]
        lines.append(f"diversity    distinct {_fmt(q.get('diversity_distinct_rate'), '.0%')}   similarity "
                     f"{_fmt(q.get('diversity_similarity'), '.2f')}   equal-reward groups "
                     f"{_fmt(q.get('diversity_equal_reward_share'), '.0%')}")
    return lines


def _worker_table(workers: list[dict], res: dict, P) -> list[str]:
    """One row per worker, with CPU and memory from the sampler's newest sample (``res``, by worker id)."""
    lines = ["", P(f"{'worker':<24} {'role':<8} {'state':<9} {'pid':>7} {'cpu%':>6} {'rss MiB':>8} {'rate/s':>7}",
                   "bold")]
    for w in workers:
        r = res.get(w["id"], {})
        state = P(f"{w['state']:<9}", {"lost": "red", "waiting": "yellow"}.get(w["state"]))
        rss = r.get("rss_bytes")
        lines.append(f"{w['id']:<24} {w['role']:<8} {state} {w['pid']:>7} {_fmt(r.get('cpu_percent'), '.0f'):>6} "
                     f"{_fmt(rss / 2**20 if rss else None, '.0f'):>8} {w.get('rate_per_s', 0):>7.2f}")
    return lines


def _sampled_rates(tp: dict) -> dict:
    per_min = tp.get("trajectories_per_min")
    return {"generated": per_min / 60 if per_min is not None else None, "scored": tp.get("scored_per_s"),
            "trained": tp.get("learner_samples_per_s"), "dropped_stale": tp.get("dropped_stale_per_s"),
            "rollout_tokens": tp.get("rollout_tokens_per_s")}


def _jobs(r: redis.Redis, job: str | None) -> list[str]:
    if job:
        from pipeline.control.commands import known_job

        return [known_job(r, job)]   # a typo is said, not drawn as a job that did nothing
    return sorted(n.decode() for n in r.smembers(JOBS))


def _steps_total(r: redis.Redis, job: str) -> int | None:
    from pathlib import Path

    rd = r.hget(JobKeys(job).state, "run_dir")
    try:
        manifest = json.loads((Path(rd.decode()) / "manifest.json").read_text()) if rd else {}
        return manifest["config"]["job"]["steps"]
    except (OSError, ValueError, KeyError):
        return None


def frame(r: redis.Redis, jobs: list[str], rates: dict[str, Rates], color: bool) -> str:
    if not jobs:
        return "no jobs on this Redis"
    out, statuses = [], []
    for job in jobs:
        snap = snapshot(r, job)
        statuses.append(snap["status"])
        out.append(render(snap, rates.setdefault(job, Rates()).add(snap), color, _steps_total(r, job)))
    slots = format_slots(statuses)
    return "\n\n".join(([slots] if slots else []) + out)


def cmd_top(args) -> int:
    from pipeline.dataplane.redisconn import find_redis_url
    from pipeline.dataplane.redisconn import connect

    r = connect(find_redis_url(args.redis))
    rates: dict[str, Rates] = {}
    if args.once:
        print(frame(r, _jobs(r, args.job), rates, color=False))
        return 0
    tty = sys.stdout.isatty()
    try:
        if tty:
            sys.stdout.write(HIDE)
        while True:
            text = frame(r, _jobs(r, args.job), rates, color=tty)
            sys.stdout.write((CLEAR if tty else "") + text + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if tty:
            sys.stdout.write(SHOW)
            sys.stdout.flush()


def add_commands(sub) -> None:
    p = sub.add_parser("top", help="live view of every job (or --job J): allocation, streams, rates, reward")
    p.add_argument("--job", help="job name (default: every job on the Redis)")
    p.add_argument("--redis", help="Redis URL (default: $LIBRA_REDIS_URL or the newest local run's)")
    p.add_argument("--interval", type=argtypes.seconds, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame without terminal escapes and exit")
    p.set_defaults(func=cmd_top)
