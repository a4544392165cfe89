"""A stage round of any size is written and acknowledged together; a claim keeper never takes back an entry
another consumer reclaimed; ``libra-ctl bench streams`` refuses
flags it cannot honour, leaves no keys behind when a run fails, and never shares a job with another bench.

Against a real Redis server (the session's); the bench's measuring is replaced
by a recorder where only its flag checks are tested.
"""

from __future__ import annotations

import pytest

from pipeline.cli import build_parser
from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_REWARD, JobKeys, job_pattern
from pipeline.dataplane.streams import (Dedup, decode_entries, ensure_groups, group_pending, job_group_size, read,
                                        write_and_ack)
from pipeline.sim import bench_streams
from tests.test_streams import unscored_group


# --- streams.write_and_ack: the scripted write of a large round ----------------------------------------


def test_a_round_of_8000_inputs_is_written_and_acknowledged_atomically(r):
    """A round's outputs and the acks of its inputs go together whatever ``count`` the stage reads with
    (``rollout.groups_per_call`` and ``bench streams --count`` have no upper bound): 8,000 inputs are
    written, acknowledged and counted. Before, the script's single XACK unpacked 8,000 ids, past Lua's
    limit (~8,000 values): the stage died after writing every output, with no input acknowledged."""
    keys = JobKeys("review-big-round")
    ensure_groups(r, keys)
    n = 8000
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(f"p{i}"))})
    pipe.execute()
    good, bad = decode_entries(read(r, keys.rollouts, GROUP_REWARD, "reward-0", n, None), 1 << 20)
    assert len(good) == n and not bad
    outputs = [g.with_rewards([1.0, 0.0], 0.0) for _i, g in good]
    error = None
    try:
        write_and_ack(r, keys, keys.rollouts, GROUP_REWARD, keys.scored, good, outputs, bad, "scored", None,
                      lambda: False, Dedup("reward", 60))
    except Exception as exc:  # noqa: BLE001 - reported below with the state it left
        error = exc
    state = (r.xlen(keys.scored), group_pending(r, keys.rollouts, GROUP_REWARD),
             int(r.hget(keys.counters, "scored") or 0))
    assert error is None and state == (n, 0, 2 * n), f"{error!r}; (written, still pending, counted) = {state}"


# --- bench streams: flags it cannot honour are refused ------------------------------------------------


def _bench_rc(monkeypatch, argv: list[str]) -> tuple[int, list]:
    """``cmd_bench_streams`` on ``argv`` with the measuring replaced by a recorder: (exit code, calls)."""
    calls = []

    cell = {"exactly_once": {"lost_groups": 0, "duplicate_entries": 0}}

    def fake_bench(spec, *args, **kwargs):
        calls.append(spec)
        return cell

    def fake_grid(spec, *args, **kwargs):
        calls.append(spec)
        return {"cells": [cell]}

    monkeypatch.setattr(bench_streams, "run_bench", fake_bench)
    monkeypatch.setattr(bench_streams, "run_grid", fake_grid)
    monkeypatch.setattr(bench_streams, "format_result", lambda res: "")
    monkeypatch.setattr(bench_streams, "format_grid", lambda res: "")
    args = build_parser().parse_args(["bench", "streams", *argv])
    return args.func(args), calls


@pytest.mark.parametrize("argv", [["--seconds", "nan"], ["--seconds", "inf"], ["--warmup", "inf"]])
def test_bench_streams_refuses_non_finite_durations(monkeypatch, argv):
    """``--seconds`` and ``--warmup`` must be finite (exit 2). Before, nan measured over no time and reported
    0 trajectories/s with exit 0, inf measured for ever, and ``--warmup inf`` died in time.sleep after the
    stages started."""
    rc, calls = _bench_rc(monkeypatch, argv)
    assert rc == 2 and not calls, f"rc {rc}; the bench ran with {calls}"


def test_bench_streams_refuses_messages_larger_than_the_stages_accept(monkeypatch):
    """A scored group larger than the stages' ``max_message_bytes`` (8 MiB) cannot cross the pipeline: such a
    ``--tokens`` or ``--sizes`` is refused (exit 2). Before, ``--tokens 150000`` ran for 84 s, dead-lettered
    every group whole until the embedded Redis was out of memory, and reported ratio 0.00, "lost 128"."""
    rc, calls = _bench_rc(monkeypatch, ["--tokens", "150000"])
    assert rc == 2 and not calls, f"rc {rc}; the bench ran with tokens={[c.tokens for c in calls]}"
    rc, calls = _bench_rc(monkeypatch, ["--sizes", "1200"])   # 1.2 MB a trajectory x 8 > 8 MiB
    assert rc == 2 and not calls, f"rc {rc}; the bench ran a grid of {calls}"


