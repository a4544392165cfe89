"""The tracker (``pipeline.observe.tracking``): metrics.jsonl and the evaluations into TensorBoard and W&B.

No run is started: the tests write ``metrics.jsonl`` lines as the learner and
the sampler do, poll, and read the results back, TensorBoard's with its own
``EventAccumulator`` and W&B's offline run from its transaction log
(``run-<id>.wandb``: LevelDB-style records of ``wandb_internal_pb2.Record``).
The evaluations come from a real Redis (the ``r`` fixture).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.config import load
from pipeline.dataplane.keys import JobKeys
from pipeline.observe import tracking
from pipeline.observe.tracking import (EVAL_AXIS, SAMPLE_AXIS, STEP_AXIS, JsonlTail, Tracker, sample_scalars,
                                       start_tracker, step_scalars, wandb_mode)
from tests.test_sim_workers import wait_for

CREATED_AT = 1_700_000_000.0


def step_line(step: int, **extra) -> dict:
    return {"kind": "learner_step", "step": step, "policy_version": step, "at": CREATED_AT + 10 * step,
            "loss": 0.5 / step, "reward_mean": 0.1 * step, "success_rate": 0.05 * step, "entropy": 0.9,
            "clip_frac": 0.01, "clip_frac_low": 0.002, "grad_norm": 1.5, "lr": 1e-5, "staleness_mean": 0.5,
            "staleness_max": 1, "staleness_hist": {"0": 30, "1": 34}, "dropped_stale": 0, "wait_s": 0.2,
            "train_s": 1.1, "trajectories": 64, "ratio_fresh_tokens": True, "worker": "learner-0", **extra}


SAMPLE = {
    "kind": "sample", "schema": 1, "at": CREATED_AT + 25.4, "job": "t", "node": "host-a", "dt_s": 10.0,
    "phase": "running", "policy_version": 2,
    "allocation": {"rollout": 2, "reward": 1, "learner": 1},
    "workers": {"rollout": {"running": 2}, "learner": {"waiting": 1}},
    "counters": {"generated": 200, "trained": 128},
    "throughput": {"rollout_tokens_per_s": None, "trajectories_per_min": 402.0, "learner_steps": 2},
    "resources": {
        "workers": {"rollout-host-a-0": {"role": "rollout", "pid": 42, "cpu_percent": 180.5, "rss_bytes": 1000}},
        "by_role": {"rollout": {"workers": 1, "cpu_percent": 180.5, "rss_bytes": 1000}},
        "node": {"host": "host-a", "cpu_percent": 75.0, "cpus": 16},
        "gpus": [{"index": 0, "util_percent": 93.0, "memory_used_bytes": 5}]},
    "queues": {"stages": {"reward": {"stream": "libra:{t}:generated", "backlog": 3, "rate_per_s": 6.5}},
               "reward_queue": 3, "learner_queue": None, "learner_wait_ratio": 0.12},
    "quality": {"steps": 2, "loss": 0.01},
}


def append(path: Path, *rows: dict, raw: str = "") -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + raw)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "runs" / "20260101-000000-t"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"created_at": CREATED_AT}))
    return d


def config(*overrides: str):
    return load(None, ["job.name=t", "job.seed=3", *overrides])


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


# --- what is logged ------------------------------------------------------------------------------


def test_a_learner_step_is_every_numeric_scalar_under_its_section():
    got = step_scalars(step_line(2, diversity_distinct_rate=0.9, tool_calls=7, publish_s=0.3))
    assert got["train/loss"] == 0.25 and got["train/reward_mean"] == pytest.approx(0.2)
    assert {"train/success_rate", "train/entropy", "train/clip_frac", "train/clip_frac_low", "train/grad_norm",
            "train/lr", "train/policy_version", "train/trajectories"} <= got.keys()
    assert got["stale/staleness_mean"] == 0.5 and got["stale/dropped_stale"] == 0
    assert got["stale/staleness_hist/1"] == 34
    assert got["time/wait_s"] == 0.2 and got["time/train_s"] == 1.1 and got["time/publish_s"] == 0.3
    assert got["diversity/diversity_distinct_rate"] == 0.9 and got["tools/tool_calls"] == 7
    # the x axis, the time, strings and booleans are not series
    assert not {k for k in got if k.split("/")[1] in ("step", "at", "kind", "worker", "ratio_fresh_tokens")}


def test_a_sample_is_flattened_by_section_role_node_and_gpu():
    got = sample_scalars(SAMPLE)
    assert got["throughput/trajectories_per_min"] == 402.0 and "throughput/rollout_tokens_per_s" not in got
    assert got["queues/stages/reward/backlog"] == 3 and got["queues/learner_wait_ratio"] == 0.12
    assert "queues/learner_queue" not in got and "queues/stages/reward/stream" not in got
    assert got["allocation/rollout"] == 2 and got["workers/learner/waiting"] == 1 and got["counters/trained"] == 128
    assert got["resources/rollout/cpu_percent"] == 180.5 and got["resources/node/cpus"] == 16
    assert got["resources/gpu0/util_percent"] == 93.0 and "resources/gpu0/index" not in got
    # per-worker ids come and go, and quality repeats the learner steps: neither is a series
    assert not [k for k in got if k.startswith(("quality/", "resources/workers", "resources/rollout-host"))]


def test_the_wandb_mode_follows_the_setting_then_the_environment(monkeypatch):
    pytest.importorskip("wandb")
    assert wandb_mode("off", {"WANDB_MODE": "online"}) is None
    assert wandb_mode("auto", {}) == "offline"
    assert wandb_mode("auto", {"WANDB_MODE": "online"}) == "online"
    assert wandb_mode("auto", {"WANDB_MODE": "disabled"}) is None
    assert wandb_mode("offline", {"WANDB_MODE": "online"}) == "offline"
    assert wandb_mode("online", {}) == "online"
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)   # wandb not installed
    assert wandb_mode("auto", {}) is None and wandb_mode("online", {}) is None


def test_the_tail_reads_complete_lines_by_byte_offset(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []   # no file yet
    append(path, {"a": 1}, raw='{"a": ')
    assert tail.read() == [{"a": 1}] and tail.offset == len('{"a": 1}\n')
    append(path, raw='2}\nnot json\n[3]\n')
    assert tail.read() == [{"a": 2}]   # the partial line once complete; bad lines and non-objects skipped
    assert tail.read() == [] and tail.offset == path.stat().st_size
    assert JsonlTail(path, offset=len('{"a": 1}\n')).read() == [{"a": 2}]   # a new reader goes on from an offset
    path.write_text('{"b": 1}\n')   # shorter than the offset: another file; read it from the start
    assert tail.read() == [{"b": 1}]


def test_the_tail_reads_a_backlog_larger_than_one_read(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "READ_MAX", 64)
    path = tmp_path / "metrics.jsonl"
    append(path, *({"i": i, "pad": "x" * 20} for i in range(50)))
    assert [row["i"] for row in JsonlTail(path).read()] == list(range(50))


def test_a_line_longer_than_one_read_is_skipped_once_complete_and_the_tail_goes_on(tmp_path, monkeypatch):
    """A line over READ_MAX (4 MiB) is passed over once its end is written, and the rows after it are read.
    Before, the tail read a full chunk with no newline, kept its offset, and never read another row."""
    monkeypatch.setattr(tracking, "READ_MAX", 64)
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    append(path, {"i": 0}, raw='{"huge": "' + "x" * 300)
    assert tail.read() == [{"i": 0}]     # the long line is still being written: wait for its end
    append(path, raw='"}\n')
    append(path, {"i": 1}, {"i": 2})
    assert tail.read() == [{"i": 1}, {"i": 2}] and tail.offset == path.stat().st_size


# --- TensorBoard ---------------------------------------------------------------------------------


def test_tensorboard_gets_steps_samples_and_a_partial_line_once_complete(run_dir):
    said: list[str] = []
    tracker = Tracker(config("tracking.wandb=off"), run_dir, say=said.append)
    append(run_dir / "metrics.jsonl", step_line(1), step_line(2), SAMPLE, {"kind": "other", "x": 1},
           raw=json.dumps(step_line(3))[:40])
    assert tracker.poll() == 3
    append(run_dir / "metrics.jsonl", raw=json.dumps(step_line(3))[40:] + "\n")
    assert tracker.poll() == 1
    tracker.close()
    assert said == [f"tracking: TensorBoard events in {run_dir / 'tensorboard'} (tensorboard --logdir "
                    f"{run_dir.parent})"]

    got = scalars(run_dir / "tensorboard")
    assert got["train/loss"] == [(1, 0.5), (2, 0.25), (3, pytest.approx(0.5 / 3))]
    assert [s for s, _ in got["train/reward_mean"]] == [1, 2, 3]
    assert got["stale/staleness_hist/0"] == [(1, 30), (2, 30), (3, 30)]
    assert got["time/wait_s"][0] == (1, pytest.approx(0.2))
    # a sample's x is seconds since the manifest was written
    assert got["throughput/trajectories_per_min"] == [(25, 402.0)] and got["resources/gpu0/util_percent"] == [(25, 93)]
    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    assert ea.Scalars("train/loss")[0].wall_time == CREATED_AT + 10   # the step's own time
    assert "run/text_summary" in ea.Tags()["tensors"]                 # the run's name and config


def test_a_resumed_run_appends_to_the_same_event_directory(run_dir):
    first = Tracker(config("tracking.wandb=off"), run_dir)
    append(run_dir / "metrics.jsonl", step_line(1), step_line(2))
    first.poll()
    first.close()
    append(run_dir / "metrics.jsonl", step_line(3))   # written while no tracker ran (the orchestrator was down)
    second = Tracker(config("tracking.wandb=off"), run_dir)
    append(run_dir / "metrics.jsonl", step_line(4))
    second.close()
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert [s for s, _ in scalars(run_dir / "tensorboard")["train/loss"]] == [1, 2, 3, 4]   # each step once


def test_a_sink_turned_on_at_a_resume_is_described_too(run_dir):
    """A run started with no TensorBoard and resumed with it writes the run's name and config to its event
    files. Before, one flag said "described" for every sink: the first start set it, and the TensorBoard
    turned on later never got the run's text."""
    Tracker(config("tracking.wandb=off", "tracking.tensorboard=false"), run_dir).close()
    Tracker(config("tracking.wandb=off"), run_dir).close()
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    ea.Reload()
    assert "run/text_summary" in ea.Tags()["tensors"], ea.Tags()


