"""The checks behind ``libra-ctl doctor``: the field guide's symptoms, one class per troubleshooting step.

Each check reads one window (metric samples, learner steps, log lines and the
run's config) and adds to a ``Diagnosis`` a line of the checklist and, when a
symptom shows, a ``Finding`` with its evidence and the knob to turn. Pure: no
Redis, no files, no clock, so a test injects a symptom and reads the finding.
Called only by ``pipeline.observe.doctor.diagnose``, which runs ``CHECKS`` in
order and sorts what they found.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

from pipeline.control.allocator import LEARNER_WAIT_THRESHOLD
from pipeline.observe.measures import rise
from pipeline.observe.trace import unix_time

STEPS = ("logs", "inputs", "resources", "balance", "quality")  # the troubleshooting order
SEVERITY = {"critical": 0, "warning": 1}
SCALE = "libra-ctl scale"

OOM_PATTERNS = re.compile(
    r"out of memory|OutOfMemoryError|\bMemoryError\b|oom[-_ ]?kill|Killed process|std::bad_alloc"
    r"|exit(?:ed)? with code (?:-9|137)\b|SIGKILL", re.IGNORECASE)
REDIS_FULL = re.compile(r"OOM command not allowed|redis_full_waiting")  # backpressure, not a process OOM
TOOL_TIMEOUT_EVENTS = ("tool_timeout", "tool_timed_out")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")
# what an engine's processes put before each line of their output: vLLM's "[rank0]: ", "(EngineCore_0 pid=12) "
OUTPUT_PREFIX = re.compile(r"^(?:\[rank\d+\]:\s?|\([\w.-]+ pid=\d+\)\s?)")
AGENT_CRASH = re.compile(r"^(\S+Z)?\s*\S*\s*\S*\s*worker_crashed\b.*?\bkey=(\S+)")


@dataclass(frozen=True)
class Thresholds:
    """Where a reading becomes a finding; the field guide's numbers where it gives one."""

    min_samples: int = 3  # a window, never one instant
    learner_wait: float = LEARNER_WAIT_THRESHOLD  # learner idle longer than this share: rollout is short
    backlog_min_rise: float = 4.0  # entries (groups) a backlog must grow by over the window
    backlog_rising_share: float = 0.6  # share of sample-to-sample moves that must be upward
    backlog_rising_moves: int = 3  # ... and how many at least
    queue_full_share: float = 0.9  # backlog at this share of streams.max_queue_size: always full
    busy_high: float = 0.9  # a stage's slots busy this share of the window: it is the one working flat out
    busy_gap: float = 0.2  # ... while the other's are busy this much less: held back, not short
    learner_wait_low: float = 0.05  # and the learner waits under this share: it is never short of data
    rollout_flat_out: float = 0.75  # rollout busy this share: it is not held back by a short reward
    waiting_share: float = 0.8  # share of samples with work at a stage: work waits there
    tool_slow_share: float = 0.5  # tool latency p95 at this share of rollout.tool_timeout_s: tools are slow
    stale_share: float = 0.10  # dropped as stale over trained + dropped
    stale_critical: float = 0.30
    tool_timeout_share: float = 0.05
    tool_timeouts_min: int = 3
    dlq_critical: int = 10  # new dead letters in the window
    gpu_busy: float = 50.0  # percent
    gpu_idle: float = 5.0
    gpu_dips: int = 2  # busy -> idle transitions that make "periodic"
    distinct_low: float = 0.3
    similarity_high: float = 0.9
    equal_reward_high: float = 0.9


@dataclass
class Finding:
    code: str
    step: str  # one of STEPS
    severity: str  # critical | warning
    symptom: str
    bottleneck: str  # the stage or service to act on
    evidence: list[str]
    action: str
    check_first: str = ""  # the field guide's "check first" column


@dataclass
class Check:
    step: str
    name: str
    status: str  # ok | problem | no data
    detail: str


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    window: dict = field(default_factory=dict)

    @property
    def judged(self) -> bool:
        """Whether the window held enough to judge the pipeline's balance (else no verdict, not a healthy one)."""
        return any(c.name == "learner wait and backlog" and c.status != "no data" for c in self.checks) \
            or bool(self.findings)

    @property
    def healthy(self) -> bool:
        return not self.findings and self.judged

    @property
    def primary(self) -> Finding | None:
        """The first finding in troubleshooting order, critical before warning within a step."""
        return self.findings[0] if self.findings else None

    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def to_dict(self) -> dict:
        p = self.primary
        return {"healthy": self.healthy, "judged": self.judged, "bottleneck": p.bottleneck if p else None,
                "primary": asdict(p) if p else None, "findings": [asdict(f) for f in self.findings],
                "checks": [asdict(c) for c in self.checks], "window": self.window}


# --- helpers over series ---------------------------------------------------------------------------


