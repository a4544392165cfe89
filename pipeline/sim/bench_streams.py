"""``libra-ctl bench streams``: the data plane's throughput, beside a raw Redis loop's.

Registered on the ``bench`` subcommand by ``pipeline.cli`` (``add_parser``);
runs in the CLI process, which feeds prompts and measures, and starts one
process per stage (``--stages processes``, the default: Redis is a process of
its own, and three Python stages in one process would share one core through
the GIL) or one thread per stage (``--stages threads``).

Two runs on the same Redis, one after the other, with the same topology,
payload and batching:

- **libra**: feeder -> prompts -> rollout -> rollouts -> reward -> scored ->
  learner, through the production code: ``run_stage`` (reclaim, read, decode
  and validate every field, handle, ``write_and_ack`` with its MULTI/EXEC and
  deduplication marks, trimming) for rollout and reward, and the learner's
  ``read`` / ``decode_entries`` / acknowledge / ``trim``. The handlers do no
  compute: rollout stamps a prebuilt group of ``group_size`` trajectories of
  ``tokens`` token ids, mask and log-probs with the prompt's id; reward sets
  the rewards.
- **raw**: the same three consumers as a minimal XREADGROUP -> pipelined
  XADD of the same bytes + one XACK loop (no decoding, no transaction, no
  marks), trimmed with MINID behind itself.

``--consumers N`` runs N consumers of the rollout and of the reward stage
each (one consumer group per stage, as scaled workers are; the learner stays
one), in both runs. ``--sizes 4,16,64`` sets ``tokens`` so that an encoded
scored trajectory is about that many KB, and with several consumer counts
measures every pair (``run_grid``) and prints a table.

Both are fed by the same admission rule (at most ``in_flight_groups`` groups
issued and not yet consumed by the learner). Trajectories/s is the learner's
consumption rate after a warm-up; MB/s is that rate times the encoded size of
a scored trajectory (what each stream carries). After measuring, the feeder
stops, the pipeline drains, and the learner's count of distinct ids says
whether every issued group arrived exactly once.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import redis

from pipeline import argtypes
from pipeline.dataplane import messages, streams
from pipeline.dataplane.jobs import clear_job
from pipeline.dataplane.keys import GROUP_LEARNER, GROUP_REWARD, GROUP_ROLLOUT, LEARNER, JobKeys
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect

POLL_S = 0.02
FEEDER_POLL_S = 0.005


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark's settings (the command line's options)."""

    seconds: float = 5.0  # measured time of each of the two runs
    warmup_s: float = 1.0  # run before measuring (processes start, buffers fill)
    group_size: int = 8  # trajectories per GRPO group (one stream entry)
    tokens: int = 2048  # token ids per trajectory (int32) + as many log-probs (float32) and mask bytes
    count: int = 16  # groups per XREADGROUP call, and so per write+ack transaction
    in_flight_groups: int = 128  # the feeder's admission bound
    stages: str = "processes"  # processes | threads
    consumers: int = 1  # consumers of the rollout and of the reward stage each (the learner is one)
    dedup: bool = True  # exactly-once marks, as in production
    max_message_bytes: int = 8 << 20
    block_ms: int = 100
    drain_s: float = 30.0  # the longest to wait for the pipeline to empty after measuring
    rounds: int = 3  # alternations of raw and libra runs; each figure is the median
    # CONFIG SET on the embedded server before measuring, e.g. (("appendonly", "no"),); by default it
    # runs as `libra-ctl run` starts it (AOF on, appendfsync everysec, noeviction)
    redis_config: tuple[tuple[str, str], ...] = ()


class RefusedSetting(Exception):
    """A ``--redis-config`` setting the embedded server refused (bad input, said in one line)."""


# --- synthetic messages ---------------------------------------------------------------------