def test_evaluations_come_from_redis_at_their_policy_version(run_dir, r):
    keys = JobKeys("t")
    for tag, version, rate in (("start", 0, 0.25), ("periodic", 10, 0.4)):
        r.xadd(keys.eval_results, {"tag": tag, "version": version, "success_rate": rate, "n": 48,
                                   "at": CREATED_AT + version, "samples": b"\x90"})
    tracker = Tracker(config("tracking.wandb=off"), run_dir, r)
    assert tracker.poll() == 2
    r.xadd(keys.eval_results, {"tag": "final", "version": 12, "success_rate": 0.5, "n": 48, "samples": b"\x90"})
    assert tracker.poll() == 1 and tracker.poll() == 0
    tracker.close()
    again = Tracker(config("tracking.wandb=off"), run_dir, r)   # resumed: the evaluations already logged stay so
    again.close()
    got = scalars(run_dir / "tensorboard")
    assert got["eval/success_rate"] == [(0, 0.25), (10, pytest.approx(0.4)), (12, 0.5)]
    assert got["eval/prompts"][0] == (0, 48)


def test_nothing_is_started_when_tracking_is_off(run_dir):
    assert start_tracker(config("tracking.tensorboard=false", "tracking.wandb=off"), run_dir) is None


# --- failures ------------------------------------------------------------------------------------


