"""Samples of the four metric kinds (throughput, resources, queues, quality), every ``interval_s``.

``libra-ctl run`` starts one sampler per job with ``start_sampler`` (a
daemon thread in the orchestrator process); ``libra-ctl doctor`` builds one
to take a few samples itself when none were recorded. Each sample reads
Redis (counters, streams, the workers table and their cost reports, the
learner's per-step lines since the previous sample) and this node's processes (psutil; nvidia-ml-py
where a GPU exists), then goes to two places: a line ``{"kind": "sample",
...}`` in ``runs/<id>/metrics.jsonl`` and an entry of the job's
``metric_samples`` stream, capped by length (metrics are not training data).
The schema is in docs/observability.md; ``SCHEMA_VERSION`` changes with it.

The pure parts (``rates``, ``aggregate_steps``, ``slot_busy``, ``tool_stats``, ``read_jsonl``)
are in ``observe.measures``; the process probe in ``observe.resources``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import redis
import structlog

from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.worker import this_node
from pipeline.logs import json_line
from pipeline.observe.measures import aggregate_steps, append_line, rates, slot_busy
from pipeline.observe.resources import ResourceProbe, live_on
from pipeline.observe.status import job_status

SCHEMA_VERSION = 1
DEFAULT_INTERVAL_S = 10.0
SAMPLES_MAXLEN = 20_000  # about 55 hours at 10 s; trimmed approximately
STEPS_READ_MAX = 10_000  # learner steps read per sample at most (a sampler that fell far behind)

log = structlog.get_logger("metrics")


class MetricsSampler:
    """Reads one sample of a job's four metric kinds; ``sample()`` also records it."""

    def __init__(self, r: redis.Redis, job: str, run_dir: Path | str | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, *, node: str | None = None,
                 probe: ResourceProbe | None = None, from_start: bool = True):
        self.r, self.job, self.keys = r, job, JobKeys(job)
        self.run_dir = Path(run_dir) if run_dir else None
        self.interval_s = interval_s
        self.node = node or this_node()   # the node name the run's local agent gives its workers
        self.probe = probe if probe is not None else ResourceProbe()
        self.prev_counters: dict | None = None
        self.prev_at: float | None = None
        self.prev_costs: dict = {}   # the workers' CostMeter records at the previous sample
        # Learner steps are read from their stream since this id, and counters measured from a
        # baseline: all of them, from zeros at the job's start, for a run we start with; only
        # what comes after now when we attach to a running job or resume one (its counters
        # carry the job's history).
        self.step_cursor = "0-0" if from_start else self._last_id(self.keys.metrics)
        if not from_start:
            self.prev_counters = {k.decode(): int(v) for k, v in r.hgetall(self.keys.counters).items()}
            self.prev_at = time.time()

    def _last_id(self, stream: str) -> str:
        last = self.r.xrevrange(stream, count=1)
        return last[0][0].decode() if last else "0-0"

    def new_steps(self) -> list[dict]:
        """Learner steps recorded since the previous sample."""
        entries = self.r.xrange(self.keys.metrics, min="(" + self.step_cursor, count=STEPS_READ_MAX)
        steps = []
        for entry_id, fields in entries:
            self.step_cursor = entry_id.decode()
            if fields.get(b"kind") == b"learner_step":
                steps.append(json.loads(fields[b"data"]))
        return steps

    def _baseline(self, now: float) -> tuple[dict, float]:
        """Counters and time of the previous sample (or the baseline); zeros at the job's start for the first one."""
        if self.prev_counters is not None:
            return self.prev_counters, self.prev_at
        started = self.r.hget(self.keys.state, "started_at")
        return {}, float(started) if started else now - self.interval_s

    def collect(self) -> dict:
        now = time.time()
        st = job_status(self.r, self.job)
        counters = st["counters"]
        prev, prev_at = self._baseline(now)
        dt = max(now - prev_at, 1e-6)
        agg = aggregate_steps(self.new_steps())
        costs = {w.decode(): json.loads(v) for w, v in self.r.hgetall(self.keys.worker_costs).items()}
        resources = self.resources(st["workers"], dt)
        resources["slot_busy"] = slot_busy(self.prev_costs, costs, st["workers"], prev_at, now)
        self.prev_counters, self.prev_at, self.prev_costs = counters, now, costs
        return {
            "kind": "sample", "schema": SCHEMA_VERSION, "at": now, "job": self.job, "node": self.node,
            "dt_s": round(dt, 3), "phase": st["phase"], "policy_version": st["policy_version"],
            "allocation": st["allocation"]["roles"], "workers": _workers_by_state(st["workers"]),
            "counters": counters,
            "throughput": {**rates(prev, counters, dt), "learner_steps": agg["steps"]},
            "resources": resources,
            "queues": self.queues(st, agg),
            "quality": {k: agg[k] for k in QUALITY_KEYS},
        }

    def resources(self, workers: list[dict], dt: float) -> dict:
        per_worker = self.probe.workers(workers, self.node)
        by_role: dict[str, dict] = {}
        for w in per_worker.values():
            role = by_role.setdefault(w["role"], {"workers": 0, "cpu_percent": 0.0, "rss_bytes": 0})
            role["workers"] += 1
            role["cpu_percent"] += w["cpu_percent"] or 0.0
            role["rss_bytes"] += w["rss_bytes"]
            if "gpu_memory_bytes" in w:
                role["gpu_memory_bytes"] = role.get("gpu_memory_bytes", 0) + w["gpu_memory_bytes"]
        return {"workers": per_worker, "by_role": by_role, "node": self.probe.node(dt),
                "gpus": self.probe.gpus(job_devices(workers, self.node))}

    def queues(self, st: dict, agg: dict) -> dict:
        stages = {s["name"]: {"stream": s["stream"], "length": s["length"], "lag": s["lag"],
                              "pending": s["pending"], "backlog": s["lag"] + s["pending"],
                              "rate_per_s": s["rate_per_s"]} for s in st["stages"]}
        wait = agg["wait_ratio"]
        if wait is None:  # no step finished in the window: is the learner stuck waiting, or training?
            states = {w["state"] for w in st["workers"] if w["role"] == "learner"}
            wait = 1.0 if states == {"waiting"} else 0.0 if "running" in states else None
        return {
            "stages": stages,
            "reward_queue": stages.get("reward", {}).get("backlog"),
            "learner_queue": stages.get("learner", {}).get("backlog"),
            "learner_wait_ratio": wait,
            "dead_letters": self.r.xlen(self.keys.dead_letters),
            "dead_lettered_trajectories": st["counters"].get("dead_lettered", 0),
            **{k: agg[k] for k in ("tool_calls", "tool_timeouts", "tool_latency_mean_s", "tool_latency_p95_s")},
        }

    def write(self, sample: dict) -> None:
        line = json_line(sample)   # a skipped step's inf loss is null, not Infinity (not JSON)
        self.r.xadd(self.keys.metric_samples, {"data": line}, maxlen=SAMPLES_MAXLEN, approximate=True)
        if self.run_dir is not None:
            append_line(self.run_dir / "metrics.jsonl", line)

    def sample(self) -> dict:
        s = self.collect()
        self.write(s)
        return s

    def run(self, stop: threading.Event) -> None:
        """Sample every ``interval_s`` until ``stop``; a failed sample is logged and skipped."""
        while not stop.wait(self.interval_s):
            try:
                self.sample()
            except (redis.RedisError, OSError) as exc:
                log.warning("metrics_sample_failed", job=self.job, error=str(exc))


