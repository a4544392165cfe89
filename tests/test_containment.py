"""Containment: a bad tool, a bad verifier, a bad entry or a bad number stays in its place.

Against real parts: a Redis server (the session's), the stage loop and the
``libra-ctl dlq`` command, real worker processes (a reward worker, a
learner on the tiny policy), real environments and threads. The episode loop
runs on the scripted generator of ``tests.test_envs`` (the engine is not
what is tested here).

- dead letters keep the raw bytes of their entry, and ``dlq replay`` puts
  them back on their stream byte for byte, for each stage's dead letters;
- a tool (environment step) that raises is retried and then reported with
  its error; one that hangs is abandoned without hanging the process or
  shrinking the pool;
- a reward call that hangs times out, is retried, and its group is
  dead-lettered with the timeout, by a real reward worker that still stops
  on SIGTERM; one that raises is retried and then gets its real reward, or
  its group is dead-lettered with the error: never a zero reward;
- a scored entry that makes training raise is dead-lettered with the error
  and the rest of its batch is trained once; a non-finite loss skips the
  step, counts it, and never publishes a NaN;
- an out-of-memory error of a worker is recorded as ``oom``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from pipeline import config as config_mod
from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_REWARD, GROUP_ROLLOUT, JOBS, JobKeys
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.dataplane.streams import ClaimPolicy, Reject, ensure_groups, group_pending, run_stage
from workers.envs.base import Environment, Reply, Task
from workers.episode import run_episodes

ROOT = Path(__file__).resolve().parent.parent


def ctl(redis_url, job, *args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args, "--job", job, "--redis", redis_url],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def with_extra_field(payload: bytes) -> bytes:
    """The same message with a field this build does not know: a re-encoding would drop it."""
    body = msgpack.unpackb(payload, raw=False)
    body["trace"] = "x" * 70_000   # and past the old 64 KiB cut of dead-letter payloads
    return msgpack.packb(body, use_bin_type=True)


def one_round(r, keys, source, group, sink, handle):
    rounds = []
    run_stage(r, keys, source=source, group=group, consumer="c-0", sink=sink, handle=handle, count=10,
              block_ms=20, max_bytes=1 << 20, claims=ClaimPolicy(60_000, 3),
              stop=lambda: rounds.append(1) or len(rounds) > 2)


def last_payload(r, stream) -> bytes:
    return r.xrevrange(stream, count=1)[0][1][m.FIELD]


# --- dead letters --------------------------------------------------------------------------------


def test_rollout_and_reward_dead_letters_replay_onto_their_stream_byte_for_byte(r, redis_url):
    from tests.test_streams import unscored_group

    keys = JobKeys("t")
    ensure_groups(r, keys)
    prompt = with_extra_field(m.encode(m.Prompt("p-1", "what is 2+2?", 4, 0.0)))
    group = with_extra_field(m.encode(unscored_group("g-1")))
    junk = b"\xc1" + os.urandom(70_000)   # not msgpack: dead-lettered by the stage loop itself
    r.xadd(keys.prompts, {m.FIELD: prompt})
    r.xadd(keys.rollouts, {m.FIELD: group})
    r.xadd(keys.rollouts, {m.FIELD: junk})
    one_round(r, keys, keys.prompts, GROUP_ROLLOUT, keys.rollouts, lambda ps: [Reject("tool error") for _ in ps])
    one_round(r, keys, keys.rollouts, GROUP_REWARD, keys.scored, lambda gs: [Reject("reward error") for _ in gs])
    dead = {f[b"stream"]: f for _i, f in r.xrange(keys.dead_letters)}
    assert r.xlen(keys.dead_letters) == 3
    assert dead[keys.prompts.encode()][b"payload"] == prompt

    for entry in json.loads(ctl(redis_url, "t", "dlq", "list", "--json").stdout):
        replayed = ctl(redis_url, "t", "dlq", "replay", entry["id"])
        assert replayed.returncode == 0, replayed.stderr
        stream = entry["stream"]
        original = {keys.prompts: prompt}.get(stream) or (junk if "malformed" in entry["reason"] else group)
        assert last_payload(r, stream) == original, f"{entry['reason']}: replayed bytes differ"
    assert r.xlen(keys.dead_letters) == 0


def test_dlq_replay_refuses_a_stream_outside_the_job(r, redis_url):
    keys = JobKeys("t")
    r.xadd(keys.dead_letters, {"reason": "x", "stream": "libra:{other}:prompts", "id": "1-0", "deliveries": 1,
                               "trajectories": 0, "payload": b"abc", "at": 0})
    out = ctl(redis_url, "t", "dlq", "replay", "--all")
    assert out.returncode != 0 and "not one of job 't'" in out.stderr
    assert not r.exists("libra:{other}:prompts")


# --- tools ---------------------------------------------------------------------------------------


class Flaky(Environment):
    """Raises on the first ``fail`` calls of each turn text, then answers; ``"hang"`` never returns."""

    stop_strings = ("!",)

    def __init__(self, fail: int = 0):
        self.fail, self.calls = fail, []

    def step(self, state, task, turn, finish):
        self.calls.append(turn)
        if len(self.calls) <= self.fail:
            raise ValueError("tool broke")
        return Reply(done=True, finish="answer", tool_call=True)

    def reward(self, task, transcript):
        return 1.0


def play(env, retries, tool_timeout_s=5.0, on_tool_timeout="reply"):
    from tests.test_envs import CharTokenizer, Scripted

    task = Task("q", "q:")
    return run_episodes(Scripted({"q:": ["call!"] * 4}), CharTokenizer(), [(task, 0)], greedy=True, max_turns=2,
                        max_tokens_per_turn=8, tool_timeout_s=tool_timeout_s, seed=0, env=env, tool_retries=retries,
                        on_tool_timeout=on_tool_timeout)[0]


def test_a_tool_that_raises_is_retried_then_the_episode_carries_the_error():
    ok = play(Flaky(fail=1), retries=1)
    assert ok.finish == "answer" and not ok.error
    env = Flaky(fail=100)
    failed = play(env, retries=2)
    assert len(env.calls) == 3   # the first try and two retries, then no more
    assert failed.finish == "error" and "ValueError: tool broke" in failed.error and "3 tries" in failed.error


class Slow(Flaky):
    """Answers after ``delay_s``: past a short deadline, a late tool."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    def step(self, state, task, turn, finish):
        time.sleep(self.delay_s)
        return Reply(text="late", tool_call=True)