def synthetic_trajectories(spec: BenchSpec, seed: int = 0) -> tuple[messages.Trajectory, ...]:
    """A group's samples of realistic size; built once, stamped onto every prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(spec.group_size):
        mask = (rng.random(spec.tokens) < 0.9).astype(np.uint8)
        out.append(messages.Trajectory(
            sample_idx=i, completion=rng.integers(0, 151_000, spec.tokens, dtype=np.int32), mask=mask,
            logprobs=(-rng.random(spec.tokens, dtype=np.float32) * mask).astype(np.float32),
            text="synthetic", finish="length", turns=1, tool_calls=0, tool_latency_s=(), tool_timeouts=0))
    return tuple(out)


PROMPT_TOKENS = np.arange(64, dtype=np.int32)


def synthetic_group(prompt: messages.Prompt, trajs, worker: str) -> messages.Group:
    return messages.Group(prompt_id=prompt.prompt_id, prompt=prompt.prompt, answer=prompt.answer,
                          prompt_tokens=PROMPT_TOKENS, version=0, worker=worker, generated_at=time.time(),
                          gen_s=0.0, trajectories=trajs)


def scored_bytes_per_trajectory(spec: BenchSpec) -> float:
    prompt = messages.Prompt("p-000000000", "synthetic prompt", 0, 0.0)
    group = synthetic_group(prompt, synthetic_trajectories(spec), "rollout-0")
    scored = group.with_rewards([1.0] * spec.group_size, time.time())
    return len(messages.encode(scored)) / spec.group_size


def tokens_for_size(spec: BenchSpec, size_bytes: int) -> int:
    """Tokens per trajectory that make an encoded scored trajectory about ``size_bytes`` long (``--sizes``).

    A token costs 9 bytes (int32 id, float32 log-prob, mask byte); the rest is
    a fixed share of the group's fields, measured at ``spec.tokens``.
    """
    fixed = scored_bytes_per_trajectory(spec) - 9 * spec.tokens
    return max(1, round((size_bytes - fixed) / 9))


# --- the stages (each in its own process or thread) ----------------------------------------------


def _claims() -> streams.ClaimPolicy:
    return streams.ClaimPolicy(min_idle_ms=60_000, max_deliveries=3)


def _dedup(spec: BenchSpec, stage: str) -> streams.Dedup | None:
    return streams.Dedup(stage=stage, ttl_s=600) if spec.dedup else None


def libra_rollout(r, keys: JobKeys, spec: BenchSpec, stop, consumer: str = "rollout-0") -> None:
    trajs = synthetic_trajectories(spec)
    streams.run_stage(r, keys, source=keys.prompts, group=GROUP_ROLLOUT, consumer=consumer,
                      sink=keys.rollouts, handle=lambda ps: [synthetic_group(p, trajs, consumer) for p in ps],
                      count=spec.count, block_ms=spec.block_ms, max_bytes=spec.max_message_bytes,
                      claims=_claims(), stop=stop, counter="generated", dedup=_dedup(spec, "rollout"))


def _score(groups: list) -> list:
    now = time.time()
    return [g.with_rewards([float(i % 2) for i in range(len(g.trajectories))], now) for g in groups]


def libra_reward(r, keys: JobKeys, spec: BenchSpec, stop, consumer: str = "reward-0") -> None:
    streams.run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer=consumer,
                      sink=keys.scored, handle=_score, count=spec.count, block_ms=spec.block_ms,
                      max_bytes=spec.max_message_bytes, claims=_claims(), stop=stop, counter="scored",
                      dedup=_dedup(spec, "reward"))


class Tally:
    """What the learner saw: entries, distinct group ids, dead letters."""

    def __init__(self):
        self.entries = 0
        self.ids: set[str] = set()
        self.bad = 0

    def result(self) -> dict:
        return {"entries": self.entries, "distinct": len(self.ids), "bad": self.bad}


def libra_learner(r, keys: JobKeys, spec: BenchSpec, stop, consumer: str = LEARNER) -> dict:
    """The learner's data path with no training: read, decode and validate, check, acknowledge, trim.

    The production learner acknowledges at its checkpoints; here every batch
    is a checkpoint.
    """
    tally, rounds = Tally(), 0
    while not stop():
        entries = streams.read(r, keys.scored, GROUP_LEARNER, consumer, spec.count, spec.block_ms)
        if not entries:
            continue
        good, bad = streams.decode_entries(entries, spec.max_message_bytes)
        trained = 0
        for _id, group in good:
            if isinstance(group, messages.Group) and all(t.reward is not None for t in group.trajectories):
                trained += len(group.trajectories)
                tally.ids.add(group.prompt_id)
            else:
                tally.bad += 1
        tally.entries += len(entries)
        tally.bad += len(bad)
        pipe = r.pipeline(transaction=True)
        for entry_id, payload, reason in bad:
            streams.dead_letter(pipe, keys, keys.scored, entry_id, reason, payload)
        pipe.xack(keys.scored, GROUP_LEARNER, *[i for i, _p in entries])
        pipe.hincrby(keys.counters, "trained", trained)
        pipe.execute()
        rounds += 1
        if rounds % streams.TRIM_EVERY == 0:
            streams.trim(r, keys.scored)
    return tally.result()


def raw_stage(r, source: str, group: str, consumer: str, sink: str | None, payload: bytes | None,
              count: int, block_ms: int, stop, counter: tuple[str, int] | None = None) -> dict:
    """The minimal loop: XREADGROUP ``count``; one pipeline of XADDs (``payload``, else the bytes read)
    and one XACK; every ``TRIM_EVERY`` rounds XTRIM MINID at the oldest id just acknowledged."""
    tally, rounds = Tally(), 0
    while not stop():
        reply = r.xreadgroup(group, consumer, {source: ">"}, count=count, block=block_ms)
        if not reply:
            continue
        entries = reply[0][1]
        ids = [i for i, _f in entries]
        pipe = r.pipeline(transaction=False)
        if sink:
            for _id, fields in entries:
                pipe.xadd(sink, {messages.FIELD: payload or fields[messages.FIELD]})
        pipe.xack(source, group, *ids)
        if counter:
            pipe.hincrby(counter[0], "trained", counter[1] * len(ids))
        rounds += 1
        if rounds % streams.TRIM_EVERY == 0:
            pipe.xtrim(source, minid=ids[0], approximate=False)
        pipe.execute()
        tally.entries += len(ids)
    return tally.result()


def stage_main(kind: str, role: str, url: str, job: str, spec: BenchSpec, stop_event, ready, results,
               index: int = 0) -> None:
    """Body of one stage process or thread (consumer ``index`` of its stage): connect, say ready, run
    until ``stop_event``."""
    streams.tune_allocator()  # as run_stage does; the raw loop gets the same process settings
    r = connect(url)
    keys = JobKeys(job)
    stop = stop_event.is_set
    consumer = LEARNER if role == "learner" else f"{role}-{index}"
    ready.put(role)
    cpu0 = time.thread_time()
    if kind == "libra":
        fn = {"rollout": libra_rollout, "reward": libra_reward, "learner": libra_learner}[role]
        out = fn(r, keys, spec, stop, consumer)
    else:
        payload = encoded_unscored(spec) if role == "rollout" else None
        source, group, sink = {"rollout": (keys.prompts, GROUP_ROLLOUT, keys.rollouts),
                               "reward": (keys.rollouts, GROUP_REWARD, keys.scored),
                               "learner": (keys.scored, GROUP_LEARNER, None)}[role]
        counter = (keys.counters, spec.group_size) if role == "learner" else None
        out = raw_stage(r, source, group, consumer, sink, payload, spec.count, spec.block_ms, stop, counter)
    results.put((role, {**(out or {}), "cpu_s": time.thread_time() - cpu0}))


def _stage_process(*args) -> None:
    """A stage process: Ctrl-C (sent to the whole process group by a terminal) is the CLI's to handle, which
    stops the stages through ``stop_event`` and collects their tallies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    stage_main(*args)