QUALITY_KEYS = ("steps", "step", "loss", "reward_mean", "reward_std", "success_rate", "entropy", "grad_norm",
                "staleness_mean", "staleness_max", "staleness_hist", "trained", "dropped_stale",
                "zero_signal_share", "diversity_distinct_rate", "diversity_similarity",
                "diversity_equal_reward_share")


def job_devices(workers: list[dict], node: str) -> set[str] | None:
    """The GPUs the job's live workers on ``node`` see (their CUDA_VISIBLE_DEVICES), so that a sample
    shows the job's GPUs and not its neighbours'; None (every GPU) when a worker sees them all."""
    mine = live_on(workers, node)
    if any("devices" not in w for w in mine):
        return None
    return {d for w in mine for d in w["devices"]}


def _workers_by_state(workers: list[dict]) -> dict:
    out: dict[str, dict[str, int]] = {}
    for w in workers:
        role = out.setdefault(w["role"], {})
        role[w["state"]] = role.get(w["state"], 0) + 1
    return out


# --- running it ----------------------------------------------------------------------------------


class SamplerHandle:
    """A sampler thread; ``stop()`` ends it after taking one last sample."""

    def __init__(self, sampler: MetricsSampler):
        self.sampler = sampler
        self._stop = threading.Event()
        self.thread = threading.Thread(target=sampler.run, args=(self._stop,), daemon=True,
                                       name=f"metrics-{sampler.job}")

    def start(self) -> "SamplerHandle":
        self.thread.start()
        return self

    def stop(self, final_sample: bool = True, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.thread.join(timeout_s)
        if final_sample:
            try:
                self.sampler.sample()
            except (redis.RedisError, OSError) as exc:
                log.warning("metrics_sample_failed", job=self.sampler.job, error=str(exc))


def start_sampler(r: redis.Redis, job: str, run_dir: Path | str | None,
                  interval_s: float = DEFAULT_INTERVAL_S, **kwargs) -> SamplerHandle:
    """Sample ``job`` every ``interval_s`` in a daemon thread; call ``.stop()`` at the end of the run."""
    return SamplerHandle(MetricsSampler(r, job, run_dir, interval_s, **kwargs)).start()


# --- reading samples back ------------------------------------------------------------------------


def read_samples(r: redis.Redis, job: str, since: float | None = None, count: int = 10_000) -> list[dict]:
    """The job's recorded samples, oldest first; only those taken at or after ``since`` (unix s)."""
    lo = f"{int(since * 1000)}-0" if since else "-"
    return [json.loads(f[b"data"]) for _i, f in r.xrange(JobKeys(job).metric_samples, min=lo, count=count)]