def get_in(d: dict | None, *path, default=None):
    """``d[path[0]][path[1]]...``, or ``default`` where a key is missing or a level is not a dict."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _slope_per_min(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts, per minute."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    den = sum((t - mt) ** 2 for t in ts)
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


def _delta(samples: list[dict], *path) -> float | None:
    """How much a count rose over the samples (``measures.rise``); None under two readings."""
    vals = [v for v in (get_in(s, *path) for s in samples) if v is not None]
    return rise(vals) if len(vals) >= 2 else None


def _waiting(sample: dict, stage: str) -> float | None:
    """Entries waiting at ``stage`` in a sample (its backlog: unread and pending). The learner's are only those
    it has not read: it holds what it read pending until its checkpoint, a batch per step, which is no pile-up."""
    st = get_in(sample, "queues", "stages", stage) or {}
    return st.get("lag") if stage == "learner" and st.get("lag") is not None else st.get("backlog")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _cfg(config: dict | None, section: str, key: str, default=None):
    return get_in(config, section, key, default=default)


def _log_text(line) -> tuple[str, str]:
    """(source, text) of a structlog record or a raw output line."""
    if isinstance(line, dict):
        src = line.get("worker") or line.get("source") or "?"
        return src, " ".join(f"{k}={v}" for k, v in line.items() if k not in ("timestamp", "source"))
    return "output", str(line)


# --- the checks, in troubleshooting order ------------------------------------------------------------


@dataclass
class Window:
    """What the checks judge: one window of samples, learner steps and log lines, with the run's config."""

    samples: list[dict]
    steps: list[dict]
    logs: list  # structlog records (dicts) and raw output lines (str)
    config: dict  # the run's resolved config, to name the knob in an action; {} when unknown
    reasons: dict  # dead-letter reason -> its count among recent dead letters
    th: Thresholds
    scale: str = SCALE  # the scale command an action suggests (with --job J where several jobs run)
    since: float | None = None  # the window's start (unix s); None: its first sample's time

    def extent(self) -> dict:
        ats = [s["at"] for s in self.samples] + [s["at"] for s in self.steps if "at" in s]
        return {"samples": len(self.samples), "learner_steps": len(self.steps), "log_lines": len(self.logs),
                "from": min(ats) if ats else None, "to": max(ats) if ats else None}


class _Checks:
    """The checks of one troubleshooting step; each adds its checklist line, and any finding, to ``d``."""

    def __init__(self, w: Window, d: Diagnosis):
        self.samples, self.steps, self.logs = w.samples, w.steps, w.logs
        self.config, self.reasons, self.th, self.scale, self.since = w.config, w.reasons, w.th, w.scale, w.since
        self.d = d

    def run(self) -> None:
        raise NotImplementedError

    def pin_hint(self) -> str:
        """For a job the pool policy steers beside other jobs: what a suggested scale does to it, and the other way."""
        if self.scale == SCALE or _cfg(self.config, "control", "mode") != "auto":
            return ""
        return (" In a shared pool, scale pins the job: it leaves the pool's sharing and its minimum; raising "
                "control.priority or control.min_slots keeps it in.")

    def check(self, step: str, name: str, finding: Finding | None, ok_detail: str, no_data: bool = False) -> None:
        if finding is not None:
            self.d.findings.append(finding)
            self.d.checks.append(Check(step, name, "problem", finding.symptom))
        else:
            self.d.checks.append(Check(step, name, "no data" if no_data else "ok", ok_detail))

    def add(self, f: Finding) -> None:
        self.d.findings.append(f)

    def tool_p95s(self) -> list[float]:
        """The tool-call latency p95 of each sample in the window, else of each learner step."""
        return [v for v in (get_in(s, "queues", "tool_latency_p95_s") for s in self.samples) if v is not None] or \
            [s["tool_latency_p95_s"] for s in self.steps if s.get("tool_latency_p95_s") is not None]