class Boom:
    name = "boom"

    def __init__(self):
        self.calls = 0

    def log(self, *args):
        self.calls += 1
        raise OSError(28, "No space left on device")

    def flush(self):
        pass


def test_a_failing_sink_is_reported_once_and_dropped_while_the_others_go_on(run_dir):
    said: list[str] = []
    tracker = Tracker(config("tracking.wandb=off"), run_dir, say=said.append)
    tracker.open()
    boom = Boom()
    tracker.sinks.insert(0, boom)
    append(run_dir / "metrics.jsonl", step_line(1), step_line(2))
    tracker.poll()
    append(run_dir / "metrics.jsonl", step_line(3))
    tracker.close()
    assert boom.calls == 1
    failed = [line for line in said if "boom failed" in line]
    assert len(failed) == 1 and "No space left on device" in failed[0]
    assert [s for s, _ in scalars(run_dir / "tensorboard")["train/loss"]] == [1, 2, 3]


def test_a_sink_that_cannot_start_leaves_the_others(run_dir, monkeypatch):
    pytest.importorskip("wandb")

    def refuse(*args, **kwargs):
        raise RuntimeError("wandb-core crashed")

    monkeypatch.setattr(tracking, "WandbSink", refuse)
    said: list[str] = []
    tracker = Tracker(config("tracking.wandb=offline"), run_dir, say=said.append)
    append(run_dir / "metrics.jsonl", step_line(1))
    tracker.close()
    assert any("wandb could not start (RuntimeError: wandb-core crashed)" in line for line in said), said
    assert scalars(run_dir / "tensorboard")["train/loss"] == [(1, 0.5)]


def test_the_handle_closes_the_sinks_in_its_own_thread(run_dir):
    append(run_dir / "metrics.jsonl", step_line(1))
    handle = start_tracker(config("tracking.wandb=off"), run_dir, interval_s=0.05)
    append(run_dir / "metrics.jsonl", step_line(2))
    handle.stop({"success_rate_end": 0.5})
    assert not handle.thread.is_alive()
    assert [s for s, _ in scalars(run_dir / "tensorboard")["train/loss"]] == [1, 2]
    assert json.loads((run_dir / "tracking.json").read_text())["offset"] == (run_dir / "metrics.jsonl").stat().st_size