def encoded_unscored(spec: BenchSpec) -> bytes:
    prompt = messages.Prompt("p-000000000", "synthetic prompt", 0, 0.0)
    return messages.encode(synthetic_group(prompt, synthetic_trajectories(spec), "rollout-0"))


# --- the feeder and the measurement (in the CLI process) ------------------------------------------


class Feeder(threading.Thread):
    """Issues prompts while fewer than ``in_flight_groups`` are unconsumed, ``count`` per pipeline."""

    def __init__(self, r, keys: JobKeys, spec: BenchSpec):
        super().__init__(daemon=True, name="bench-feeder")
        self.r, self.keys, self.spec = r, keys, spec
        self.issued = 0
        self.cpu_s = 0.0
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def consumed_groups(self) -> int:
        return int(self.r.hget(self.keys.counters, "trained") or 0) // self.spec.group_size

    def run(self) -> None:
        cpu0 = time.thread_time()
        try:
            self._feed()
        except BaseException as exc:  # reported by the driver, which then stops the stages
            self.error = exc
        self.cpu_s = time.thread_time() - cpu0

    def _feed(self) -> None:
        spec = self.spec
        while not self.halt.is_set():
            room = spec.in_flight_groups - (self.issued - self.consumed_groups())
            if room < min(spec.count, spec.in_flight_groups):
                # A round of the learner frees ``count`` groups; polling faster only takes CPU
                # from the stages on a small machine.
                time.sleep(FEEDER_POLL_S)
                continue
            n = min(room, spec.count)
            pipe = self.r.pipeline(transaction=False)
            for k in range(self.issued, self.issued + n):
                msg = messages.Prompt(f"p-{k:09d}", "synthetic prompt", k % 97, time.time())
                pipe.xadd(self.keys.prompts, {messages.FIELD: messages.encode(msg)})
            pipe.hincrby(self.keys.counters, "issued_prompts", n)
            pipe.execute()
            self.issued += n


