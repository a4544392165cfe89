"""``libra-ctl bench rollout`` under bad input and dead-lettered groups: it refuses what would make the two
paths incomparable or the run impossible before anything starts (exit 2), and a run whose groups are
dead-lettered ends with a message, its counts in groups.

No vLLM here (``tests/test_bench_rollout.py`` runs the real worker and engine, slow): where a pipeline run
is needed, a thread plays the rollout worker's part on the real streams of the suite's Redis (reads prompts
in the rollout group, writes groups or dead-letters them, logs ``rollout`` spans); the feeder, sink, figures
and command line are the bench's own code.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline import bench_rollout as br
from pipeline.dataplane import messages, streams
from pipeline.dataplane.keys import GROUP_ROLLOUT, JobKeys
from pipeline.dataplane.redisconn import connect

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "examples" / "quickstart.toml")
TOKENS_PER_TRAJ = 5


class FakeWorker:
    """A stand-in for ``python -m workers.rollout``: the Popen-like handle ``run_pipeline`` expects."""

    def __init__(self, url: str, run_dir: Path, reject=lambda call, prompt_id: False):
        self.pid = os.getpid()                        # the sink reads this process's CPU seconds
        manifest = json.loads((run_dir / "manifest.json").read_text())
        self.job, self.cfg = manifest["config"]["job"]["name"], manifest["config"]
        self.url, self.run_dir, self.reject = url, run_dir, reject
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def poll(self):
        return None if self._thread.is_alive() else 0

    def terminate(self):
        self._stop.set()

    kill = terminate

    def wait(self, timeout=None):
        self._thread.join(timeout)
        return 0

    def _run(self):
        r, keys = connect(self.url), JobKeys(self.job)
        per_call = self.cfg["rollout"]["groups_per_call"]
        g = self.cfg["rollout"]["group_size"]
        log = self.run_dir / "logs" / f"{br.WORKER_ID}.jsonl"
        time.sleep(0.5)                               # the engine's load: the feeder issues meanwhile
        r.hset(keys.workers, br.WORKER_ID, json.dumps({"state": "running"}))
        call = 0
        while not self._stop.is_set():
            entries = streams.read(r, keys.prompts, GROUP_ROLLOUT, br.WORKER_ID, per_call, block_ms=20)
            if not entries:
                continue
            started, t0 = time.time(), time.perf_counter()
            time.sleep(0.02)                          # the engine call
            pipe = r.pipeline(transaction=True)
            for entry_id, payload in entries:
                p = messages.decode(payload, 1 << 30)
                if self.reject(call, p.prompt_id):   # a tool that failed on every try: dead-lettered
                    streams.dead_letter(pipe, keys, keys.prompts, entry_id, "tool error", payload=payload,
                                        trajectories=g)
                    continue
                trajs = tuple(messages.Trajectory(
                    sample_idx=i, completion=np.arange(TOKENS_PER_TRAJ, dtype=np.int32),
                    mask=np.ones(TOKENS_PER_TRAJ, dtype=np.uint8),
                    logprobs=np.zeros(TOKENS_PER_TRAJ, dtype=np.float32), text="", finish="stop", turns=1,
                    tool_calls=0, tool_latency_s=(), tool_timeouts=0) for i in range(g))
                group = messages.Group(prompt_id=p.prompt_id, prompt=p.prompt, answer=p.answer,
                                       prompt_tokens=np.array([1, 2], dtype=np.int32), version=0,
                                       worker=br.WORKER_ID, generated_at=started, gen_s=0.02, trajectories=trajs)
                pipe.xadd(keys.rollouts, {messages.FIELD: messages.encode(group)})
            pipe.xack(keys.prompts, GROUP_ROLLOUT, *[i for i, _p in entries])
            with open(log, "a") as fh:
                fh.write(json.dumps({"event": "span", "phase": "rollout", "start": started,
                                     "dur_s": time.perf_counter() - t0}) + "\n")
            pipe.execute()
            call += 1


def pipeline_run(redis_url, tmp_path, overrides, prompts, reject=lambda call, pid: False, monkeypatch=None):
    """``run_pipeline`` as ``run_bench`` calls it, on the test's Redis, with the fake worker."""
    monkeypatch.setattr(br, "start_worker",
                        lambda url, run_dir, cpus: (FakeWorker(url, run_dir, reject), run_dir / "w.out"))
    spec = br.RolloutBenchSpec(config=CONFIG, overrides=tuple(overrides), prompts=prompts)
    cfg = br.bench_config(spec, f"review-{os.getpid()}-{time.monotonic_ns()}")
    problems = br.job_problems(cfg)
    tasks = br.first_tasks(cfg, problems, prompts)
    return br.run_pipeline(redis_url, cfg, tmp_path / "run", str(tmp_path), problems, tasks, (0,), 30.0,
                           switch=False, say=lambda _m: None)