class LogChecks(_Checks):
    """1. logs: out of memory, crashed workers, Redis refusing writes."""

    def run(self) -> None:
        self.oom()
        self.crashes()
        self.redis_full()

    def oom(self) -> None:
        hits = [(src, text) for src, text in map(_log_text, self.logs)
                if OOM_PATTERNS.search(text) and not REDIS_FULL.search(text)]
        if not hits:
            return self.check("logs", "out of memory", None, f"no out-of-memory evidence in {len(self.logs)} log lines")
        c = self.config
        sizes = (f"rollout.group_size={_cfg(c, 'rollout', 'group_size')}, "
                 f"learner.batch_size={_cfg(c, 'learner', 'batch_size')}, "
                 f"trajectory length up to {_cfg(c, 'rollout', 'max_turns')} turns x "
                 f"{_cfg(c, 'rollout', 'max_tokens_per_turn')} tokens") if c else "group size, batch size, lengths"
        evidence = [f"{src}: {text[:160]}" for src, text in hits[:5]]
        if len(hits) > 5:
            evidence.append(f"... and {len(hits) - 5} more lines")
        self.check("logs", "out of memory", Finding(
            "oom", "logs", "critical", f"out-of-memory errors in the logs ({_n(len(hits), 'line')})", "memory",
            evidence, f"Lower what sets memory per step ({sizes}): trajectories too long or too many per "
            "prompt. Halve learner.batch_size or rollout.group_size first (one change at a time), or lower "
            "rollout.gpu_memory_utilization if the engine takes the memory the learner needs.",
            "group size, batch size, trajectory length"), "")

    def crashes(self) -> None:
        """Workers whose raw output ends in a Python traceback (out-of-memory ones are the check above), and
        workers their agent restarted after a crash more than once in the window (a crash loop: between two
        starts, the latest start's output holds no traceback yet)."""
        by_src: dict[str, list[str]] = {}
        for line in self.logs:
            if isinstance(line, str):
                src, _sep, text = line.partition(": ")
                by_src.setdefault(src, []).append(OUTPUT_PREFIX.sub("", text))
        crashed, restarts, down = {}, self._restarts(by_src.get("agent", [])), set()
        for worker, n in restarts.items():
            crashed[worker] = (f"crashed and was restarted by its agent {_n(n, 'time')} in the window (agent.out: "
                               f"worker_crashed); logs/{worker}.out holds each start's output")
        for src, lines in by_src.items():
            if not any(x.startswith("Traceback (most recent call last)") for x in lines):
                continue
            exc = [i for i, x in enumerate(lines) if EXCEPTION_LINE.match(x)]
            if not exc:
                continue
            i = exc[-1]
            detail = " ".join([lines[i]] + [x.strip() for x in lines[i + 1:i + 3] if x.startswith(" ")])
            if not OOM_PATTERNS.search(detail):
                crashed[src] = detail + (f" ({crashed[src]})" if src in crashed else "")
                down.add(src)
        if not crashed:
            return self.check("logs", "worker crashes", None, f"no tracebacks in {len(by_src)} workers' output")
        first = sorted(crashed, key=lambda w: (w not in down, -restarts[w], w))[0]
        looping = bool(down) or max(restarts.values(), default=0) >= 2   # else one crash, and running again
        self.check("logs", "worker crashes", Finding(
            "worker_crashed", "logs", "critical" if looping else "warning",
            f"{_n(len(crashed), 'worker')} crashed: {', '.join(sorted(crashed))}",
            first.split("-")[0], [f"{src}: {msg[:300]}" for src, msg in sorted(crashed.items())],
            (f"A stage is down, so its queue figures only echo the crash: fix the error shown (logs/{first}.out has "
             "the traceback; often the config or the environment), then run again." if looping else
             f"A worker crashed once and runs again: logs/{first}.out has each start's output."), "logs"), "")

    def _restarts(self, agent_lines: list[str]) -> Counter:
        """Worker -> the crashes its agent logged (``worker_crashed key=JOB/WORKER``) since the window's first
        sample, for this run's job."""
        since = self.since if self.since is not None else min((s["at"] for s in self.samples if "at" in s),
                                                              default=None)
        job = _cfg(self.config, "job", "name")
        out: Counter = Counter()
        for line in agent_lines:
            m = AGENT_CRASH.match(line)
            if not m:
                continue
            owner, _sep, worker = m.group(2).partition("/")
            at = unix_time(m.group(1))
            if worker and (job is None or owner == job) and (since is None or at is None or at >= since):
                out[worker] += 1
        return out

    def redis_full(self) -> None:
        hits = [src for src, text in map(_log_text, self.logs) if REDIS_FULL.search(text)]
        if hits:
            self.check("logs", "redis memory", Finding(
                "redis_full", "logs", "warning", f"Redis refused writes as full ({_n(len(hits), 'time')})", "redis",
                [f"{n} lines from {src}" for src, n in Counter(hits).most_common(3)],
                "Producers waited (backpressure, nothing lost). Raise redis.maxmemory, or lower "
                "streams.max_queue_size so fewer trajectories wait in Redis.", "Redis maxmemory"), "")
        else:
            self.check("logs", "redis memory", None, "no writes refused")