def test_a_late_tool_call_dead_letters_its_episode_unless_told_to_reply():
    failed = play(Slow(2.0), retries=2, tool_timeout_s=0.2, on_tool_timeout="dead_letter")
    assert failed.finish == "error" and "tool call timed out after 0.2s (Slow.step)" in failed.error
    assert failed.tool_timeouts == 1 and failed.turns == 1   # not tried again: the late call may still run
    answered = play(Slow(2.0), retries=2, tool_timeout_s=0.2, on_tool_timeout="reply")
    assert not answered.error and answered.finish == "max_turns" and answered.tool_timeouts == 1
    assert "timeout" in answered.text   # timeout_reply, read by the second turn


class BadStart(Flaky):
    def start(self, task):
        raise KeyError("no sandbox left")


def test_an_environment_whose_start_raises_ends_the_episode_with_the_error():
    env = BadStart()
    failed = play(env, retries=2)
    assert failed.finish == "error" and "env.start raised KeyError" in failed.error and failed.turns == 0
    assert env.calls == []   # no turn was generated or stepped for it


HUNG_TOOL = textwrap.dedent('''
    import threading
    from workers.envs.base import STEP_CONCURRENCY, Environment, Reply, Task

    class Hangs(Environment):
        def step(self, state, task, turn, finish):
            if turn == "hang":
                threading.Event().wait()   # a tool that never answers
            return Reply(text="ok", tool_call=True)

    env, task = Hangs(), Task("t", "p")
    hung = env.respond([(None, task, "hang", "stop")] * (STEP_CONCURRENCY + 4), 0.3)
    assert all(r.timed_out for r in hung)
    fine = env.respond([(None, task, "fine", "stop")], 5.0)
    print("after", fine[0].text, fine[0].timed_out, flush=True)
''')