SMALL = ["rollout.groups_per_call=2", "learner.batch_size=32"]



@pytest.mark.parametrize("calls", [0, 1], ids=["every-call-dead-lettered", "only-the-warm-up-call"])
def test_a_pipeline_run_with_fewer_than_two_calls_at_the_sink_ends_with_a_message(calls):
    """The first engine call is a warm-up, so figures need two calls at the sink. With fewer (a tool that
    fails dead-letters every group) the run ends with a RuntimeError saying so: exit 1 with a line. Before,
    ``pipeline_figures`` raised IndexError (no call) or ZeroDivisionError (one), and the command printed a
    traceback."""
    out = br.Sink()
    for k in range(calls):
        out.calls[float(k)] = [40, 8, 1.0 + k, 0.5]
    with pytest.raises(RuntimeError, match=f"{calls} engine call\\(s\\) reached the sink \\(3 of 4 groups"):
        br.pipeline_figures(out, {}, 0.0, 1.0, 4, 3, None)


def test_dead_lettered_counts_groups_like_the_other_exactly_once_figures(redis_url, tmp_path, monkeypatch):
    """One group of 6 dead-lettered: the sink receives 5, and ``exactly_once`` says ``dead_lettered: 1``, so
    received + dead-lettered = issued. Before, it read the job's dead_lettered counter, which counts
    trajectories: 8 beside 5 received groups of 6 issued."""
    first = {}

    def reject(call, pid):
        first.setdefault("id", pid)
        return pid == first["id"]

    res = pipeline_run(redis_url, tmp_path, SMALL, 6, reject=reject, monkeypatch=monkeypatch)
    eo = res["exactly_once"]
    assert (eo["issued_groups"], eo["received_groups"], eo["dead_lettered"]) == (6, 5, 1), eo


