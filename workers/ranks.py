"""The learner's ranks: world size from its slots, rank processes that die with rank 0, their process group.

The learner process (``workers.learner``) is rank 0: the only one that talks
to Redis. When it holds N slots (``LIBRA_SLOTS``, set by the node agent; the
controller keeps a learner's slots on one node) it starts ranks 1..N-1 as
``python -m workers.ranks`` children (``RankGroup.start``), and every step
writes each of them its share of the batch (``workers.update.Share``: whole
groups) down the child's stdin. All ranks then run
``workers.update.train_share`` together in one torch.distributed process
group: gloo on the CPU, nccl on GPUs, where rank i trains on the i-th visible
device (the agent's ``CUDA_VISIBLE_DEVICES`` lists the slots' GPUs).

Why a pipe and not a collective for the work: between steps rank 0 may wait
for data for as long as the pipeline has none, and a collective would time
out; a blocking read does not. Only the steps' own collectives carry a
timeout (``RANK_TIMEOUT_S``).

A rank process never outlives rank 0: it reads EOF on stdin when rank 0 is
gone, asks the kernel to SIGKILL it when its parent dies (Linux
``PR_SET_PDEATHSIG``, for a rank blocked inside a collective), and a watch
thread checks its parent pid (elsewhere). It ignores SIGTERM and SIGINT: a
drain is rank 0's to finish (the step in hand, a checkpoint), after which
rank 0 stops the ranks itself; the agent's SIGKILL goes to the whole process
group, ranks included.

Pipe frames (rank 0 -> rank i): a 4-byte big-endian length, then a msgpack
map ``{"v": 1, "op": "step" | "stop", ...}``; a step carries ``step``,
``version``, ``staleness`` (per group, as rank 0 judged it along the version
tree), ``total_tokens``, ``any_active`` and ``groups``, each group in
its wire encoding (``pipeline.dataplane.messages``): nothing is unpickled.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import msgpack
import structlog
import torch
import torch.distributed as dist

from pipeline import logs
from pipeline.dataplane import messages
from pipeline.dataplane.worker import SLOTS_ENV, load_run_config
from workers.checkpoint import read_optimizer
from workers.update import Share, load_policy, make_optimizer, train_share

FRAME_VERSION = 3  # 2: each group's staleness along the version tree; 3: mini-batches (mini, norms, actives)
# The longest a step's collective waits for a slower rank, and rank 0 for its ranks to load their model.
RANK_TIMEOUT_S = 600.0
STOP_WAIT_S = 30.0  # a rank told to stop that has not exited by then is killed
PR_SET_PDEATHSIG = 1


def world_size() -> int:
    """Slots held (``LIBRA_SLOTS``, e.g. "2,3" -> 2); 1 when unset (a learner started by hand)."""
    return max(1, len([s for s in os.environ.get(SLOTS_ENV, "").split(",") if s.strip()]))


def pick_device(rank: int = 0) -> torch.device:
    """Rank i's device: the i-th visible GPU when there are GPUs (the agent shows only the slots'), else the CPU."""
    return torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def timeout() -> timedelta:
    return timedelta(seconds=RANK_TIMEOUT_S)


def same_weights(model) -> None:
    """Every rank takes rank 0's parameters (and buffers): they start, and so stay, identical."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


# --- frames -----------------------------------------------------------------------------------------


def encode_share(share: Share) -> bytes:
    body = {"v": FRAME_VERSION, "op": "step", "step": share.step, "version": share.version,
            "staleness": list(share.staleness),
            "total_tokens": share.total_tokens, "any_active": share.any_active,
            "mini": list(share.mini), "norms": list(share.norms), "actives": list(share.actives),
            "groups": [messages.encode(g) for g in share.groups]}
    return _frame(body)


def encode_stop() -> bytes:
    return _frame({"v": FRAME_VERSION, "op": "stop"})


def _frame(body: dict) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    return struct.pack(">I", len(raw)) + raw