# --- bench streams: its keys go, whatever happens ------------------------------------------------------


def test_bench_streams_leaves_no_keys_when_a_run_fails(monkeypatch, redis_url):
    """``measure`` deletes its job's keys also when the run fails (the feeder's XADD refused, a stage that
    died, Ctrl-C): the bench may run on a shared ``--redis``. Before, only a run that succeeded did."""
    class Boom(RuntimeError):
        pass

    def failing_feed(self):
        pipe = self.r.pipeline(transaction=False)
        for k in range(4):
            pipe.xadd(self.keys.prompts, {m.FIELD: m.encode(m.Prompt(f"p-{k}", "q", 0, 0.0))})
        pipe.execute()
        self.issued = 4
        raise Boom("XADD refused")

    monkeypatch.setattr(bench_streams.Feeder, "_feed", failing_feed)
    spec = bench_streams.BenchSpec(seconds=0.3, warmup_s=0.0, group_size=2, tokens=16, stages="threads",
                                   block_ms=20, rounds=1)
    with pytest.raises(Boom):
        bench_streams.measure("libra", redis_url, "bench-streams-review-0", spec)
    left = sorted(k.decode() for k in bench_streams.connect(redis_url).keys(job_pattern("bench-streams-*")))
    assert not left, left


def test_two_bench_runs_on_one_redis_never_share_a_job(monkeypatch, redis_url):
    """Two ``bench streams`` on one Redis from two containers (every process pid 1) run jobs of their own:
    each ``measure`` starts by clearing its job's keys. Before, the job was named by the pid alone, and the
    second run deleted the first's streams mid-run. (Here the two runs share one process, so one pid.)"""
    jobs: list[list[str]] = []

    def fake_measure(kind, url, job, spec, say=lambda line: None):
        jobs[-1].append(job)
        return {"trajectories_per_s": 1.0, "issued_groups": 0, "learner_entries": 0, "learner_distinct": 0,
                "learner_bad": 0, "drained": True}

    monkeypatch.setattr(bench_streams, "measure", fake_measure)
    spec = bench_streams.BenchSpec(rounds=1)
    for _container in range(2):
        jobs.append([])
        bench_streams._run_all(spec, redis_url, lambda line: None)
    shared = set(jobs[0]) & set(jobs[1])
    assert not shared, f"both runs used the jobs {sorted(shared)}"


def test_a_claim_keeper_does_not_take_back_an_entry_another_consumer_reclaimed(r):
    """A stage whose handler stalled past ``min_idle`` (a long GC pause, a stopped process) lost its entry to
    another consumer's reclaim; its claim keeper's next refresh leaves the entry with that consumer. Before,
    the refresh (XCLAIM with min-idle 0) took it back, and both consumers handled it."""
    from pipeline.dataplane.streams import ClaimKeeper

    keys = JobKeys("review-keeper")
    ensure_groups(r, keys)
    mine = r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("a"))})
    read(r, keys.rollouts, GROUP_REWARD, "reward-0", 1, None)
    keeper = ClaimKeeper(r, keys.rollouts, GROUP_REWARD, "reward-0", 60_000)([mine])
    keeper.refresh()   # ours: refreshed
    owner = lambda: r.xpending_range(keys.rollouts, GROUP_REWARD, "-", "+", 10)[0]["consumer"]
    assert owner() == b"reward-0"
    theirs = r.xclaim(keys.rollouts, GROUP_REWARD, "reward-1", 0, [mine], justid=True)   # the reclaim
    assert theirs == [mine] and owner() == b"reward-1"
    keeper.refresh()
    assert owner() == b"reward-1"


def test_bench_streams_records_the_group_size_a_dead_letter_counts_in(monkeypatch, redis_url):
    """The stages' dead letters give back ``group_size`` trajectories each, read from the feeder's record;
    the bench's feeder now records it as the job's feeder does. Before, it did not, and a dead letter in a
    bench run counted 0 trajectories."""
    seen = {}

    def feed_then_look(self):
        seen["group_size"] = job_group_size(self.r, self.keys)
        raise RuntimeError("enough")

    monkeypatch.setattr(bench_streams.Feeder, "_feed", feed_then_look)
    spec = bench_streams.BenchSpec(seconds=0.3, warmup_s=0.0, group_size=3, tokens=16, stages="threads",
                                   block_ms=20, rounds=1)
    with pytest.raises(RuntimeError, match="enough"):
        bench_streams.measure("libra", redis_url, "bench-streams-review-1", spec)
    assert seen == {"group_size": 3}