class InputChecks(_Checks):
    """2. inputs: tool definitions/service, reward function and trajectory format (the DLQ)."""

    def run(self) -> None:
        self.tool_timeouts()
        self.dead_letters()

    def tool_timeouts(self) -> None:
        calls = sum(get_in(s, "queues", "tool_calls") or 0 for s in self.samples) or \
            sum(s.get("tool_calls", 0) or 0 for s in self.steps)
        outs = sum(get_in(s, "queues", "tool_timeouts") or 0 for s in self.samples) or \
            sum(s.get("tool_timeouts", 0) or 0 for s in self.steps)
        logged = sum(1 for x in self.logs if isinstance(x, dict) and x.get("event") in TOOL_TIMEOUT_EVENTS)
        outs = max(outs, logged)
        if not calls and not outs:
            return self.check("inputs", "tool calls", None, "no tool-call figures in the window", no_data=True)
        share = outs / calls if calls else 1.0
        lat, limit = self.tool_p95s(), _cfg(self.config, "rollout", "tool_timeout_s")
        if outs >= self.th.tool_timeouts_min and share >= self.th.tool_timeout_share:
            ev = [f"{outs} of {calls} tool calls timed out ({share:.1%}; threshold {self.th.tool_timeout_share:.0%})"]
            if lat:
                ev.append(f"tool latency p95 up to {max(lat):.2f} s" + (f" (timeout {limit} s)" if limit else ""))
            self.check("inputs", "tool calls", Finding(
                "tool_timeouts", "inputs", "critical" if share >= 2 * self.th.tool_timeout_share else "warning",
                f"tool calls time out ({share:.1%})", "tool service", ev,
                "The tool service, not the allocation: check its concurrency and latency (more rollout "
                "workers add load to it). Raise rollout.tool_timeout_s only if the calls are legitimately long.",
                "tool service concurrency and latency"), "")
        else:
            self.check("inputs", "tool calls", None, f"{outs} of {calls} tool calls timed out" + (
                f"; latency p95 up to {max(lat):.2f} s" + (f" (timeout {limit:g} s)" if limit else "") if lat else ""))

    def dead_letters(self) -> None:
        grew = _delta(self.samples, "queues", "dead_letters")
        logged = sum(1 for x in self.logs if isinstance(x, dict)
                     and str(x.get("event", "")).startswith("dead_lettered"))
        if grew is None and not logged:
            return self.check("inputs", "dead letters", None, "no dead-letter figures in the window", no_data=True)
        grew = int(grew) if grew is not None else logged
        if grew <= 0:
            return self.check("inputs", "dead letters", None, "dead-letter stream steady")
        top = Counter(self.reasons).most_common(3) if isinstance(self.reasons, (dict, Counter)) else []
        ev = [f"{grew} messages dead-lettered in the window"]
        ev += [f"{n}x {reason}" for reason, n in top]
        text = " ".join(r for r, _n in top).lower()
        if "verifier" in text or "reward" in text:
            action = "The reward function is failing: fix the verifier error shown, then replay the dead letters."
        elif "max_deliveries" in text:
            action = ("A handler keeps failing or outlives its claim: read the workers' logs for the crash, or "
                      "raise streams.<stage>_min_idle_s above the slowest handler.")
        else:
            action = ("Bad inputs: check the prompt file, the trajectory format and message sizes "
                      "(streams.max_message_bytes); the reasons name the field.")
        self.check("inputs", "dead letters", Finding(
            "dlq_growing", "inputs", "critical" if grew >= self.th.dlq_critical else "warning",
            f"the dead-letter stream grows (+{grew})", "inputs", ev, action,
            "prompts, tool definitions, reward function, trajectory format"), "")


class ResourceChecks(_Checks):
    """3. resources: GPUs that drop to idle at every weight sync."""

    def run(self) -> None:
        self.gpu_stalls()

    def gpu_stalls(self) -> None:
        series: dict[str, list[float]] = {}
        for s in self.samples:
            for g in get_in(s, "resources", "gpus", default=[]) or []:
                series.setdefault(f"{get_in(s, 'resources', 'node', 'host', default='?')}/gpu{g['index']}", []) \
                    .append(float(g["util_percent"]))
        if not series:
            return self.check("resources", "GPU utilisation", None, "no GPU samples (CPU-only run or no sampler)",
                              no_data=True)
        stalled = {}
        for gpu, util in series.items():
            dips = sum(1 for a, b in zip(util, util[1:]) if a >= self.th.gpu_busy and b <= self.th.gpu_idle)
            busy = sum(1 for u in util if u >= self.th.gpu_busy) / len(util)
            if dips >= self.th.gpu_dips and busy >= 0.3:
                stalled[gpu] = (dips, busy, util)
        if not stalled:
            worst = min(series, key=lambda g: min(series[g]))
            return self.check("resources", "GPU utilisation", None,
                              f"{len(series)} GPUs without periodic drops (lowest {min(series[worst]):.0f}% on {worst})")
        ev = [f"{gpu}: dropped to ~0% {d} times in {len(u)} samples, busy {b:.0%} of the time "
              f"(series {' '.join(f'{x:.0f}' for x in u[-12:])})" for gpu, (d, b, u) in sorted(stalled.items())]
        syncs = [float(x["reload_s"]) for x in self.logs if isinstance(x, dict) and x.get("event") ==
                 "weights_reloaded" and x.get("reload_s") is not None]
        syncs += [float(x["dur_s"]) for x in self.logs if isinstance(x, dict) and x.get("event") == "span"
                  and x.get("phase") == "weight_sync"]
        if syncs:
            ev.append(f"{len(syncs)} weight syncs logged, mean {sum(syncs) / len(syncs):.2f} s, max {max(syncs):.2f} s")
        publish = _cfg(self.config, "learner", "publish_every")
        self.check("resources", "GPU utilisation", Finding(
            "sync_stalls", "resources", "warning", "GPU utilisation drops to zero periodically",
            "weight sync", ev,
            "The pipeline stalls at rollout/learner synchronisation points: make the sync cheaper or rarer "
            f"(learner.publish_every{'=' + str(publish) if publish else ''}, up to learner.max_staleness), "
            "keep rollout generating during a reload, and check checkpoint writes (learner.checkpoint_every).",
            "rollout/learner sync points"), "")


