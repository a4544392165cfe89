"""Samples of the four metric kinds (throughput, resources, queues, quality), every ``interval_s``.

``libra-ctl run`` starts one sampler per job with ``start_sampler`` (a
daemon thread in the orchestrator process); ``libra-ctl doctor`` builds one
to take a few samples itself when none were recorded. Each sample reads
Redis (counters, streams, the workers table, the learner's per-step lines
since the previous sample) and this node's processes (psutil; nvidia-ml-py
where a GPU exists), then goes to two places: a line ``{"kind": "sample",
...}`` in ``runs/<id>/metrics.jsonl`` and an entry of the job's
``metric_samples`` stream, capped by length (metrics are not training data).
The schema is in docs/observability.md; ``SCHEMA_VERSION`` changes with it.

The pure parts (``rates``, ``aggregate_steps``, ``tool_stats``) are what the
tests and the doctor exercise without processes.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Iterable

import redis
import structlog

from pipeline.keys import JobKeys
from pipeline.status import job_status

SCHEMA_VERSION = 1
DEFAULT_INTERVAL_S = 10.0
SAMPLES_MAXLEN = 20_000  # about 55 hours at 10 s; trimmed approximately
STEPS_READ_MAX = 10_000  # learner steps read per sample at most (a sampler that fell far behind)
LIVE_STATES = ("starting", "running", "waiting", "draining")

log = structlog.get_logger("metrics")


# --- pure parts -------------------------------------------------------------------------------


def rates(prev: dict, now: dict, dt_s: float) -> dict:
    """Throughput from two counter snapshots ``dt_s`` apart.

    ``rollout_tokens_per_s`` is None until the rollout workers count tokens
    (counter ``rollout_tokens``).
    """
    def per_s(name: str) -> float:
        return max(0, now.get(name, 0) - prev.get(name, 0)) / dt_s if dt_s > 0 else 0.0

    return {
        "rollout_tokens_per_s": per_s("rollout_tokens") if "rollout_tokens" in now else None,
        "trajectories_per_min": per_s("generated") * 60.0,
        "scored_per_s": per_s("scored"),
        "learner_samples_per_s": per_s("trained"),
        "dropped_stale_per_s": per_s("dropped_stale"),
        "dead_lettered_per_s": per_s("dead_lettered"),
    }


def _weighted_mean(pairs: Iterable[tuple[float | None, float]]) -> float | None:
    num = den = 0.0
    for value, weight in pairs:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        num += value * weight
        den += weight
    return num / den if den > 0 else None


def aggregate_steps(steps: list[dict]) -> dict:
    """Quality and learner-side queue figures over the learner steps of one window.

    Means are weighted by trajectories where a step's figure is a per-trajectory
    mean (reward, success, staleness); the diversity figures are those of the
    newest step that computed them. All values are None for an empty window.
    """
    traj = [max(s.get("trajectories", 0), 0) for s in steps]
    hist: dict[str, int] = {}
    for s in steps:
        for k, v in (s.get("staleness_hist") or {}).items():
            hist[str(int(k))] = hist.get(str(int(k)), 0) + int(v)
    groups = sum(s.get("groups", 0) for s in steps)
    wait = sum(s.get("wait_s", 0.0) for s in steps)
    busy = sum(s.get("train_s", 0.0) for s in steps)
    calls = sum(s.get("tool_calls", 0) for s in steps)
    div = next((s for s in reversed(steps) if s.get("diversity_groups")), {})
    p95 = [s["tool_latency_p95_s"] for s in steps if s.get("tool_latency_p95_s") is not None]
    return {
        "steps": len(steps),
        "step": steps[-1].get("step") if steps else None,
        "loss": _weighted_mean((s.get("loss"), 1.0) for s in steps),
        "reward_mean": _weighted_mean((s.get("reward_mean"), w) for s, w in zip(steps, traj)),
        "reward_std": _weighted_mean((s.get("reward_std"), w) for s, w in zip(steps, traj)),
        "success_rate": _weighted_mean((s.get("success_rate"), w) for s, w in zip(steps, traj)),
        "entropy": _weighted_mean((s.get("entropy"), 1.0) for s in steps),
        "grad_norm": _weighted_mean((s.get("grad_norm"), 1.0) for s in steps),
        "staleness_mean": _weighted_mean((s.get("staleness_mean"), w) for s, w in zip(steps, traj)),
        "staleness_max": max((s.get("staleness_max", 0) for s in steps), default=None),
        "staleness_hist": hist,
        "trained": sum(traj),
        "dropped_stale": sum(s.get("dropped_stale", 0) for s in steps),
        "zero_signal_share": (sum(s.get("zero_signal_groups", 0) for s in steps) / groups) if groups else None,
        "diversity_distinct_rate": div.get("diversity_distinct_rate"),
        "diversity_similarity": div.get("diversity_similarity"),
        "diversity_equal_reward_share": div.get("diversity_equal_reward_share"),
        # learner-side queue figures
        "wait_s": wait, "train_s": busy,
        "wait_ratio": wait / (wait + busy) if wait + busy > 0 else None,
        "tool_calls": calls,
        "tool_timeouts": sum(s.get("tool_timeouts", 0) for s in steps),
        "tool_latency_mean_s": _weighted_mean((s.get("tool_latency_mean_s"), s.get("tool_calls", 0))
                                              for s in steps),
        "tool_latency_p95_s": max(p95) if p95 else None,
    }


def tool_stats(groups) -> dict:
    """Tool-call figures of a learner step's groups (``messages.Group``); the learner merges them in."""
    lat = sorted(x for g in groups for t in g.trajectories for x in t.tool_latency_s)
    calls = sum(t.tool_calls for g in groups for t in g.trajectories)
    return {
        "tool_calls": calls,
        "tool_timeouts": sum(t.tool_timeouts for g in groups for t in g.trajectories),
        "tool_latency_mean_s": sum(lat) / len(lat) if lat else None,
        "tool_latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
    }


