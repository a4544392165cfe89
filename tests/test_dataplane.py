"""The data plane's guarantees, against real Redis servers and real processes.

- a reward worker killed with SIGKILL while it holds entries: another worker
  completes them once they have been idle ``min_idle``, and not before;
- every kind of bad message is dead-lettered with its own reason while the
  stage goes on with the good ones;
- a long run keeps stream lengths and Redis memory bounded (MINID trimming);
- a full Redis (noeviction) makes producers wait, not crash or drop;
- the feeder stops at ``admission_limit`` trajectories in flight and resumes
  as the learner trains;
- ``libra-ctl bench streams`` delivers every group exactly once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from pipeline import config as config_mod
from pipeline.sim import bench_streams
from pipeline.dataplane import messages as m
from workers.feeder import admission_limit
from pipeline.dataplane.keys import GROUP_LEARNER, GROUP_REWARD, JOBS, JobKeys, job_pattern
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect
from pipeline.dataplane.streams import (TRIM_EVERY, ClaimPolicy, Dedup, ensure_groups, execute_with_backpressure,
                              group_pending, run_stage, stream_lag, trim)

ROOT = Path(__file__).resolve().parent.parent
JOB = "dp"


def group(pid: str, n: int = 4, tokens: int = 32, reward: float | None = None) -> m.Group:
    trajs = tuple(m.Trajectory(
        sample_idx=i, completion=np.arange(tokens, dtype=np.int32), mask=np.ones(tokens, np.uint8),
        logprobs=np.full(tokens, -0.5, np.float32), text="t", finish="answer", turns=1, tool_calls=0,
        tool_latency_s=(), tool_timeouts=0, reward=reward) for i in range(n))
    return m.Group(prompt_id=pid, prompt="Q", answer=1, prompt_tokens=np.array([1, 2], np.int32), version=0,
                   worker="test", generated_at=1.0, gen_s=0.0, trajectories=trajs)


def push(r, stream: str, payload: bytes) -> bytes:
    return r.xadd(stream, {m.FIELD: payload})


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def start_worker(redis_url: str, consumer: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.dataplane_worker", "--url", redis_url, "--job", JOB,
                             "--consumer", consumer, *extra], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


def scored_ids(r) -> list[str]:
    return [m.decode(f[m.FIELD], 1 << 30).prompt_id for _i, f in r.xrange(JobKeys(JOB).scored)]


def pending_of(r, stream: str, group: str, consumer: str) -> int:
    return len(r.xpending_range(stream, group, min="-", max="+", count=1000, consumername=consumer))


# --- a dead reward worker's entries are reclaimed after min_idle -----------------------------------


@pytest.mark.slow
def test_a_killed_reward_worker_s_entries_are_completed_by_another_after_min_idle(r, redis_url):
    keys = JobKeys(JOB)
    ensure_groups(r, keys)
    for i in range(6):
        push(r, keys.rollouts, m.encode(group(f"g{i}")))
    slow = start_worker(redis_url, "reward-slow", "--sleep-s", "600", "--min-idle-ms", "1000")
    wait_for(lambda: pending_of(r, keys.rollouts, GROUP_REWARD, "reward-slow") == 6, what="the slow worker's read")
    fast = start_worker(redis_url, "reward-fast", "--min-idle-ms", "1000")
    try:
        # Alive, the slow worker's claim keeper refreshes its claim: nobody takes its entries.
        time.sleep(2.5)
        assert r.xlen(keys.scored) == 0
        assert pending_of(r, keys.rollouts, GROUP_REWARD, "reward-slow") == 6
        slow.send_signal(signal.SIGKILL)
        slow.wait()
        killed_at = time.monotonic()
        wait_for(lambda: r.xlen(keys.scored) == 6, 20, "the fast worker to complete the dead one's entries")
        # Not before min_idle: idle counts from the keeper's last refresh, at most its interval
        # (0.5 s) before the kill.
        assert time.monotonic() - killed_at >= 1.0 - 0.5 - 0.05
        assert sorted(scored_ids(r)) == [f"g{i}" for i in range(6)]
        assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0
        assert int(r.hget(keys.counters, "scored")) == 6 * 4
        assert r.xlen(keys.dead_letters) == 0  # two deliveries, under max_deliveries
    finally:
        if slow.poll() is None:
            slow.kill()
        assert stop(fast) == 0


# --- bad input is contained ------------------------------------------------------------------------


def _body(g: m.Group) -> dict:
    return msgpack.unpackb(m.encode(g), raw=False)


def _with(change) -> bytes:
    body = _body(group("bad"))
    change(body)
    return msgpack.packb(body, use_bin_type=True)


def bad_payloads() -> dict[str, tuple[bytes, str]]:
    """name -> (payload, the start of its dead-letter reason)."""
    empty_traj = group("bad")
    t0 = empty_traj.trajectories[0]
    empty_traj = m.Group(**{**empty_traj.__dict__, "trajectories": (m.Trajectory(**{
        **t0.__dict__, "completion": np.zeros(0, np.int32), "mask": np.zeros(0, np.uint8),
        "logprobs": np.zeros(0, np.float32)}),)})
    return {
        "malformed msgpack": (b"\xc1\xc1 not msgpack", "malformed msgpack"),
        "truncated msgpack": (m.encode(group("cut"))[:50], "malformed msgpack"),
        "unknown schema version": (_with(lambda b: b.update(v=99)), "unknown schema version 99"),
        "missing field": (_with(lambda b: b.pop("prompt_id")), "missing field 'prompt_id'"),
        "mistyped field": (_with(lambda b: b.update(version="7")), "field 'version': expected int, got str"),
        "mistyped trajectory field": (_with(lambda b: b["trajectories"][1].update(turns=1.5)),
                                      "field 'turns': expected int, got float"),
        "mistyped list element": (_with(lambda b: b["trajectories"][0].update(tool_latency_s=["slow"])),
                                  "trajectory 0: tool_latency_s holds a str"),
        "oversized": (m.encode(group("big", tokens=20_000)), "oversized"),
        "NaN reward": (m.encode(group("nan", reward=math.nan)), "trajectory 0: reward is nan"),
        "infinite reward": (m.encode(group("inf", reward=math.inf)), "trajectory 0: reward is inf"),
        "NaN log-prob": (_with(lambda b: b["trajectories"][2].update(
            logprobs=np.array([math.nan] * 32, np.float32).tobytes())), "trajectory 2: non-finite behaviour log-prob"),
        "ragged arrays": (_with(lambda b: b["trajectories"][0].update(mask=b"\x01")),
                          "trajectory 0: completion, mask and logprobs lengths differ"),
        "empty trajectory": (m.encode(empty_traj), "empty trajectory: sample 0 has no tokens"),
        "empty group": (_with(lambda b: b.update(trajectories=[])), "empty group"),
        "not a map": (msgpack.packb([1, 2, 3]), "malformed message: a list"),
    }


@pytest.mark.slow
def test_each_kind_of_bad_message_is_dead_lettered_with_its_reason_while_the_stage_goes_on(r, redis_url):
    keys = JobKeys(JOB)
    ensure_groups(r, keys)
    worker = start_worker(redis_url, "reward-0", "--max-bytes", "200000", "--count", "4")
    try:
        expected, good = {}, []
        for k, (name, (payload, reason)) in enumerate(bad_payloads().items()):
            push(r, keys.rollouts, m.encode(group(f"good-{k}")))
            good.append(f"good-{k}")
            expected[push(r, keys.rollouts, payload)] = (name, reason)
        wait_for(lambda: r.xlen(keys.scored) == len(good) and r.xlen(keys.dead_letters) == len(expected),
                 30, "every message to be scored or dead-lettered")
        for _id, f in r.xrange(keys.dead_letters):
            name, reason = expected[f[b"id"]]
            assert f[b"reason"].decode().startswith(reason), (name, f[b"reason"])
            assert f[b"stream"].decode() == keys.rollouts and int(f[b"deliveries"]) == 1
        assert sorted(scored_ids(r)) == sorted(good)
        assert worker.poll() is None  # still running: one more good message goes through
        push(r, keys.rollouts, m.encode(group("after")))
        wait_for(lambda: "after" in scored_ids(r), 10, "the message after the bad ones")
        assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0
    finally:
        assert stop(worker) == 0
    listed = subprocess.run([sys.executable, "-m", "pipeline.cli", "dlq", "list", "--json", "--job", JOB,
                             "--redis", redis_url], cwd=ROOT, capture_output=True, text=True)
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == len(expected)


# --- a long run keeps memory bounded -----------------------------------------------------------------


class Pipeline:
    """The bench's three stages (production loop, no compute) in threads, fed prompt by prompt."""

    def __init__(self, url: str, spec: bench_streams.BenchSpec):
        self.r, self.keys, self.spec = connect(url), JobKeys(JOB), spec
        ensure_groups(self.r, self.keys)
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=fn, args=(connect(url), self.keys, spec, self.halt.is_set),
                                         daemon=True)
                        for fn in (bench_streams.libra_rollout, bench_streams.libra_reward,
                                   bench_streams.libra_learner)]
        for t in self.threads:
            t.start()
        self.issued = 0
        self.longest = 0  # the longest any stream got while running

    def trained_groups(self) -> int:
        return int(self.r.hget(self.keys.counters, "trained") or 0) // self.spec.group_size

    def run(self, groups: int, in_flight: int = 64) -> None:
        target = self.issued + groups
        while self.issued < target:
            room = in_flight - (self.issued - self.trained_groups())
            if room <= 0:
                self.longest = max(self.longest, *(self.r.xlen(s) for _n, s, _g in self.keys.stages))
                time.sleep(0.002)
                continue
            pipe = self.r.pipeline(transaction=False)
            # never more than in_flight groups in flight (a batch of 16 on top of 63 would make 79): the
            # stream bound below counts on it when the stages lag on a loaded machine
            for _ in range(min(16, target - self.issued, room)):
                pipe.xadd(self.keys.prompts, {m.FIELD: m.encode(m.Prompt(f"p{self.issued}", "Q", 1, 0.0))})
                self.issued += 1
            pipe.execute()
        wait_for(lambda: self.trained_groups() == self.issued, 120, "the pipeline to drain")

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(timeout=10)