# --- W&B -----------------------------------------------------------------------------------------


def wandb_records(path: Path):
    """The records of a W&B transaction log: a 7-byte header, then 32 KiB blocks of chunked records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:   # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):
            break   # the end, or a chunk still being written
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):   # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def wandb_run(offline_dir: Path) -> tuple[object, list[dict], dict]:
    """(run record, history rows, run summary updates) of one offline run directory.

    ``finish()`` can return before wandb-core, a process of its own, has written its last block:
    the log is read once it holds the run's ``exit`` record.
    """
    path = next(offline_dir.glob("run-*.wandb"))
    wait_for(lambda: any(rec.WhichOneof("record_type") == "exit" for rec in wandb_records(path)), 30,
             f"the exit record in {path}")
    run, rows, summary = None, [], {}
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in rec.summary.update})
    return run, rows, summary


def test_wandb_offline_holds_the_history_and_a_resumed_run_keeps_its_id(run_dir, r, wandb_env):
    cfg = config("tracking.run_name=exp-a", "tracking.group=sweep-1", "redis.url=redis://u:hunter2@h:6379/0")
    r.xadd(JobKeys("t").eval_results, {"tag": "start", "version": 0, "success_rate": 0.25, "n": 48,
                                       "samples": b"\x90"})
    append(run_dir / "metrics.jsonl", step_line(1), SAMPLE, step_line(2))
    first = Tracker(cfg, run_dir, r)
    first.poll()
    first.close({"success_rate_end": 0.5, "job": "t"})
    run_id = json.loads((run_dir / "tracking.json").read_text())["wandb_id"]
    [offline] = list((run_dir / "wandb").glob("offline-run-*"))

    run, rows, summary = wandb_run(offline)
    assert (run.run_id, run.display_name, run.run_group, list(run.tags)) == (run_id, "exp-a", "sweep-1", ["t"])
    assert run.project == "libra"
    config_doc = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config_doc["job"]["name"] == "t" and config_doc["tracking"]["group"] == "sweep-1"
    assert "hunter2" not in json.dumps(config_doc)   # the resolved config, secrets redacted
    steps = [row for row in rows if STEP_AXIS in row]
    assert [(row[STEP_AXIS], row["train/loss"]) for row in steps] == [(1, 0.5), (2, 0.25)]
    assert steps[0]["stale/staleness_mean"] == 0.5 and steps[0]["train/clip_frac"] == 0.01
    [sample] = [row for row in rows if SAMPLE_AXIS in row]
    assert sample[SAMPLE_AXIS] == 25 and sample["throughput/trajectories_per_min"] == 402.0
    [ev] = [row for row in rows if EVAL_AXIS in row]
    assert (ev[EVAL_AXIS], ev["eval/success_rate"]) == (0, 0.25)
    assert summary["run/success_rate_end"] == 0.5 and "run/job" not in summary

    append(run_dir / "metrics.jsonl", step_line(3))
    second = Tracker(cfg, run_dir, r)   # libra-ctl resume: the same W&B run id, only what is new
    second.close()
    # offline-run-<time>-<id>, or offline-run-<time>-<id>-1 when both started within the same second
    [resumed] = [d for d in (run_dir / "wandb").glob(f"offline-run-*-{run_id}*") if d != offline]
    run, rows, _summary = wandb_run(resumed)
    assert run.run_id == run_id
    assert [row[STEP_AXIS] for row in rows if STEP_AXIS in row] == [3]
    assert not [row for row in rows if EVAL_AXIS in row]


@pytest.mark.parametrize("damage", ["state is a directory", "state is a list", "created_at is null"])
def test_a_damaged_tracking_state_or_manifest_never_stops_the_run(run_dir, damage):
    """Tracking never takes the run down: a tracking state file that cannot be read (a directory in its
    place, a JSON list) or a manifest whose ``created_at`` is null starts the tracker from the run's start.
    Before, IsADirectoryError or a TypeError escaped the tracker's start in the run's main thread."""
    from pipeline.observe.tracking import STATE_FILE

    if damage == "state is a directory":
        (run_dir / STATE_FILE).mkdir()
    elif damage == "state is a list":
        (run_dir / STATE_FILE).write_text("[1, 2]")
    else:
        (run_dir / "manifest.json").write_text(json.dumps({"created_at": None}))
    tracker = Tracker(config("tracking.wandb=off"), run_dir)
    append(run_dir / "metrics.jsonl", step_line(1))
    assert tracker.poll() == 1
    tracker.close()
    assert scalars(run_dir / "tensorboard")["train/loss"] == [(1, 0.5)]