def test_a_hung_tool_neither_hangs_the_process_nor_starves_later_calls():
    """More hung steps than the pool has threads: later steps are still answered, and the process exits."""
    out = subprocess.run([sys.executable, "-c", HUNG_TOOL], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "after ok False" in out.stdout


# --- rewards -------------------------------------------------------------------------------------


def test_a_hung_reward_times_out_and_is_dead_lettered_never_a_zero():
    from tests.test_envs import _group
    from workers.reward import score_group

    calls = []

    def hangs(task, transcript):
        calls.append(1)
        time.sleep(3600)

    rejected = score_group(_group(7), retries=1, reward=hangs, timeout_s=0.2)
    assert isinstance(rejected, Reject) and len(calls) == 2
    assert rejected.reason.startswith("reward timeout after 2 attempts on sample 0: CallTimeout")
    scored = score_group(_group(7), retries=0, reward=lambda task, text: 0.5, timeout_s=5.0)
    assert scored.rewards == [0.5, 0.5]   # the abandoned threads were replaced


def _reward_worker(tmp_path: Path, redis_url: str, judge: str, *sets: str) -> subprocess.Popen:
    """A real reward worker of job ``ct`` whose ``reward.entry`` is ``judge`` (source of a module ``judge``)."""
    (tmp_path / "judge.py").write_text(textwrap.dedent(judge))
    cfg = config_mod.load(None, ["job.name=ct", "reward.entry=judge:judge", "streams.block_ms=50", *sets])
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"config": cfg.to_dict()}))
    env = dict(os.environ, **{ENV_URL: redis_url, "PYTHONPATH": f"{ROOT}:{tmp_path}"})
    return subprocess.Popen([sys.executable, "-m", "workers.reward", "--run-dir", str(run_dir),
                             "--worker-id", "reward-0"], cwd=ROOT, env=env)


def _stop_reward_worker(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_reward_worker_dead_letters_a_hung_verifier_and_still_stops(tmp_path, r, redis_url):
    from tests.test_streams import unscored_group

    keys = JobKeys("ct")
    ensure_groups(r, keys)
    payload = m.encode(unscored_group("slow"))
    r.xadd(keys.rollouts, {m.FIELD: payload})
    proc = _reward_worker(tmp_path, redis_url, "import time\n\ndef judge(task, transcript):\n    time.sleep(3600)\n",
                          "reward.timeout_s=0.3", "reward.verifier_retries=1")
    try:
        deadline = time.monotonic() + 120
        while not r.xlen(keys.dead_letters) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        [(_id, dead)] = r.xrange(keys.dead_letters)
        assert dead[b"reason"].decode().startswith("reward timeout after 2 attempts on sample 0")
        assert dead[b"payload"] == payload and r.xlen(keys.scored) == 0   # no zero reward went on
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0   # the stuck verifier threads do not hold the process
    finally:
        _stop_reward_worker(proc)


FLAKY_JUDGE = """
    calls = {}

    def judge(task, transcript):
        # "flaky": every sample's first two calls raise, its third answers; "broken": every call raises
        n = calls[task.prompt_id] = calls.get(task.prompt_id, 0) + 1
        if task.prompt_id == "broken":
            raise RuntimeError("judge down")
        if n % 3:
            raise ConnectionError(f"judge unreachable (call {n})")
        return 0.75
"""


def test_a_reward_worker_retries_a_verifier_that_raises_and_never_scores_an_error_zero(tmp_path, r, redis_url):
    """reward.verifier_retries=2: a verifier that raises twice per sample gets its real reward on the
    third call; one that always raises has its group dead-lettered with the error, and nothing of it
    reaches the scored stream, as a zero or otherwise."""
    from tests.test_streams import unscored_group

    keys = JobKeys("ct")
    ensure_groups(r, keys)
    broken = m.encode(unscored_group("broken"))
    r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("flaky"))})
    r.xadd(keys.rollouts, {m.FIELD: broken})
    proc = _reward_worker(tmp_path, redis_url, FLAKY_JUDGE, "reward.verifier_retries=2")
    try:
        deadline = time.monotonic() + 120
        while (r.xlen(keys.scored) + r.xlen(keys.dead_letters) < 2 and time.monotonic() < deadline
               and proc.poll() is None):
            time.sleep(0.1)
        scored = [m.decode(f[m.FIELD], 1 << 20) for _id, f in r.xrange(keys.scored)]
        assert [(g.prompt_id, g.rewards) for g in scored] == [("flaky", [0.75, 0.75])]
        [(_id, dead)] = r.xrange(keys.dead_letters)
        assert dead[b"reason"].decode() == "reward error after 3 attempts on sample 0: RuntimeError: judge down"
        assert dead[b"payload"] == broken
        assert int(r.hget(keys.counters, "scored")) == 2   # the flaky group's two samples, nothing of the other
        assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        _stop_reward_worker(proc)