def settle(r, keys: JobKeys) -> tuple[int, dict[str, int]]:
    """Trim every stream once more, then (memory of the data, stream lengths).

    The data's memory is ``used_memory`` less Redis's own buffers: clients'
    output buffers and, while an AOF rewrite runs, the AOF rewrite buffer,
    which holds a copy of every write made meanwhile (it is freed when the
    rewrite ends).
    """
    for _stage, stream, _group in keys.stages:
        trim(r, stream)
    wait_for(lambda: not int(r.info("persistence").get("aof_rewrite_in_progress", 0)), 60, "the AOF rewrite")
    # used_memory_dataset is used_memory less the overhead, computed unsigned: where the overhead reads above
    # used_memory for a moment, it wraps to near 2**64 (seen once in CI: 18446744073709450417). Read again.
    mem: dict = {}

    def unwrapped() -> bool:
        mem.update(r.info("memory"))
        return int(mem["used_memory_dataset"]) < 2 ** 63

    wait_for(unwrapped, 10, "a dataset size that did not wrap")
    return int(mem["used_memory_dataset"]), {s.rsplit(":", 1)[-1]: r.xlen(s) for _n, s, _g in keys.stages}


@pytest.mark.slow
def test_a_long_run_keeps_streams_and_memory_bounded(redis_url):
    n = 1500
    spec = bench_streams.BenchSpec(group_size=4, tokens=512, count=16, block_ms=20)
    bytes_per_group = len(m.encode(group("x", n=4, tokens=512)))
    pipeline = Pipeline(redis_url, spec)
    try:
        pipeline.run(n)
        mem_1, lengths_1 = settle(pipeline.r, pipeline.keys)
        pipeline.run(2 * n)
        mem_3, lengths_3 = settle(pipeline.r, pipeline.keys)
    finally:
        pipeline.stop()
    r, keys = pipeline.r, pipeline.keys
    assert int(r.hget(keys.counters, "trained")) == 3 * n * 4, r.hgetall(keys.counters)
    # While running, a stream holds what is in flight plus what was acknowledged since its stage's
    # last trim (every TRIM_EVERY rounds of up to `count` entries); trimmed, only the last-delivered
    # entry stays.
    assert pipeline.longest <= 64 + TRIM_EVERY * spec.count + 1, pipeline.longest
    assert max(lengths_1.values()) <= 1 and max(lengths_3.values()) <= 1, (lengths_1, lengths_3)
    # 2n more groups crossed two payload streams (2 x 2n x ~8 KB, ~50 MB); what stays is the dedup
    # marks (about 100 bytes a group and stage, expiring after their window) and allocator noise.
    grown = mem_3 - mem_1
    assert grown < 0.05 * 2 * (2 * n * bytes_per_group), (mem_1, mem_3)
    assert r.xlen(keys.dead_letters) == 0, r.xrange(keys.dead_letters, count=3)