def cli_args(*argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    br.add_parser(sub)
    return parser.parse_args(["rollout", *argv])


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fails the test if the bench gets as far as building the policy or starting an engine."""
    def started(*_a, **_k):
        raise AssertionError("the bench started before refusing its input")

    monkeypatch.setattr(br, "prepare_policy", started)
    monkeypatch.setattr(br, "run_direct", started)
    monkeypatch.setattr(br, "run_pipeline", started)


def test_an_admission_under_two_engine_calls_is_refused_naming_the_settings(nothing_starts, capsys):
    """With calls of 4 groups of 8 and an admission of 16 trajectories (batch 16, max_staleness 0), the
    worker's calls could hold only 2 groups against the direct run's 4: exit 2 naming the settings. Before,
    the bench ran and compared different batchings as "the same engine settings" (quickstart with
    --set rollout.groups_per_call=128: calls of 64 groups against 128)."""
    args = cli_args(CONFIG, "--set", "rollout.groups_per_call=4", "--set", "learner.batch_size=16",
                    "--set", "learner.max_staleness=0", "--prompts", "12", "--no-switch")
    assert br.cmd_bench_rollout(args) == 2
    err = capsys.readouterr().err
    assert "admits 16 trajectories" in err and "rollout.groups_per_call" in err and "at least 64" in err


def test_a_missing_prompt_file_is_refused_before_anything_starts(tmp_path, nothing_starts, capsys):
    """``--set job.train_prompts=missing.jsonl`` exits 2 naming the file, before the policy is built. Before,
    FileNotFoundError escaped ``cmd_bench_rollout`` as a traceback, after the policy build."""
    missing = tmp_path / "missing.jsonl"
    assert br.cmd_bench_rollout(cli_args(CONFIG, "--set", f"job.train_prompts={missing}", "--no-switch")) == 2
    assert f"prompt file {missing} does not exist" in capsys.readouterr().err


def test_an_unwritable_json_path_is_refused_before_anything_starts(tmp_path, nothing_starts, capsys):
    """``--json no/such/dir/out.json`` exits 2 at once. Before, the path was first used after the whole
    bench (minutes), and the FileNotFoundError escaped as a traceback with the figures lost."""
    args = cli_args(CONFIG, "--json", str(tmp_path / "no" / "such" / "dir" / "out.json"))
    assert br.cmd_bench_rollout(args) == 2
    assert "cannot be written" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["0", "-5", "nan"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(nothing_starts, timeout, capsys):
    """``--timeout 0`` or ``-5`` exit 2 before anything starts. Before, every run failed after loading its
    engine ("took over -5 s", exit 1), and ``nan`` turned the hang guard off (no comparison with nan is
    true)."""
    assert br.cmd_bench_rollout(cli_args(CONFIG, f"--timeout={timeout}", "--no-switch")) == 2
    assert "--timeout" in capsys.readouterr().err


def test_a_password_in_a_set_override_is_not_written_to_the_json(tmp_path):
    """The result's ``spec`` holds the --set overrides; a URL's password in one is masked. Before, it was
    written to the --json file as given."""
    spec = br.RolloutBenchSpec(config=CONFIG, overrides=("redis.url=redis://:hunter2@db:6379/0",))
    cfg = br.bench_config(spec, "redact-test")
    d = {"tokens": 1, "trajectories": 1, "seconds": 1.0, "tokens_per_s": 1.0, "trajectories_per_s": 1.0,
         "cpu_s": 1.0, "tokens_per_cpu_s": 1.0, "all_tokens": 1, "other_s": 0.0}
    res = br.summarise(spec, cfg, (0,), [{"direct": d, "pipeline": {**d, "exactly_once": {
        "issued_groups": 1, "received_groups": 1, "entries": 1, "distinct_trajectories": 1,
        "duplicate_trajectories": 0, "bad": 0, "dead_lettered": 0}}}], None)
    text = json.dumps(res)
    assert "hunter2" not in text and "redis://:***@db:6379/0" in text


def test_bench_rollout_result_keeps_load_avg_and_prints():
    """The result keeps ``load_avg`` and ``cpu_count`` beside the redacted spec, and prints. Before (05ffccc,
    this session), a comment swallowed both keys, and format_result raised KeyError('load_avg') after the
    whole bench: neither the figures nor the JSON came out."""
    import pipeline.bench_rollout as br

    spec = br.RolloutBenchSpec(config="examples/quickstart.toml")
    cfg = br.bench_config(spec, "review-load-avg")
    d = {"tokens": 10, "trajectories": 2, "seconds": 1.0, "tokens_per_s": 10.0, "trajectories_per_s": 2.0,
         "cpu_s": 1.0, "tokens_per_cpu_s": 10.0, "all_tokens": 10, "other_s": 0.1, "engine_s": 0.9}
    res = br.summarise(spec, cfg, (0,), [{"direct": d, "pipeline": {**d, "exactly_once": {
        "issued_groups": 1, "received_groups": 1, "entries": 1, "distinct_trajectories": 2,
        "duplicate_trajectories": 0, "bad": 0, "dead_lettered": 0}}}], None)
    assert "load_avg" in res and "cpu_count" in res, sorted(res)
    assert "load average" in br.format_result(res)
