"""What a node's processes use: CPU and memory of each worker's process tree (psutil), GPUs (nvidia-ml-py).

``ResourceProbe`` is called by the metrics sampler (``observe.metrics``) in
the process that samples a job (``libra-ctl run``, or the doctor); NVML is
optional and loaded only where a GPU answers.
"""

from __future__ import annotations

import socket
import time

LIVE_STATES = ("starting", "running", "waiting", "draining")   # worker states whose processes are measured


def live_on(records: list[dict], node: str) -> list[dict]:
    """The worker records of live processes on ``node`` (those a sample measures)."""
    return [w for w in records if w.get("node") == node and w.get("state") in LIVE_STATES]

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
        for w in live_on(records, node):
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

    def gpus(self, devices: set[str] | None = None) -> list[dict]:
        """This node's GPUs; with ``devices`` (CUDA_VISIBLE_DEVICES ids: an index or a UUID) only those."""
        if not self.nvml:
            return []
        rows = self.nvml.devices()
        if devices is not None:
            rows = [g for g in rows if str(g["index"]) in devices or g.get("uuid") in devices]
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
                uuid = self.nv.nvmlDeviceGetUUID(h)
            except self.nv.NVMLError:
                continue
            out.append({"index": i, "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                        "util_percent": float(util.gpu), "memory_util_percent": float(util.memory),
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