# --- a full Redis is backpressure ---------------------------------------------------------------------


def test_an_embedded_redis_under_a_path_with_equals_answers_client_info(tmp_path):
    # A run directory named after key=value: rq's worker reads CLIENT INFO, whose laddr=<socket path>
    # redis-py cannot parse when the path holds '='.
    with EmbeddedRedis(tmp_path / "learner.lr=1e-3" / "redis") as server:
        assert "=" not in str(server.socket)
        assert connect(server.url).client_info()["laddr"].startswith(str(server.socket))


@pytest.fixture
def small_redis(tmp_path):
    with EmbeddedRedis(tmp_path / "full-redis") as server:
        yield server.url


@pytest.mark.slow
def test_a_full_redis_makes_producers_wait_and_loses_nothing(small_redis):
    r, keys = connect(small_redis), JobKeys(JOB)
    ensure_groups(r, keys)
    for i in range(10):
        push(r, keys.rollouts, m.encode(group(f"g{i}", tokens=4096)))
    # Full: half of what is in use (the AOF buffer, counted in used_memory, is not counted against it).
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) // 2))
    halt = threading.Event()
    errors: list[BaseException] = []

    def stage():
        try:
            run_stage(connect(small_redis), keys, source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0",
                      sink=keys.scored, handle=lambda gs: [g.with_rewards([1.0] * 4, 0.0) for g in gs], count=4,
                      block_ms=50, max_bytes=1 << 20, claims=ClaimPolicy(60_000, 3), stop=halt.is_set,
                      counter="scored", dedup=Dedup("reward", 600))
        except BaseException as exc:  # the test fails on any
            errors.append(exc)

    def feeder():  # the feeder's write path: entry and counters in one transaction, retried while full
        try:
            for i in range(5):
                def build(i=i):
                    pipe = r.pipeline(transaction=True)
                    pipe.xadd(keys.prompts, {m.FIELD: m.encode(m.Prompt(f"p{i}", "Q", 1, 0.0))})
                    pipe.hincrby(keys.counters, "issued_prompts", 1)
                    return pipe
                execute_with_backpressure(build)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stage, daemon=True), threading.Thread(target=feeder, daemon=True)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.5)
        assert all(t.is_alive() for t in threads) and not errors, errors
        assert r.xlen(keys.scored) == 0 and r.xlen(keys.prompts) == 0  # nothing written ...
        assert group_pending(r, keys.rollouts, GROUP_REWARD) == 4  # ... and the batch in hand still held
        assert r.xlen(keys.dead_letters) == 0
        r.config_set("maxmemory", "2gb")
        wait_for(lambda: r.xlen(keys.scored) == 10 and not threads[1].is_alive(), 30, "the writes after the raise")
    finally:
        halt.set()
        for t in threads:
            t.join(timeout=10)
    assert not errors
    assert sorted(scored_ids_of(r, keys)) == sorted(f"g{i}" for i in range(10))
    assert r.xlen(keys.prompts) == 5 and int(r.hget(keys.counters, "issued_prompts")) == 5
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0 and stream_lag(r, keys.rollouts, GROUP_REWARD) == 0
    assert int(r.hget(keys.counters, "scored")) == 40