def _start_stages(kind: str, url: str, job: str, spec: BenchSpec, stop_event, ready, results,
                  workers: list) -> None:
    """One learner, and ``spec.consumers`` consumers of the reward and of the rollout stage, onto ``workers``
    as each starts (an interrupt midway leaves the ones started there, to be stopped)."""
    for role in ("learner", "reward", "rollout"):
        for index in range(1 if role == "learner" else spec.consumers):
            args = (kind, role, url, job, spec, stop_event, ready, results, index)
            name = f"bench-{role}-{index}"
            if spec.stages == "processes":
                w = mp.get_context("fork").Process(target=_stage_process, args=args, name=name, daemon=True)
                # Ctrl-C held over the fork: arriving inside the fork's hooks it is printed and then lost
                # (the run went on to its end); held, it is raised here, after the fork
                old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                try:
                    w.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
            else:
                w = threading.Thread(target=stage_main, args=args, name=name, daemon=True)
                w.start()
            workers.append(w)


def measure(kind: str, url: str, job: str, spec: BenchSpec, say=lambda line: None) -> dict:
    """Run one pipeline (``libra`` or ``raw``) on a fresh job; its rate and its exactly-once counts."""
    r = connect(url)
    keys = JobKeys(job)
    clear_job(r, keys.pattern)
    streams.ensure_groups(r, keys)
    # as the job's feeder records it: the unit a dead letter gives back to the in-flight count
    r.hset(keys.feeder, "group_size", spec.group_size)
    if spec.stages == "processes":
        ctx = mp.get_context("fork")
        stop_event, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    else:
        stop_event, ready, results = threading.Event(), queue.Queue(), queue.Queue()
    workers: list = []
    feeder = Feeder(r, keys, spec)
    redis_cpu0 = _redis_cpu_s(r)
    try:
        _start_stages(kind, url, job, spec, stop_event, ready, results, workers)
        _wait_ready(workers, ready)
        feeder.start()
        rate = _rate(r, keys, spec, feeder, workers)
        feeder.halt.set()
        feeder.join()
        drained = _drain(r, keys, spec, feeder)
    finally:
        feeder.halt.set()
        stop_event.set()
        tallies: dict[str, dict] = {}   # per stage; the CPU summed over its consumers
        for _ in workers:
            try:
                role, out = results.get(timeout=30)
            except queue.Empty:
                break
            cpu_s = tallies.get(role, {}).get("cpu_s", 0.0) + out["cpu_s"]
            tallies[role] = {**out, "cpu_s": cpu_s}
        for w in workers:
            w.join(timeout=10)
        if feeder.error or sys.exc_info()[1] is not None:   # a failed run leaves nothing on a shared Redis
            clear_job(r, keys.pattern)
    if feeder.error:
        raise feeder.error
    learner = tallies.get("learner", {})
    # CPU per trajectory of each process over the whole run (warm-up and drain included): what
    # bounds the rate on a machine of few cores, and what a loaded machine does not distort much.
    done = max(1, int(r.hget(keys.counters, "trained") or 0))
    cpu = {role: t.get("cpu_s", 0.0) for role, t in tallies.items()}
    cpu.update(feeder=feeder.cpu_s, redis=_redis_cpu_s(r) - redis_cpu0)
    cpu_us = {k: round(v / done * 1e6, 1) for k, v in cpu.items()}
    out = {"trajectories_per_s": rate, "issued_groups": feeder.issued, "drained": drained,
           "learner_entries": learner.get("entries", 0), "learner_distinct": learner.get("distinct", 0),
           "learner_bad": learner.get("bad", 0), "stream_lengths": {s: r.xlen(s) for _n, s, _g in keys.stages},
           "used_memory_mb": round(int(r.info("memory")["used_memory"]) / 1e6, 1),
           "cpu_us_per_trajectory": cpu_us}
    say(f"{kind}: {rate:,.0f} trajectories/s; issued {feeder.issued} groups, learner got "
        f"{out['learner_entries']}" + (f" ({out['learner_distinct']} distinct)" if kind == "libra" else "")
        + "; CPU us/trajectory " + " ".join(f"{k}={v:g}" for k, v in cpu_us.items()))
    clear_job(r, keys.pattern)
    return out