def read_frame(stream, max_group_bytes: int) -> Share | None:
    """The next share from rank 0; None on "stop" or end of file (rank 0 is gone)."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    raw = stream.read(n)
    if len(raw) < n:
        return None
    body = msgpack.unpackb(raw, raw=False)
    if body.get("v") != FRAME_VERSION:
        raise ValueError(f"rank frame version {body.get('v')!r}, expected {FRAME_VERSION}")
    if body["op"] == "stop":
        return None
    groups = tuple(messages.decode(g, max_group_bytes) for g in body["groups"])
    return Share(step=body["step"], version=body["version"], staleness=tuple(body["staleness"]),
                 total_tokens=body["total_tokens"], any_active=body["any_active"], groups=groups,
                 mini=tuple(body["mini"]), norms=tuple(body["norms"]), actives=tuple(body["actives"]))


# --- rank 0's side ----------------------------------------------------------------------------------


class RankDied(RuntimeError):
    """A rank process is gone (killed, or crashed): the process's fate, not the data's."""


class RankGroup:
    """Rank 0's handle on ranks 1..N-1: starts them, forms the process group, feeds them, stops them."""

    def __init__(self, procs: list[subprocess.Popen], log):
        self.procs, self.log = procs, log

    @classmethod
    def start(cls, run_dir: Path, worker_id: str, world: int, model, model_dir: Path, checkpoint: Path | None,
              log) -> "RankGroup":
        """Start ranks 1..world-1 on the weights of ``model_dir`` (and ``checkpoint``'s optimizer), then join them.

        ``model`` is rank 0's, loaded from ``model_dir``. Rank 0 hosts the
        rendezvous store on a free port; each rank loads its model, says it
        is ready, and joins; then all take rank 0's weights. A rank that exits
        before it is ready fails the start at once, not after the timeout.
        """
        device = next(model.parameters()).device
        if device.type == "cuda" and world > torch.cuda.device_count():
            raise SystemExit(f"learner: {world} slots but {torch.cuda.device_count()} visible GPUs "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}); "
                             "one rank per slot needs one GPU per slot")
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timeout())
        argv = [sys.executable, "-m", "workers.ranks", "--run-dir", str(run_dir), "--worker-id", worker_id,
                "--world", str(world), "--store-port", str(store.port), "--parent-pid", str(os.getpid()),
                "--model-dir", str(model_dir)]
        if checkpoint is not None:
            argv += ["--checkpoint", str(checkpoint)]
        procs = [subprocess.Popen(argv + ["--rank", str(rank)], stdin=subprocess.PIPE) for rank in range(1, world)]
        group = cls(procs, log)
        try:
            group.wait_ready(store, world)
            dist.init_process_group(backend_for(device), store=store, rank=0, world_size=world, timeout=timeout())
            same_weights(model)
        except BaseException:
            group.kill()
            raise
        log.info("ranks_started", world=world, backend=backend_for(device), pids=[p.pid for p in procs])
        return group

    def wait_ready(self, store, world: int) -> None:
        keys = [f"ready/{rank}" for rank in range(1, world)]
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while not store.check(keys):
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    raise RuntimeError(f"learner rank {rank} exited with code {p.returncode} before joining")
            if time.monotonic() > deadline:
                raise RuntimeError(f"learner ranks not ready after {RANK_TIMEOUT_S:g}s")
            time.sleep(0.05)

    def send(self, shares: list[Share]) -> None:
        """Write ranks 1..N-1 their shares of the step; a rank that is gone fails the step (exit, restart)."""
        for rank, (p, share) in enumerate(zip(self.procs, shares), start=1):
            if p.poll() is not None:
                raise RankDied(f"learner rank {rank} exited with code {p.returncode}")
            p.stdin.write(encode_share(share))
            p.stdin.flush()

    def gone(self, wait_s: float = 1.0) -> str | None:
        """Which rank has exited, waiting up to ``wait_s`` for one (a collective fails as its peer's socket
        closes, a moment before the exit shows); None if all still run."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    return f"learner rank {rank} exited with code {p.returncode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self) -> None:
        """Tell every rank to stop, wait for them, kill those that do not exit; leave the process group."""
        for p in self.procs:
            try:
                p.stdin.write(encode_stop())
                p.stdin.close()
            except (BrokenPipeError, ValueError):
                pass  # already gone, or already closed
        deadline = time.monotonic() + STOP_WAIT_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log.warning("rank_killed", pid=p.pid)
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.log.info("ranks_stopped", codes=[p.returncode for p in self.procs])

    def kill(self) -> None:
        """On a failed start: no rank is left running, and this process leaves the group."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


# --- ranks 1..N-1 -----------------------------------------------------------------------------------


def die_with_parent(parent_pid: int) -> None:
    """Never outlive rank 0: the kernel's parent-death signal where there is one, and a watch thread."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watch thread alone
    if os.getppid() != parent_pid:  # died before prctl took effect
        os._exit(1)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def rank_main(argv: list[str] | None = None) -> None:
    """``python -m workers.ranks``: one learner rank > 0, until rank 0 says stop or is gone."""
    p = argparse.ArgumentParser(prog="workers.ranks")
    for name in ("--run-dir", "--worker-id", "--model-dir"):
        p.add_argument(name, required=True)
    for name in ("--rank", "--world", "--store-port", "--parent-pid"):
        p.add_argument(name, required=True, type=int)
    p.add_argument("--checkpoint", default=None)
    args = p.parse_args(argv)
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_dir = Path(args.run_dir)
    cfg = load_run_config(run_dir)
    structlog.contextvars.bind_contextvars(job=cfg.job.name, role="learner", worker=args.worker_id, rank=args.rank)
    log = logs.configure(run_dir / "logs", f"{args.worker_id}-rank{args.rank}", console=False)
    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.job.seed)
    device = pick_device(args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = load_policy(args.model_dir, device, cfg.learner)
    optimizer = make_optimizer(model, cfg.learner)
    if args.checkpoint:
        optimizer.load_state_dict(read_optimizer(Path(args.checkpoint)))
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world, is_master=False, timeout=timeout())
    store.set(f"ready/{args.rank}", "1")
    dist.init_process_group(backend_for(device), store=store, rank=args.rank, world_size=args.world,
                            timeout=timeout())
    same_weights(model)
    log.info("rank_started", rank=args.rank, world=args.world, device=str(device))
    steps = 0
    try:
        while (share := read_frame(sys.stdin.buffer, cfg.streams.max_message_bytes)) is not None:
            train_share(model, optimizer, share, cfg.learner, cfg.rollout.temperature, distributed=True)
            steps += 1
    finally:
        dist.destroy_process_group()
        log.info("rank_exited", rank=args.rank, steps=steps)


if __name__ == "__main__":
    rank_main()