def scored_ids_of(r, keys: JobKeys) -> list[str]:
    return [m.decode(f[m.FIELD], 1 << 30).prompt_id for _i, f in r.xrange(keys.scored)]


# --- the feeder's admission bound ---------------------------------------------------------------------


def feeder_run(tmp_path: Path, r, redis_url: str, job: str = JOB, extra: tuple[str, ...] = ()
               ) -> tuple[Path, config_mod.Config]:
    """A job's run directory and Redis state, ready for a feeder process (no other worker)."""
    cfg = config_mod.load(None, [f"job.name={job}", "rollout.group_size=4", "learner.batch_size=8",
                                 "learner.max_staleness=1", "learner.publish_every=1",
                                 "streams.max_queue_size=64", *extra])
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"config": cfg.to_dict(),
                                                       "redis": {"url": redis_url, "embedded": False}}))
    r.sadd(JOBS, job)
    r.hset(JobKeys(job).state, mapping={"phase": "running", "run_dir": str(run_dir)})
    return run_dir, cfg


@contextlib.contextmanager
def feeder_process(run_dir: Path, redis_url: str):
    """A ``workers.feeder`` process on the run; killed on the way out unless it has exited."""
    proc = subprocess.Popen([sys.executable, "-m", "workers.feeder", "--run-dir", str(run_dir),
                             "--worker-id", "feeder-0"], cwd=ROOT, env=dict(os.environ, **{ENV_URL: redis_url}))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_feeder_stops_at_the_admission_limit_and_resumes_as_the_learner_trains(tmp_path, r, redis_url):
    run_dir, cfg = feeder_run(tmp_path, r, redis_url)
    keys = JobKeys(JOB)
    limit = admission_limit(cfg)
    assert limit == 16  # (max_staleness + 1) x batch_size, under max_queue_size
    with feeder_process(run_dir, redis_url) as proc:
        def issued() -> int:
            return int(r.hget(keys.counters, "issued") or 0)

        wait_for(lambda: issued() == limit, 30, "the feeder to fill the admission window")
        time.sleep(1.0)
        assert issued() == limit and r.xlen(keys.prompts) == limit // 4  # stopped there
        r.hincrby(keys.counters, "trained", 8)  # the learner trains a batch: two groups' room
        wait_for(lambda: issued() == limit + 8, 10, "the feeder to resume")
        time.sleep(0.5)
        assert issued() == limit + 8
        r.hincrby(keys.counters, "dead_lettered", 4)  # dead letters are accounted for too
        wait_for(lambda: issued() == limit + 12, 10, "room from a dead letter")
        r.hset(keys.counters, "dropped_held", 4)  # the learner's batch holds a stale group: room before its step
        wait_for(lambda: issued() == limit + 16, 10, "room from a held drop")
        pipe = r.pipeline(transaction=True)  # the step commits the held drop: no more room than before
        pipe.hincrby(keys.counters, "dropped_stale", 4).hset(keys.counters, "dropped_held", 0).execute()
        time.sleep(0.5)
        assert issued() == limit + 16
        r.hset(keys.policy, mapping={"version": 5, "path": "x"})   # the learner publishes version 5
        r.hset(keys.counters, "filtered_held", 4)  # dynamic sampling holds a group without signal: room too
        wait_for(lambda: issued() == limit + 20, 10, "room from a held group without signal")
        pipe = r.pipeline(transaction=True)  # the step commits it as trained: no more room than before
        pipe.hincrby(keys.counters, "trained", 4).hset(keys.counters, "filtered_held", 0).execute()
        time.sleep(0.5)
        assert issued() == limit + 20
        r.hset(keys.state, "phase", "done")
        assert proc.wait(timeout=30) == 0
    prompts = [m.decode(f[m.FIELD], 1 << 20) for _i, f in r.xrange(keys.prompts)]
    ids = [p.prompt_id for p in prompts]
    assert len(ids) == len(set(ids)) == (limit + 20) // 4
    # each prompt carries the version published when it was issued (rollout generates it with that or newer)
    assert [p.min_version for p in prompts] == [0] * ((limit + 16) // 4) + [5]


def test_the_feeder_holds_while_the_learner_is_a_batch_behind(tmp_path, r, redis_url):
    run_dir, cfg = feeder_run(tmp_path, r, redis_url)
    keys = JobKeys(JOB)
    assert cfg.streams.backlog_batches * cfg.learner.batch_size == 10       # trajectories: 2.5 groups of 4
    ensure_groups(r, keys)
    for _ in range(3):                                   # 3 scored groups (12 trajectories) wait for the learner
        r.xadd(keys.scored, {m.FIELD: b"x"})
    with feeder_process(run_dir, redis_url) as proc:
        wait_for(lambda: r.hget(keys.workers, "feeder-0") is not None, 30, "the feeder to start")
        time.sleep(1.5)
        assert int(r.hget(keys.counters, "issued") or 0) == 0       # room in the window, but the learner is behind
        r.xreadgroup(GROUP_LEARNER, "learner-0", {keys.scored: ">"}, count=1)      # it takes one: 8 left
        wait_for(lambda: int(r.hget(keys.counters, "issued") or 0) == admission_limit(cfg), 30,
                 "the feeder to fill the window once the learner caught up")
        r.hset(keys.state, "phase", "done")
        assert proc.wait(timeout=30) == 0


def test_synchronous_refills_stop_at_what_the_learner_reads_in_a_step(tmp_path, r, redis_url):
    # max_staleness 0, dynamic sampling reading at most 1.5 batches (12 trajectories) a step: a refill past
    # that would reach the learner after its step, with the weights before it, only to be dropped as stale
    run_dir, cfg = feeder_run(tmp_path, r, redis_url, extra=(
        "learner.max_staleness=0", "learner.dynamic_sampling=true", "learner.dynamic_sampling_max=1.5"))
    keys = JobKeys(JOB)

    def issued() -> int:
        return int(r.hget(keys.counters, "issued") or 0)

    with feeder_process(run_dir, redis_url) as proc:
        wait_for(lambda: issued() == 8, 30, "the feeder to issue one batch")
        r.hset(keys.counters, "filtered_held", 4)      # a group without signal: one refill
        wait_for(lambda: issued() == 12, 10, "the refill")
        r.hset(keys.counters, "filtered_held", 8)      # another: its refill would be the 16th trajectory
        time.sleep(1.0)
        assert issued() == 12
        pipe = r.pipeline(transaction=True)            # the step commits: trained, the held ones with it
        pipe.hincrby(keys.counters, "trained", 12).hset(keys.counters, "filtered_held", 0).execute()
        wait_for(lambda: issued() == 20, 10, "the next step's batch")
        r.hset(keys.state, "phase", "done")
        assert proc.wait(timeout=30) == 0


def test_at_max_staleness_0_the_feeder_admits_one_batch():
    cfg = config_mod.load(None, ["learner.max_staleness=0", "learner.batch_size=64", "streams.max_queue_size=512"])
    assert admission_limit(cfg) == 64


# --- the benchmark delivers every group exactly once ---------------------------------------------------


def test_bench_streams_json_and_exactly_once(tmp_path, redis_url):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", "streams", "--seconds", "0.7",
                           "--warmup", "0.3", "--rounds", "1", "--tokens", "256", "--json", str(out),
                           "--redis", redis_url], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    assert {"trajectories_per_s", "mb_per_s", "raw_trajectories_per_s", "ratio"} <= set(res)
    assert res["trajectories_per_s"] > 0 and res["raw_trajectories_per_s"] > 0 and res["mb_per_s"] > 0
    assert res["ratio"] == pytest.approx(res["trajectories_per_s"] / res["raw_trajectories_per_s"], rel=0.01)
    eo = res["exactly_once"]
    assert eo["issued_groups"] > 0 and eo["drained"]
    assert eo["delivered_entries"] == eo["distinct_groups"] == eo["issued_groups"]
    assert eo["lost_groups"] == 0 and eo["duplicate_entries"] == 0 and eo["bad"] == 0
    assert "ratio" in done.stdout
    assert not connect(redis_url).keys(job_pattern("bench-streams-*"))  # it cleans up after itself