# --- resources of this node -----------------------------------------------------------------------


class ResourceProbe:
    """CPU% and RSS of worker process trees (psutil), this node's totals, and GPUs (nvidia-ml-py).

    CPU% is psutil's: 100 means one core busy, and it is measured between two
    calls, so a process seen for the first time reports None.
    """

    def __init__(self, use_gpu: bool = True):
        import psutil

        self.psutil = psutil
        self.procs: dict[int, object] = {}
        self.nvml = _Nvml.open() if use_gpu else None
        self.gpu_peak: dict[int, int] = {}
        self.prev_io: tuple[float, object, object] | None = None
        psutil.cpu_percent(None)  # prime the system-wide figure

    def _proc(self, pid: int):
        p = self.procs.get(pid)
        if p is None:
            p = self.procs[pid] = self.psutil.Process(pid)
            p.cpu_percent(None)
            return p, False
        return p, True

    def process_tree(self, pid: int) -> dict | None:
        """CPU% and RSS summed over a worker and its children (vLLM runs its engine in a child)."""
        ps = self.psutil
        try:
            root, primed = self._proc(pid)
            tree = [root] + root.children(recursive=True)
        except (ps.NoSuchProcess, ps.AccessDenied):
            self.procs.pop(pid, None)
            return None
        cpu, rss = 0.0, 0
        for p in tree:
            try:
                proc, seen = self._proc(p.pid)
                cpu += proc.cpu_percent(None) if seen else 0.0  # a new child counts from the next sample
                rss += proc.memory_info().rss
            except (ps.NoSuchProcess, ps.AccessDenied):
                self.procs.pop(p.pid, None)
        return {"cpu_percent": round(cpu, 1) if primed else None, "rss_bytes": rss,
                "processes": len(tree), "pids": [p.pid for p in tree]}

    def workers(self, records: list[dict], node: str) -> dict:
        gpu_mem = self.nvml.process_memory() if self.nvml else {}
        out = {}
        for w in records:
            if w.get("node") != node or w.get("state") not in LIVE_STATES:
                continue
            tree = self.process_tree(int(w["pid"]))
            if tree is None:
                continue
            pids = tree.pop("pids")
            row = {"role": w["role"], "pid": w["pid"], **tree}
            if self.nvml:
                row["gpu_memory_bytes"] = sum(gpu_mem.get(p, 0) for p in pids)
            out[w["id"]] = row
        for pid in [p for p in self.procs if not self.psutil.pid_exists(p)]:
            self.procs.pop(pid, None)  # exited children and workers: a reused pid starts afresh
        return out

    def node(self, dt_s: float) -> dict:
        ps = self.psutil
        vm = ps.virtual_memory()
        now, net, disk = time.monotonic(), ps.net_io_counters(), ps.disk_io_counters()
        row = {"host": socket.gethostname(), "cpu_percent": ps.cpu_percent(None), "cpus": ps.cpu_count(),
               "memory_used_bytes": vm.total - vm.available, "memory_total_bytes": vm.total}
        if self.prev_io is not None:
            t0, net0, disk0 = self.prev_io
            dt = max(now - t0, 1e-6)
            if net and net0:
                row["net_rx_bytes_per_s"] = (net.bytes_recv - net0.bytes_recv) / dt
                row["net_tx_bytes_per_s"] = (net.bytes_sent - net0.bytes_sent) / dt
            if disk and disk0:
                row["disk_read_bytes_per_s"] = (disk.read_bytes - disk0.read_bytes) / dt
                row["disk_write_bytes_per_s"] = (disk.write_bytes - disk0.write_bytes) / dt
        self.prev_io = (now, net, disk)
        return row

    def gpus(self) -> list[dict]:
        if not self.nvml:
            return []
        rows = self.nvml.devices()
        for g in rows:
            self.gpu_peak[g["index"]] = max(self.gpu_peak.get(g["index"], 0), g["memory_used_bytes"])
            g["memory_peak_bytes"] = self.gpu_peak[g["index"]]
        return rows