# --- the learner ---------------------------------------------------------------------------------


def poisoned(group: m.Group, token: int) -> m.Group:
    """The group with one completion token out of the policy's vocabulary: the embedding raises."""
    t = group.trajectories[0]
    completion = t.completion.copy()
    completion[0] = token
    return replace(group, prompt_id=group.prompt_id + "-poison", trajectories=(replace(t, completion=completion),
                                                                                *group.trajectories[1:]))


def exploding(group: m.Group) -> m.Group:
    """The group with behaviour log-probs so low that the importance ratio overflows: a non-finite loss."""
    trajs = []
    for t in group.trajectories:
        lp = np.where(t.mask == 1, np.float32(-1e30), np.float32(0)).astype(np.float32)
        trajs.append(replace(t, logprobs=lp))
    rewards = [0.0, 1.0] * (len(trajs) // 2)   # advantages of both signs
    return replace(group, prompt_id=group.prompt_id + "-nan", trajectories=tuple(
        replace(t, reward=rw) for t, rw in zip(trajs, rewards)))


@pytest.mark.slow
def test_a_poison_entry_is_dead_lettered_and_a_nonfinite_step_is_skipped(tmp_path, r, redis_url):
    from tests.test_learner_recovery import G, audit, feed, scored_groups, setup_run, start_learner
    from workers.tiny_policy import ensure_policy
    from pipeline.run import policy_spec

    cfg0 = config_mod.load(None)
    policy_dir = ensure_policy(ROOT / cfg0.policy.cache_dir, policy_spec(cfg0))
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("learner.max_train_attempts=2", "learner.checkpoint_every=1",
                                     # the objective whose ratio against the behaviour policy can overflow
                                     "learner.objective=behaviour"))
    keys = JobKeys("rec")
    groups = scored_groups(policy_dir, 24)   # 6 steps x 4 groups
    poison = poisoned(groups[1], 10 ** 6)
    unscored = replace(groups[2], prompt_id="unscored", trajectories=tuple(
        replace(t, reward=None) for t in groups[2].trajectories))
    nan = exploding(groups[5])
    # The poison rides in the first batch (taken out: that step trains the other three groups), the
    # unscored entry in the second, the nan group in the third, whose step is skipped.
    stream = [groups[0], poison, groups[1], groups[2], unscored, groups[3], nan] + groups[4:]
    raw = {g.prompt_id: m.encode(g) for g in stream}
    feed(r, stream, issued=len(stream))
    # Earlier learners raised twice on group 4 and exited (counted in Redis): this one dead-letters it untried.
    [seeded] = [i for i, f in r.xrange(keys.scored) if f[m.FIELD] == raw[groups[4].prompt_id]]
    r.hset(keys.learner_attempts, seeded, json.dumps({"n": 2, "error": "RuntimeError: an earlier crash"}))
    proc = start_learner(run_dir, redis_url)
    assert proc.wait(timeout=600) == 0, "the learner crashed on a poison entry"

    dead = {f[b"reason"].decode(): f for _i, f in r.xrange(keys.dead_letters)}
    # On the CPU the embedding raises (the general path); a GPU learner refuses the ids before training.
    [reason] = [k for k in dead if "IndexError" in k or "outside the policy's vocabulary" in k]
    assert reason.startswith("learner: token ids outside" if torch.cuda.is_available() else "learner: IndexError")
    assert dead[reason][b"payload"] == raw[poison.prompt_id]
    assert dead["learner expects a scored group"][b"payload"] == raw["unscored"]
    assert dead["learner: training raised 2 times: RuntimeError: an earlier crash"][b"payload"] == raw[
        groups[4].prompt_id]
    assert not r.exists(keys.learner_attempts)   # dead-lettered or acknowledged: nothing left counted
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["dead_lettered"] == 3 * G and a["duplicates_trained"] == 0

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(s["skipped_nonfinite"] for s in steps) == 1
    assert int(r.hget(keys.counters, "steps_skipped_nonfinite")) == 1
    # a skipped step's non-finite loss is written as null (logs.json_line: Infinity is not JSON)
    assert all(s["loss"] is None if s["skipped_nonfinite"] else math.isfinite(s["loss"]) for s in steps)
    from workers.tiny_policy import load_model
    latest = max((run_dir / "policy").glob("v*"), key=lambda p: p.stat().st_mtime)
    assert all(bool(torch.isfinite(p).all()) for p in load_model(latest).parameters())

    for entry in json.loads(ctl(redis_url, "rec", "dlq", "list", "--json").stdout):
        assert ctl(redis_url, "rec", "dlq", "replay", entry["id"]).returncode == 0
        assert last_payload(r, keys.scored) == dead[entry["reason"]][b"payload"]