def test_bench_streams_grid_of_sizes_and_consumers(tmp_path, redis_url):
    """--sizes sets tokens to the asked encoded size; --consumers runs that many rollout and reward
    consumers; every cell delivers every group exactly once and the table has a row per cell."""
    for kb in (4, 16, 64):
        spec = bench_streams.BenchSpec(tokens=bench_streams.tokens_for_size(bench_streams.BenchSpec(), kb * 1000))
        assert bench_streams.scored_bytes_per_trajectory(spec) == pytest.approx(kb * 1000, rel=0.01)
    out = tmp_path / "grid.json"
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", "streams", "--seconds", "0.5",
                           "--warmup", "0.2", "--rounds", "1", "--sizes", "4", "--consumers", "1,2", "--json", str(out),
                           "--redis", redis_url], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    cells = json.loads(out.read_text())["cells"]
    assert [(c["size_kb"], c["consumers"]) for c in cells] == [(4, 1), (4, 2)]
    for cell in cells:
        assert cell["bytes_per_trajectory"] == pytest.approx(4000, rel=0.01) and cell["ratio"] > 0
        eo = cell["exactly_once"]
        assert eo["issued_groups"] > 0 and eo["drained"] and eo["lost_groups"] == 0 and eo["duplicate_entries"] == 0
    assert "consumers" in done.stdout and done.stdout.count(" KB ") == 2
    bad = subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", "streams", "--consumers", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must be > 0" in bad.stderr