class _Nvml:
    """The few NVML calls we need; ``open()`` is None where there is no driver or no nvidia-ml-py."""

    def __init__(self, pynvml):
        self.nv = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    @classmethod
    def open(cls) -> "_Nvml | None":
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            probe = cls(pynvml)
        except pynvml.NVMLError:
            return None
        return probe if probe.handles else None

    def devices(self) -> list[dict]:
        out = []
        for i, h in enumerate(self.handles):
            try:
                util = self.nv.nvmlDeviceGetUtilizationRates(h)
                mem = self.nv.nvmlDeviceGetMemoryInfo(h)
            except self.nv.NVMLError:
                continue
            out.append({"index": i, "util_percent": float(util.gpu), "memory_util_percent": float(util.memory),
                        "memory_used_bytes": int(mem.used), "memory_total_bytes": int(mem.total)})
        return out

    def process_memory(self) -> dict[int, int]:
        used: dict[int, int] = {}
        for h in self.handles:
            try:
                procs = self.nv.nvmlDeviceGetComputeRunningProcesses(h)
            except self.nv.NVMLError:
                continue
            for p in procs:
                used[p.pid] = used.get(p.pid, 0) + int(p.usedGpuMemory or 0)
        return used


# --- the sampler ---------------------------------------------------------------------------------


class MetricsSampler:
    """Reads one sample of a job's four metric kinds; ``sample()`` also records it."""

    def __init__(self, r: redis.Redis, job: str, run_dir: Path | str | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, *, node: str | None = None,
                 probe: ResourceProbe | None = None, from_start: bool = True):
        self.r, self.job, self.keys = r, job, JobKeys(job)
        self.run_dir = Path(run_dir) if run_dir else None
        self.interval_s = interval_s
        self.node = node or socket.gethostname()
        self.probe = probe if probe is not None else ResourceProbe()
        self.prev_counters: dict | None = None
        self.prev_at: float | None = None
        # Learner steps are read from their stream since this id: all of them for a run we
        # start with, only new ones when we attach to a running job.
        self.step_cursor = "0-0" if from_start else self._last_id(self.keys.metrics)

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
        """Counters and time of the previous sample; zeros at the job's start for the first one."""
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
        self.prev_counters, self.prev_at = counters, now
        return {
            "kind": "sample", "schema": SCHEMA_VERSION, "at": now, "job": self.job, "node": self.node,
            "dt_s": round(dt, 3), "phase": st["phase"], "policy_version": st["policy_version"],
            "allocation": st["allocation"]["roles"], "workers": _workers_by_state(st["workers"]),
            "counters": counters,
            "throughput": {**rates(prev, counters, dt), "learner_steps": agg["steps"]},
            "resources": self.resources(st["workers"], dt),
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
        return {"workers": per_worker, "by_role": by_role, "node": self.probe.node(dt), "gpus": self.probe.gpus()}

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
        line = json.dumps(sample)
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


def _workers_by_state(workers: list[dict]) -> dict:
    out: dict[str, dict[str, int]] = {}
    for w in workers:
        role = out.setdefault(w["role"], {})
        role[w["state"]] = role.get(w["state"], 0) + 1
    return out


def append_line(path: Path, line: str) -> None:
    """Append one line with a single O_APPEND write, so lines of concurrent writers never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


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


def read_jsonl(path: Path | str, kind: str | None = None) -> list[dict]:
    """Lines of a JSONL file (``metrics.jsonl``, ``events.jsonl``), optionally of one kind; bad lines skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if isinstance(row, dict) and (kind is None or row.get("kind") == kind):
                    out.append(row)
    except FileNotFoundError:
        return []
    return out