def test_a_nonfinite_loss_skips_the_optimizer_step(tmp_path):
    from tests.test_learner_recovery import scored_groups
    from pipeline.run import policy_spec
    from workers.tiny_policy import ensure_policy, load_model
    from workers.update import make_optimizer, plan_shares, train_share

    cfg = config_mod.load(None, ["learner.objective=behaviour"])
    policy_dir = ensure_policy(ROOT / cfg.policy.cache_dir, policy_spec(cfg))
    model = load_model(policy_dir)
    opt = make_optimizer(model, cfg.learner)
    before = [p.detach().clone() for p in model.parameters()]
    group = exploding(scored_groups(policy_dir, 1)[0])
    [share] = plan_shares([group], [0], version=0, step=0, world=1)
    sums = train_share(model, opt, share, cfg.learner, temperature=1.0)
    assert sums.skipped_nonfinite == 1 and not math.isfinite(sums.loss * sums.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state   # AdamW's moments never saw the NaN

    # The decoupled objective truncates the same importance weight at is_cap: a finite step.
    cfg = config_mod.load(None, ["learner.objective=decoupled"])
    sums = train_share(model, opt, share, cfg.learner, temperature=1.0)
    assert sums.skipped_nonfinite == 0 and math.isfinite(sums.loss * sums.grad_norm)
    assert sums.counts.truncated == sums.counts.tokens > 0 and sums.optimizer_steps == 1


# --- out of memory -------------------------------------------------------------------------------


def test_an_out_of_memory_error_is_recorded_as_oom(tmp_path, r, redis_url):
    """A reward worker whose verifier runs out of memory records ``oom`` with the detail, then exits non-zero."""
    from tests.test_streams import unscored_group

    (tmp_path / "greedy_judge.py").write_text(
        "def judge(task, transcript):\n    raise MemoryError('cannot allocate 64 GiB')\n")
    cfg = config_mod.load(None, ["job.name=oom", "reward.entry=greedy_judge:judge", "streams.block_ms=50"])
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"config": cfg.to_dict()}))
    keys = JobKeys("oom")
    r.sadd(JOBS, "oom")
    ensure_groups(r, keys)
    r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("big"))})
    env = dict(os.environ, **{ENV_URL: redis_url, "PYTHONPATH": f"{ROOT}:{tmp_path}"})
    proc = subprocess.run([sys.executable, "-m", "workers.reward", "--run-dir", str(run_dir),
                           "--worker-id", "reward-0"], cwd=ROOT, env=env, timeout=120, capture_output=True, text=True)
    assert proc.returncode != 0 and "MemoryError" in proc.stderr
    rec = json.loads(r.hget(keys.workers, "reward-0"))
    assert rec["failure"]["kind"] == "oom" and "cannot allocate 64 GiB" in rec["failure"]["detail"]
    status = json.loads(subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--json", "--redis", redis_url],
                                       cwd=ROOT, capture_output=True, text=True, timeout=120).stdout)
    [job] = [j for j in status["jobs"] if j["name"] == "oom"]
    assert [w["failure"]["kind"] for w in job["workers"]] == ["oom"]
    [event] = [json.loads(f[b"data"]) for _i, f in r.xrange(keys.control_events)]
    assert event["kind"] == "worker_oom" and event["worker"] == "reward-0"
    assert "worker_oom" in (run_dir / "events.jsonl").read_text()
    logged = [json.loads(line) for line in (run_dir / "logs" / "reward-0.jsonl").read_text().splitlines()]
    assert any(rec.get("event") == "oom" for rec in logged)
    assert r.xlen(keys.dead_letters) == 0   # not the group's fault: it stays pending for another worker