# --- lag without moving payloads, on both servers ---------------------------------------------------


@pytest.mark.parametrize("server", ["embedded", "redis7"])
def test_stream_lag_counts_undelivered_entries_on_redis_6_and_7(request, server):
    from pipeline.dataplane.streams import read

    url = request.getfixturevalue("redis_url" if server == "embedded" else "server_redis_url")
    r, keys = connect(url), JobKeys(JOB)
    ids = [push(r, keys.rollouts, m.encode(group(f"g{i}"))) for i in range(10)]
    ensure_groups(r, keys)
    assert stream_lag(r, keys.rollouts, GROUP_REWARD) == 10
    got = read(r, keys.rollouts, GROUP_REWARD, "reward-0", 4, 10)
    r.xack(keys.rollouts, GROUP_REWARD, *[i for i, _p in got])
    trim(r, keys.rollouts)
    assert stream_lag(r, keys.rollouts, GROUP_REWARD) == 6
    assert stream_lag(r, keys.rollouts, GROUP_REWARD, cap=5) == 5
    r.xdel(keys.rollouts, ids[7])  # Redis 7 then reports no lag; it is counted instead
    assert stream_lag(r, keys.rollouts, GROUP_REWARD) == 5


def test_an_input_without_an_output_stays_pending_for_reclaim(r):
    """A handler that returns fewer outputs than inputs (a bug) must not get the rest acknowledged."""
    from pipeline.dataplane.streams import decode_entries, read, write_and_ack

    keys = JobKeys(JOB)
    ensure_groups(r, keys)
    for i in range(3):
        push(r, keys.rollouts, m.encode(group(f"g{i}")))
    good, bad = decode_entries(read(r, keys.rollouts, GROUP_REWARD, "reward-0", 10, 10), 1 << 20)
    outputs = [good[0][1].with_rewards([1.0] * 4, 0.0)]  # one output for three inputs
    write_and_ack(r, keys, keys.rollouts, GROUP_REWARD, keys.scored, good, outputs, bad, "scored", None,
                  lambda: False, Dedup("reward", 60))
    assert r.xlen(keys.scored) == 1
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 2