def _wait_ready(workers: list, ready, timeout_s: float = 60.0) -> None:
    deadline, waiting = time.monotonic() + timeout_s, len(workers)
    while waiting:
        try:
            ready.get(timeout=0.2)
            waiting -= 1
        except queue.Empty:
            if any(not w.is_alive() for w in workers) or time.monotonic() > deadline:
                raise RuntimeError("bench streams: a stage did not start (see its traceback above)") from None


def _redis_cpu_s(r) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _rate(r, keys: JobKeys, spec: BenchSpec, feeder: Feeder, workers: list) -> float:
    """The learner's trajectories/s over ``seconds`` after ``warmup_s``."""
    time.sleep(spec.warmup_s)
    t0, n0 = time.perf_counter(), int(r.hget(keys.counters, "trained") or 0)
    deadline = t0 + spec.seconds
    while time.perf_counter() < deadline:
        if feeder.error:
            raise feeder.error
        if not all(w.is_alive() for w in workers):
            raise RuntimeError("bench streams: a stage stopped while measuring (see its traceback above)")
        time.sleep(POLL_S)
    t1, n1 = time.perf_counter(), int(r.hget(keys.counters, "trained") or 0)
    return (n1 - n0) / (t1 - t0)


def _drain(r, keys: JobKeys, spec: BenchSpec, feeder: Feeder) -> bool:
    deadline = time.monotonic() + spec.drain_s
    while time.monotonic() < deadline:
        if feeder.consumed_groups() >= feeder.issued:
            return True
        time.sleep(POLL_S)
    return False


def run_bench(spec: BenchSpec, url: str | None = None, say=lambda line: None) -> dict:
    """Both pipelines on ``url`` (else a private embedded Redis); the JSON shape of ``--json``."""
    return _on_redis(spec, url, lambda u: _run_all(spec, u, say))