# --- names and numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize("override", ["learner.lr=nan", "rollout.tool_timeout_s=inf", "reward.timeout_s=-1",
                                      "job.seed=-1", "streams.block_ms=0", "control.cooldown_s=-inf",
                                      "job.name=a*", "job.name=x/../y", "job.name={other}", 'job.name="a\\u0007"',
                                      f"job.name={'n' * 200}", "env.entry=../x", "control.metrics_port=70000",
                                      f"job.steps={1 << 64}"])
def test_config_refuses_bad_names_and_numbers(override):
    with pytest.raises(config_mod.ConfigError) as exc:
        config_mod.load(None, [override])
    assert override.split("=")[0] in str(exc.value)


def test_job_names_that_would_be_patterns_or_paths_are_refused_everywhere(tmp_path, r, redis_url):
    from pipeline.dataplane.keys import BadName, job_pattern

    for name in ["*", "a?", "[ab]", "x/y", "..", "a\nb", "", "{t}"]:
        with pytest.raises(BadName):
            JobKeys(name)
    assert job_pattern("bench-*") == "libra:{bench-*}:*"   # the one place a glob is meant
    out = ctl(redis_url, "*", "audit")
    assert out.returncode == 2 and "glob character" in out.stderr
    out = subprocess.run([sys.executable, "-m", "workers.reward", "--run-dir", str(tmp_path),
                          "--worker-id", "../evil"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "path separator" in out.stderr


@pytest.mark.parametrize("field,value", [("gen_s", float("nan")), ("generated_at", float("inf")),
                                         ("scored_at", float("-inf"))])
def test_the_decoder_refuses_nonfinite_times(field, value):
    from tests.test_streams import unscored_group

    body = msgpack.unpackb(m.encode(unscored_group("g")), raw=False)
    body[field] = value
    with pytest.raises(m.BadMessage, match=field):
        m.decode(msgpack.packb(body, use_bin_type=True), 1 << 20)