def _wait_outside(step: dict, loading: list[tuple[float, float]]) -> float:
    """A learner step's wait outside the ``loading`` intervals, when no trajectory could come (the engines
    loading at a start or a resume); its record's ``at`` ends the wait, then training."""
    wait = step.get("wait_s", 0.0)
    if not loading or step.get("at") is None:
        return wait
    end = step["at"] - step.get("train_s", 0.0)
    start = end - wait
    return max(0.0, wait - sum(max(0.0, min(end, b) - max(start, a)) for a, b in loading))


class BalanceChecks(_Checks):
    """4. the balance of the pipeline: which stage is short, and what goes stale while it is."""

    def run(self) -> None:
        # while the engines load, the learner "waits" for nothing yet generated: nothing to judge in those samples
        loading = self._loading()
        if loading and loading == len(self.samples) and len(self.steps) < self.th.min_samples:
            self.d.checks.append(Check("balance", "learner wait and backlog", "no data",
                                       f"nothing generated yet in {_n(loading, 'sample')}: the job is starting "
                                       f"(rollout workers: {self._rollout_states() or 'none'})"))
            return self.d.checks.append(Check("balance", "stale drops", "no data", "nothing trained in the window"))
        self.loaded_at = self.samples[loading - 1].get("at") if loading else None   # nothing generated by then
        self.samples = self.samples[loading:]
        self.balance()
        self.stale()

    def _rollout_states(self) -> str:
        """The rollout workers' states in the last sample, e.g. ``starting 2``."""
        last = (get_in(self.samples[-1], "workers", "rollout") or {}) if self.samples else {}
        return ", ".join(f"{st} {k}" for st, k in sorted(last.items()) if k)

    def _loading(self) -> int:
        """How many of the window's first samples were taken while the job started (or resumed) and no
        trajectory had come yet: no ``generated`` count (the counter is made by the first) or none since the
        window's first sample, while no live rollout worker was past ``starting``."""
        first = get_in(self.samples[0], "counters", "generated", default=0) if self.samples else 0
        n = 0
        for s in self.samples:
            rollout = {st for st, k in (get_in(s, "workers", "rollout") or {}).items() if k and st not in ("exited",
                                                                                                     "lost")}
            generated = get_in(s, "counters", "generated", default=0) or 0
            # past loading: a count that rose, a live rollout worker past starting, or a count with none alive
            if generated > first or (rollout and not rollout <= {"starting"}) or (generated and not rollout):
                break
            n += 1
        return n

    def balance(self) -> None:
        """Who is short: a waiting learner names rollout (or reward, or a stall); work waiting at the
        learner, or a learner busy while rollout is held back, names the learner."""
        wait, wait_src = self._learner_wait()
        rising = {stage: self._rising(stage) for stage in ("reward", "learner")}
        if wait is not None and wait > self.th.learner_wait:
            self._learner_starves(wait, wait_src, rising["reward"] or self._reward_holds_up())
            found = True
        else:
            found = self._backlogs_rise(wait, wait_src, rising)
        n, read = len(self.samples), len(self._backlog("learner")[1])
        backlogs = "backlogs steady" if read >= self.th.min_samples else "no backlog figures"
        detail = (f"learner waited {wait:.0%} {wait_src}; {backlogs}" if wait is not None
                  else f"{n} samples, {len(self.steps)} learner steps: too few to judge the balance")
        self.d.checks.append(Check("balance", "learner wait and backlog", "problem" if found else
                                   ("ok" if wait is not None else "no data"), "see findings" if found else detail))

    def _busy(self, role: str) -> float | None:
        """The mean share of the window ``role``'s slots (or workers, for reward beside the slots) were busy."""
        xs = [v for v in (get_in(s, "resources", "slot_busy", "by_role", role, "frac") for s in self.samples)
              if v is not None]
        return _mean(xs) if len(xs) >= self.th.min_samples else None

    def _waiting_at(self, stage: str) -> float | None:
        """Share of samples with entries unread at ``stage`` (lag: not yet read by any of its workers)."""
        lags = [v for v in (get_in(s, "queues", "stages", stage, "lag") for s in self.samples) if v is not None]
        return sum(1 for v in lags if v > 0) / len(lags) if len(lags) >= self.th.min_samples else None

    def _reward_holds_up(self) -> tuple[float, str] | None:
        """While the learner waits: groups at reward (held while scored, or unread) in most samples, that is
        reward working all the time. A reward queue held at the feeder's bound does not rise, so a rising queue
        alone misses it. (The busy share of the cost reports is evidence only: a call is reported when it ends,
        capped at the sample's length, so samples shorter than a reward call under-read it.)"""
        _ts, ys = self._backlog("reward")
        if len(ys) < self.th.min_samples:
            return None
        held, busy, unread = sum(1 for y in ys if y > 0) / len(ys), self._busy("reward"), self._waiting_at("reward")
        rollout = self._busy("rollout")
        # a reward worker holds a read batch while it scores, so a half-busy one is "at work" in most samples;
        # a short reward holds rollout back (admission), a short rollout works flat out
        if held < self.th.waiting_share or (rollout is not None and rollout >= self.th.rollout_flat_out):
            return None
        return held, (f"groups were at reward in {held:.0%} of samples (mean {_mean(ys):.1f})"
                      + (f", some unread in {unread:.0%}" if unread is not None else "")
                      + (f", reward workers busy {busy:.0%} of the window" if busy is not None else ""))

    def _learner_flat_out(self, wait: float | None) -> str | None:
        """The learner's slots busy while rollout's are held back (``wait``: the learner's, hardly any): the
        learner sets the pace."""
        learner, rollout = self._busy("learner"), self._busy("rollout")
        if (learner is None or rollout is None or learner < self.th.busy_high or rollout > learner - self.th.busy_gap
                or (wait is not None and wait >= self.th.learner_wait_low)):
            return None
        return f"learner slots busy {learner:.0%} of the window, rollout slots {rollout:.0%} (held back)"

    def _tool_latency(self) -> tuple[float, float | None] | None:
        """The tool-call latency p95 over the window (the median of its samples': one slow instant moves
        nothing), and rollout.tool_timeout_s."""
        lat = self.tool_p95s()
        return (statistics.median(lat), _cfg(self.config, "rollout", "tool_timeout_s")) if lat else None

    def _learner_wait(self) -> tuple[float | None, str]:
        """The learner's share of time spent waiting, and over what: the sampler's ratio, else its steps' times."""
        waits = [w for w in (get_in(s, "queues", "learner_wait_ratio") for s in self.samples) if w is not None]
        if len(waits) >= self.th.min_samples:
            return _mean(waits), f"over {len(waits)} samples"
        loading = self._loading_intervals()
        w = sum(_wait_outside(s, loading) for s in self.steps)
        t = sum(s.get("train_s", 0.0) for s in self.steps)
        wait = w / (w + t) if len(self.steps) >= self.th.min_samples and w + t > 0 else None
        return wait, f"over {len(self.steps)} learner steps"

    def _loading_intervals(self) -> list[tuple[float, float]]:
        """When no trajectory could come yet: from each start of a rollout worker the logs hold (the first from
        the beginning of time) to the end of the first rollout call after it, by any worker (a worker started
        again beside others that generate adds next to nothing); without rollout calls in the logs, up to the
        last sample taken while nothing was generated."""
        recs = [r for r in self.logs if isinstance(r, dict)]
        ends = sorted(r["start"] + r["dur_s"] for r in recs if r.get("event") == "span" and r.get("phase") == "rollout"
                      and r.get("start") is not None and r.get("dur_s") is not None)
        if not ends:
            return [(float("-inf"), self.loaded_at)] if self.loaded_at is not None else []
        starts = sorted(t for t in (unix_time(r.get("timestamp")) for r in recs if r.get("event") == "worker_started"
                                    and (r.get("role") or str(r.get("worker", "")).split("-")[0]) == "rollout")
                        if t is not None)
        out = [(float("-inf"), ends[0])]
        for s in starts:
            e = next((x for x in ends if x >= s), None)
            if e is not None and e > out[-1][1]:
                out.append((max(s, out[-1][1]), e))
        return out

    def _learner_starves(self, wait: float, wait_src: str, reward_up: tuple[float, str] | None) -> None:
        """The learner waits for data: rollout paused by backpressure (a stall), reward short, or rollout short."""
        ev = [f"learner waited {wait:.0%} of its time {wait_src} (threshold {self.th.learner_wait:.0%})"]
        ev += self._rates()
        paused = self._rollout_paused()
        if paused is not None:
            ev.append(f"every rollout worker was paused (state waiting) in {paused:.0%} of samples")
            held = _mean([get_in(s, "queues", "stages", "learner", "backlog") for s in self.samples
                          if get_in(s, "queues", "stages", "learner", "backlog") is not None])
            if held is not None:
                ev.append(f"learner queue mean {held:.1f} entries (lag + pending)")
            self.add(Finding("rollout_paused", "balance", "critical", "the learner waits while rollout is "
                             "paused by backpressure: the pipeline is stalled", "queue bound", ev,
                             "The backlog that pauses rollout is not reaching the learner. Check what counts "
                             "against streams.max_queue_size (entries the learner holds pending until its next "
                             "checkpoint count too): raise streams.max_queue_size above "
                             "learner.checkpoint_every x learner.batch_size, or checkpoint more often.",
                             "max queue size"))
        elif reward_up:
            ev.append(reward_up[1])
            self.add(Finding("reward_short", "balance", "critical", "the reward stage is short: the learner "
                             "waits while the reward queue grows", "reward", ev,
                             "Add reward workers (reward.workers) or make the verifier cheaper; long "
                             "trajectories make reward a bottleneck.", "reward queue length"))
        else:
            queued = self._mean_backlog("learner")
            if queued is not None:
                ev.append(f"learner queue mean {queued:.1f} unread entries")
            tools, slow = self._tool_latency(), False
            if tools:
                p95, limit = tools
                slow = bool(limit) and p95 >= self.th.tool_slow_share * limit
                ev.append(f"tool latency p95 {p95:.2f} s (median of the samples')"
                          + (f" against rollout.tool_timeout_s {limit:g} s" if limit else ""))
            now = self._allocated("rollout")
            self.add(Finding("rollout_short", "balance", "critical", "rollout is short: the learner waits "
                             "for data", "tool service" if slow else "rollout", ev,
                             ("Check the tool service first: its calls take most of their timeout, and more "
                              "rollout workers add load to it. Then give rollout more" if slow else
                              "Give rollout more") +
                             f": raise the rollout:learner ratio ({now}, or {self.scale} "
                             "rollout=N), or check tool latency and trajectory length first." + self.pin_hint(),
                             "tool service concurrency and latency" if slow else "rollout/learner GPU ratio"))

    def _allocated(self, role: str) -> str:
        """How many ``role`` workers the job ran in the last sample (its allocation), else the config's count."""
        for s in reversed(self.samples):
            n = get_in(s, "allocation", role)
            if n is not None:
                return f"{n} {role} workers now"
        return f"{role}.workers={_cfg(self.config, role, 'workers', '?')} now"
    def _backlogs_rise(self, wait: float | None, wait_src: str, rising: dict) -> bool:
        """The learner keeps up: a rising or always-full learner queue, or its slots busy while rollout's are
        held back, names the learner; a rising reward queue names reward."""
        full, flat_out = self._always_full(), self._learner_flat_out(wait)
        found = False
        if rising["learner"] or full or flat_out:
            found = True
            ev = [x for x in (rising["learner"][1] if rising["learner"] else None, full, flat_out) if x]
            ev += self._rates()
            if wait is not None:
                ev.append(f"learner waited only {wait:.0%} of its time {wait_src}")
            self.add(Finding("learner_short", "balance", "critical", "the learner is short: scored "
                             "trajectories pile up", "learner", ev,
                             f"Give the learner more (lower the rollout:learner ratio, or {self.scale} learner=N), or "
                             "lower streams.max_queue_size so samples do not go stale while they wait."
                             + self.pin_hint(),
                             "max queue size, rollout/learner ratio"))
        if rising["reward"]:
            found = True
            self.add(Finding("reward_short", "balance", "warning", "the reward queue grows", "reward",
                             [rising["reward"][1]] + self._rates(),
                             "Add reward workers (reward.workers) or make the verifier cheaper.",
                             "reward queue length"))
        return found

    def _backlog(self, stage: str) -> tuple[list[float], list[float]]:
        """(times, entries waiting at ``stage``) over the samples (``_waiting``)."""
        ts, ys = [], []
        for s in self.samples:
            b = _waiting(s, stage)
            if b is not None:
                ts.append(float(s["at"]))
                ys.append(float(b))
        return ts, ys

    def _mean_backlog(self, stage: str) -> float | None:
        return _mean(self._backlog(stage)[1])

    def _rising(self, stage: str) -> tuple[float, str] | None:
        ts, ys = self._backlog(stage)
        if len(ys) < self.th.min_samples:
            return None
        moves = [b - a for a, b in zip(ys, ys[1:]) if b != a]
        ups = sum(1 for m in moves if m > 0)
        slope, third = _slope_per_min(ts, ys), max(len(ys) // 3, 1)
        # a rise over the window, not one batch landing as the last sample is taken: the last third's mean
        # above the first third's, in several upward moves
        risen = _mean(ys[-third:]) - _mean(ys[:third])
        if (risen >= self.th.backlog_min_rise and slope > 0 and ups >= self.th.backlog_rising_moves
                and ups / len(moves) >= self.th.backlog_rising_share):
            return slope, (f"{stage} queue rose from {ys[0]:.0f} to {ys[-1]:.0f} entries in "
                           f"{ts[-1] - ts[0]:.0f} s ({slope:+.1f}/min)")
        return None

    def _rollout_paused(self) -> float | None:
        """Share of samples in which every live rollout worker was waiting (paused), if that is most."""
        seen = [(get_in(s, "workers", "rollout") or {}) for s in self.samples]
        seen = [w for w in seen if sum(n for st, n in w.items() if st not in ("exited", "lost"))]
        if len(seen) < self.th.min_samples:
            return None
        share = sum(1 for w in seen if set(st for st, n in w.items() if n and st not in ("exited", "lost"))
                    == {"waiting"}) / len(seen)
        return share if share >= 0.8 else None

    def _always_full(self) -> str | None:
        cap, g = _cfg(self.config, "streams", "max_queue_size"), _cfg(self.config, "rollout", "group_size")
        if not cap or not g or len(self.samples) < self.th.min_samples:
            return None
        totals = [sum(_waiting(s, st) or 0 for st in ("reward", "learner")) * g for s in self.samples]
        share = sum(1 for t in totals if t >= self.th.queue_full_share * cap) / len(totals)
        if share >= 0.8:
            return (f"the buffer was at streams.max_queue_size ({cap} trajectories) in {share:.0%} of samples: "
                    "rollout is held back")
        return None

    def _rates(self) -> list[str]:
        tp = [s.get("throughput") or {} for s in self.samples]
        gen = _mean([t["trajectories_per_min"] / 60 for t in tp if t.get("trajectories_per_min") is not None])
        lrn = _mean([t["learner_samples_per_s"] for t in tp if t.get("learner_samples_per_s") is not None])
        if gen is None or lrn is None:
            return []
        return [f"generated {gen:.1f} trajectories/s, trained {lrn:.1f}/s (window means)"]

    def stale(self) -> None:
        dropped = _delta(self.samples, "counters", "dropped_stale")
        trained = _delta(self.samples, "counters", "trained")
        src = f"{len(self.samples)} samples"
        if dropped is None or trained is None:
            dropped = sum(s.get("dropped_stale", 0) for s in self.steps)
            trained = sum(s.get("trajectories", 0) for s in self.steps)
            src = f"{len(self.steps)} learner steps"
        total = (dropped or 0) + (trained or 0)
        if not total:
            return self.d.checks.append(Check("balance", "stale drops", "no data", "nothing trained in the window"))
        share = dropped / total
        if share < self.th.stale_share:
            return self.d.checks.append(Check("balance", "stale drops", "ok",
                                              f"{share:.1%} of trajectories dropped as stale"))
        c = self.config
        self.add(Finding(
            "stale_drops", "balance", "critical" if share >= self.th.stale_critical else "warning",
            f"many trajectories dropped as stale ({share:.0%})", "buffer depth",
            [f"{int(dropped)} dropped vs {int(trained)} trained over {src}",
             f"learner.max_staleness={_cfg(c, 'learner', 'max_staleness', '?')}, "
             f"streams.max_queue_size={_cfg(c, 'streams', 'max_queue_size', '?')}"],
            "Trajectories wait too long before training: lower streams.max_queue_size, give the learner more, "
            "publish more often, or allow learner.max_staleness one more version (the importance ratio "
            "corrects it).", "max queue size, sync interval"))
        self.d.checks.append(Check("balance", "stale drops", "problem", f"{share:.0%} dropped"))


class QualityChecks(_Checks):
    """5. quality: diversity (the field guide: throughput with collapsed groups is a failure)."""

    def run(self) -> None:
        self.diversity()

    def diversity(self) -> None:
        pick = lambda k: [v for v in ([get_in(s, "quality", k) for s in self.samples] +
                                      [s.get(k) for s in self.steps]) if v is not None]
        distinct, sim, equal = (pick("diversity_distinct_rate"), pick("diversity_similarity"),
                                pick("diversity_equal_reward_share"))
        if not distinct and not equal:
            return self.check("quality", "diversity", None, "no diversity figures (learner hook not on)",
                              no_data=True)
        ev = []
        if distinct and _mean(distinct) < self.th.distinct_low:
            ev.append(f"distinct completions per group {_mean(distinct):.0%} (threshold {self.th.distinct_low:.0%})")
        if sim and _mean(sim) > self.th.similarity_high:
            ev.append(f"mean pairwise 4-gram similarity {_mean(sim):.2f}")
        if equal and _mean(equal) > self.th.equal_reward_high:
            ev.append(f"{_mean(equal):.0%} of groups have all-equal rewards (no GRPO signal)")
        if not ev:
            return self.check("quality", "diversity", None, f"distinct rate {_mean(distinct) or 0:.0%}")
        self.check("quality", "diversity", Finding(
            "diversity_collapsed", "quality", "warning", "groups are near-copies or carry no reward signal",
            "exploration", ev, "Raise rollout.group_size or the sampling temperature, and check the reward "
            "function and tool feedback: high throughput on collapsed groups is not progress.",
            "reward function, task, tool feedback"), "")


CHECKS = (LogChecks, InputChecks, ResourceChecks, BalanceChecks, QualityChecks)  # in STEPS order