def run_grid(spec: BenchSpec, sizes_kb: tuple[int, ...], consumers: tuple[int, ...], url: str | None = None,
             say=lambda line: None) -> dict:
    """``run_bench`` for each message size (KB per encoded scored trajectory; none: ``spec.tokens``) and
    each number of consumers per stage, on one Redis; the JSON shape of ``--json`` with ``--sizes`` or
    several ``--consumers``."""
    def cells(u: str) -> list[dict]:
        out = []
        for kb in sizes_kb or (0,):
            tokens = tokens_for_size(spec, kb * 1000) if kb else spec.tokens
            for n in consumers:
                cell = replace(spec, tokens=tokens, consumers=n)
                say(f"cell: {kb or 'default'} KB ({tokens} tokens), {n} consumer(s) per stage")
                out.append({"size_kb": kb or None, "consumers": n, "tokens": tokens, **_run_all(cell, u, say)})
        return out

    measured = _on_redis(spec, url, cells)
    return {"cells": measured, "spec": asdict(spec), "redis": measured[0]["redis"],
            "load_avg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}


def _on_redis(spec: BenchSpec, url: str | None, fn):
    """``fn(url)`` on ``url`` (else ``$LIBRA_REDIS_URL``, else a private embedded server, configured with
    ``spec.redis_config``)."""
    if spec.stages not in ("processes", "threads"):
        raise ValueError(f"stages = {spec.stages!r}: use processes or threads")
    url = url or os.environ.get(ENV_URL)
    if url:
        if spec.redis_config:
            raise ValueError("--redis-config applies to the embedded server only; configure yours yourself")
        return fn(url)
    with tempfile.TemporaryDirectory(prefix="libra-bench-") as tmp, EmbeddedRedis(Path(tmp)) as server:
        for key, value in spec.redis_config:
            try:
                connect(server.url).config_set(key, value)
            except redis.ResponseError as exc:
                raise RefusedSetting(f"--redis-config {key}={value}: Redis refused it: {exc}") from None
        return fn(server.url)


def _run_all(spec: BenchSpec, url: str, say) -> dict:
    """``rounds`` alternations of raw and libra, so that a colleague's job on a shared machine
    weighs on both alike; each figure is the median of its rounds."""
    job = f"bench-streams-{os.getpid()}-{uuid.uuid4().hex[:8]}"   # pid 1 in every container: not enough
    raws, ours = [], []
    for k in range(spec.rounds):
        raws.append(measure("raw", url, f"{job}-raw-{k}", spec, say))
        ours.append(measure("libra", url, f"{job}-{k}", spec, say))
    raw_rate = statistics.median(m["trajectories_per_s"] for m in raws)
    rate = statistics.median(m["trajectories_per_s"] for m in ours)
    per_traj = scored_bytes_per_trajectory(spec)
    issued = sum(m["issued_groups"] for m in ours)
    entries = sum(m["learner_entries"] for m in ours)
    distinct = sum(m["learner_distinct"] for m in ours)
    return {
        "trajectories_per_s": round(rate, 1),
        "mb_per_s": round(rate * per_traj / 1e6, 1),
        "raw_trajectories_per_s": round(raw_rate, 1),
        "ratio": round(rate / raw_rate, 3) if raw_rate else 0.0,
        "raw_mb_per_s": round(raw_rate * per_traj / 1e6, 1),
        "bytes_per_trajectory": round(per_traj),
        "exactly_once": {"issued_groups": issued, "delivered_entries": entries, "distinct_groups": distinct,
                         "lost_groups": issued - distinct, "duplicate_entries": entries - distinct,
                         "bad": sum(m["learner_bad"] for m in ours), "drained": all(m["drained"] for m in ours)},
        "runs": {"libra": ours, "raw": raws},
        "spec": asdict(spec),
        "redis": _redis_facts(connect(url)),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }


def _redis_facts(r) -> dict:
    facts = {"version": r.info("server").get("redis_version")}
    try:
        for key in ("appendonly", "appendfsync", "auto-aof-rewrite-min-size", "maxmemory-policy"):
            facts[key] = r.config_get(key).get(key)
    except redis.ResponseError:  # a managed Redis may refuse CONFIG
        pass
    return facts


# --- command line ------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    """Register ``streams`` on the ``bench`` subcommand's subparsers (called by pipeline.cli)."""
    d = BenchSpec()
    p = subparsers.add_parser(
        "streams", help="data-plane throughput (rollout -> reward -> learner, no compute) vs a raw Redis loop",
        description="Push synthetic trajectories through the production stream loop and through a minimal "
                    "XADD/XREADGROUP/XACK loop on the same Redis; report both rates and their ratio.")
    p.add_argument("--json", metavar="OUT", help="write {trajectories_per_s, mb_per_s, raw_trajectories_per_s, "
                   "ratio, ...} to OUT")
    p.add_argument("--seconds", type=float, default=d.seconds, help="measured seconds of each run")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="seconds before measuring")
    p.add_argument("--group-size", type=int, default=d.group_size, help="trajectories per group (stream entry)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="token ids (and log-probs) per trajectory")
    p.add_argument("--count", type=int, default=d.count, help="groups per read and per write+ack transaction")
    p.add_argument("--in-flight", type=int, default=d.in_flight_groups, help="groups issued and not yet consumed")
    p.add_argument("--stages", choices=("processes", "threads"), default=d.stages,
                   help="one process per stage (default) or one thread per stage")
    p.add_argument("--sizes", metavar="KB,...", type=_int_list,
                   help="encoded scored trajectory sizes to measure, in KB (tokens set to match), e.g. 4,16,64; "
                        "prints a table of every size x --consumers")
    p.add_argument("--consumers", metavar="N,...", type=_int_list, default=(d.consumers,),
                   help="consumers of the rollout and of the reward stage each (the learner is one), e.g. 1,2,4; "
                        "several: a table")
    p.add_argument("--rounds", type=int, default=d.rounds, help="alternations of the raw and libra runs (median)")
    p.add_argument("--no-dedup", action="store_true", help="switch the exactly-once marks off")
    p.add_argument("--redis-config", action="append", default=[], metavar="KEY=VALUE",
                   help="CONFIG SET on the embedded server (repeatable), e.g. appendonly=no or "
                        "auto-aof-rewrite-min-size=8gb; default: as libra-ctl run starts it")
    p.add_argument("--redis", help=f"Redis URL (default: ${ENV_URL}, else a private embedded server)")
    p.set_defaults(func=cmd_bench_streams)


def _int_list(text: str) -> tuple[int, ...]:
    """``4,16,64`` -> (4, 16, 64): a list of positive integers (argparse type of --sizes, --consumers)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers separated by commas, e.g. 1,2,4") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be > 0")
    return values


def cmd_bench_streams(args) -> int:
    def say(line: str) -> None:
        print(f"bench streams: {line}", file=sys.stderr, flush=True)

    for name in ("seconds", "group_size", "tokens", "count", "in_flight", "rounds"):
        if not getattr(args, name) > 0 or not math.isfinite(getattr(args, name)):
            say(f"--{name.replace('_', '-')} must be a finite number > 0")
            return 2
    if not (args.warmup >= 0 and math.isfinite(args.warmup)):
        say("--warmup must be a finite number >= 0")
        return 2
    spec = BenchSpec(seconds=args.seconds, warmup_s=args.warmup, group_size=args.group_size,
                     tokens=args.tokens, count=args.count, in_flight_groups=args.in_flight,
                     stages=args.stages, dedup=not args.no_dedup, rounds=args.rounds,
                     redis_config=tuple(tuple(kv.split("=", 1)) for kv in args.redis_config))
    if any(len(kv) != 2 for kv in spec.redis_config):
        say("--redis-config takes KEY=VALUE, e.g. appendonly=no")
        return 2
    if spec.redis_config and (args.redis or os.environ.get(ENV_URL)):
        say("--redis-config applies to the embedded server only, not to --redis or $LIBRA_REDIS_URL")
        return 2
    bad_out = argtypes.unwritable("--json", args.json)
    if bad_out:
        say(bad_out)
        return 2
    for kb in args.sizes or (0,):   # a group over the stages' limit would be dead-lettered, not measured
        tokens = tokens_for_size(spec, kb * 1000) if kb else spec.tokens
        group_bytes = scored_bytes_per_trajectory(replace(spec, tokens=tokens)) * spec.group_size
        if group_bytes > spec.max_message_bytes:
            say(f"{'--sizes ' + str(kb) if kb else '--tokens ' + str(spec.tokens)}: a scored group of "
                f"{spec.group_size} would be {group_bytes / 1e6:.1f} MB, over the stages' limit of "
                f"{spec.max_message_bytes / 1e6:.1f} MB; measure smaller messages or groups")
            return 2
    try:
        if args.sizes or len(args.consumers) > 1:
            result = run_grid(spec, args.sizes or (), args.consumers, args.redis, say)
            print(format_grid(result))
            checks = [cell["exactly_once"] for cell in result["cells"]]
        else:
            result = run_bench(replace(spec, consumers=args.consumers[0]), args.redis, say)
            print(format_result(result))
            checks = [result["exactly_once"]]
    except RefusedSetting as exc:
        say(str(exc))
        return 2
    except KeyboardInterrupt:   # the stage processes and the embedded Redis are stopped on the way out
        say("interrupted")
        return 130
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(eo["lost_groups"] == 0 and eo["duplicate_entries"] == 0 for eo in checks) else 1


def format_result(res: dict) -> str:
    eo = res["exactly_once"]
    return "\n".join([
        f"libra  {res['trajectories_per_s']:>10,.0f} trajectories/s  {res['mb_per_s']:>8,.1f} MB/s",
        f"raw    {res['raw_trajectories_per_s']:>10,.0f} trajectories/s  {res['raw_mb_per_s']:>8,.1f} MB/s",
        f"ratio  {res['ratio']:.2f}   ({res['bytes_per_trajectory']:,} bytes per trajectory, "
        f"groups of {res['spec']['group_size']}, {res['spec']['count']} per call, stages as {res['spec']['stages']}"
        f"{', %d consumers per stage' % res['spec']['consumers'] if res['spec'].get('consumers', 1) > 1 else ''})",
        f"redis {res['redis'].get('version')} appendonly={res['redis'].get('appendonly')}, median of "
        f"{res['spec']['rounds']} alternating rounds of {res['spec']['seconds']:g} s, load average "
        f"{res['load_avg'][0]:.2f} on {res['cpus']} CPUs",
        f"exactly once: issued {eo['issued_groups']} groups, learner got {eo['delivered_entries']} "
        f"({eo['distinct_groups']} distinct, lost {eo['lost_groups']})",
    ])


def format_grid(res: dict) -> str:
    """The table of ``run_grid``: one row per message size and number of consumers."""
    spec = res["spec"]
    lines = [f"{'size':>8} {'consumers':>9} {'libra traj/s':>13} {'MB/s':>7} {'raw traj/s':>11} {'MB/s':>7} "
             f"{'ratio':>6}  exactly once"]
    for cell in res["cells"]:
        eo = cell["exactly_once"]
        ok = eo["lost_groups"] == 0 and eo["duplicate_entries"] == 0
        lines.append(
            f"{cell['bytes_per_trajectory'] / 1000:>5.1f} KB {cell['consumers']:>9} "
            f"{cell['trajectories_per_s']:>13,.0f} {cell['mb_per_s']:>7,.1f} {cell['raw_trajectories_per_s']:>11,.0f} "
            f"{cell['raw_mb_per_s']:>7,.1f} {cell['ratio']:>6.2f}  "
            + (f"yes ({eo['issued_groups']} groups)" if ok else
               f"NO: lost {eo['lost_groups']}, duplicated {eo['duplicate_entries']}"))
    lines.append(f"groups of {spec['group_size']}, {spec['count']} per call, stages as {spec['stages']}; redis "
                 f"{res['redis'].get('version')} appendonly={res['redis'].get('appendonly')}; median of "
                 f"{spec['rounds']} alternating rounds of {spec['seconds']:g} s per cell; load average "
                 f"{res['load_avg'][0]:.2f} on {res['cpus']} CPUs")
    return "\n".join(lines)
