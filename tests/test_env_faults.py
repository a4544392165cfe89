"""What an environment, a tool or a reward does wrong ends with its group, never the worker.

A step that returns something other than a Reply, or text that is not a
str UTF-8 can carry, dead-letters its group with that said; a call that ran
late but returned no longer counts as a hung thread; a tool reply with no
room left in the engine's context is not inserted; a RewardError whose
words mention memory is the sample's failure, not the worker's OOM; numpy
numbers are rewards; the rollout worker's evaluation bounds and contains
its reward calls.

Episodes are driven without vLLM: a generator that plays one fixed turn, the
char tokenizer of tests/test_envs.py, and, where the stage matters, the real
``Rollout.generate`` inside ``run_stage`` on the suite's Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import structlog

from pipeline import config as config_mod
from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_ROLLOUT, JobKeys
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.dataplane.streams import ClaimPolicy, Reject, ensure_groups, group_pending, run_stage
from tests.test_envs import CharTokenizer, _group
from workers.envs import base
from workers.envs.base import DeadlinePool, Environment, HungCalls, Reply, RewardError, Task
from workers.episode import TurnOutput, run_episodes
from workers.reward import judge_function, score_group
from workers.rollout import Rollout

ROOT = Path(__file__).resolve().parent.parent

JOB = "revep"


class OneTurn:
    """A generator whose every turn is ``text`` ending at a stop string; ``max_model_len`` like VLLMEngine's."""

    def __init__(self, text: str = "call!", max_model_len: int | None = None):
        self.text, self.max_model_len = text, max_model_len

    def generate(self, requests, *, greedy, seeds, max_tokens, stops):
        return [TurnOutput([ord(c) for c in self.text], [-0.5] * len(self.text), self.text, "stop")
                for _ in requests]


class Replies(Environment):
    """Every step answers ``make()`` (whatever it returns); the reward is 1."""

    stop_strings = ("!",)

    def __init__(self, make):
        self.make = make

    def step(self, state, task, turn, finish):
        return self.make()

    def reward(self, task, transcript):
        return 1.0


class _Meter:
    def got_input(self) -> None:
        pass

    def add(self, **_kw) -> None:
        pass


def _stage(r, env, *sets: str) -> Rollout:
    cfg = config_mod.load(None, [f"job.name={JOB}", "rollout.group_size=2", "rollout.max_turns=2",
                                 "rollout.max_tokens_per_turn=8", "rollout.tool_timeout_s=2", *sets])
    ctx = SimpleNamespace(r=r, keys=JobKeys(JOB), cfg=cfg, log=structlog.get_logger(), policy_version=0,
                          worker_id="rollout-n-0", stopping=lambda: False, count=lambda n: None)
    ctx.set_version = lambda v: setattr(ctx, "policy_version", v)
    s = object.__new__(Rollout)
    s.ctx, s.cfg, s.meter = ctx, cfg.rollout, _Meter()
    s.engine, s.tokenizer, s.env, s.chat_template = OneTurn(), CharTokenizer(), env, None
    s.eval_tasks = [Task("e0", "q:", 1)]
    s.judge = judge_function(cfg, env)
    return s


def _run_rollout_stage(r, s: Rollout) -> list:
    """One prompt through the real rollout stage; the dead letters (reason) it wrote. Fails on a crash."""
    keys = JobKeys(JOB)
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    r.hset(keys.policy, mapping={"version": 0, "path": "/weights/v0"})
    r.xadd(keys.prompts, {m.FIELD: m.encode(m.Prompt("p@0", "q:", 3, 1.0))})
    rounds = []
    try:
        run_stage(r, keys, source=keys.prompts, group=GROUP_ROLLOUT, consumer="rollout-n-0", sink=keys.rollouts,
                  handle=s.generate, count=8, block_ms=50, max_bytes=1 << 20, counter="generated",
                  stop=lambda: rounds.append(1) or len(rounds) > 2,
                  claims=ClaimPolicy(min_idle_ms=60_000, max_deliveries=3))
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"the rollout stage crashed instead of dead-lettering the group: {type(exc).__name__}: {exc}")
    assert group_pending(r, keys.prompts, GROUP_ROLLOUT) == 0
    return [f[b"reason"].decode() for _i, f in r.xrange(keys.dead_letters)]


# --- 1. a step that returns something other than a Reply / a reply whose text is not a str -------------------


@pytest.mark.parametrize("make, what", [
    (lambda: "42", "str"),                      # a string instead of Reply(text=...)
    (lambda: None, "NoneType"),                 # forgot the return
    (lambda: Reply(text=42, tool_call=True), "int"),
    (lambda: Reply(text=b"42", tool_call=True), "bytes"),
], ids=["str", "None", "int-text", "bytes-text"])
def test_a_step_returning_a_non_reply_or_non_str_text_dead_letters_its_group_not_the_worker(r, make, what):
    reasons = _run_rollout_stage(r, _stage(r, Replies(make)))
    assert len(reasons) == 1 and what in reasons[0] and "Replies.step returned" in reasons[0], reasons


# --- 2. a reply text that is a str but not encodable (a lone surrogate, e.g. from json.loads) -------------------


def test_a_reply_with_a_lone_surrogate_dead_letters_its_group_not_the_worker(r):
    reasons = _run_rollout_stage(r, _stage(r, Replies(lambda: Reply(text="x\ud800y", tool_call=True))))
    assert len(reasons) == 1 and "UTF-8 cannot carry" in reasons[0], reasons


# --- 3. a late step that did return is still counted as hung, forever ----------------------------------------


class LateThenReturns(Environment):
    def step(self, state, task, turn, finish):
        time.sleep(0.15)   # late for a 0.02 s deadline, but it returns: its thread is not stuck
        return Reply(text="late", tool_call=True)


def test_steps_that_ran_late_but_returned_do_not_count_as_hung_threads(monkeypatch):
    monkeypatch.setattr(base, "_POOL", DeadlinePool(4, "env-step", max_abandoned=3))
    env, task = LateThenReturns(), Task("t", "p")
    for k in range(6):
        try:
            [reply] = env.respond([(None, task, "x", "stop")], 0.02, on_timeout="reply")
        except HungCalls as exc:
            pytest.fail(f"late call {k + 1}: {exc} although no call is running now (each returned)")
        assert reply.timed_out
        time.sleep(0.4)   # the late call returns and its thread exits


# --- 4. a reply that overflows max_model_len is inserted whole -----------------------------------------------


def test_a_long_tool_reply_never_makes_a_trajectory_longer_than_max_model_len():
    env = Replies(lambda: Reply(text="r" * 500, tool_call=True))
    [ep] = run_episodes(OneTurn(max_model_len=40), CharTokenizer(), [(Task("q", "q:"), 0)], greedy=True,
                        max_turns=3, max_tokens_per_turn=8, tool_timeout_s=2.0, seed=0, env=env)
    assert len(ep.completion_tokens) == len(ep.completion_mask) == len(ep.logprobs)
    assert len(ep.prompt_tokens) + len(ep.completion_tokens) <= 40, \
        f"prompt + completion = {len(ep.prompt_tokens) + len(ep.completion_tokens)} tokens > max_model_len 40"


# --- 5. a RewardError whose message says "out of memory" kills the reward worker --------------------------------


def test_a_reward_error_that_mentions_memory_is_dead_lettered_not_taken_for_the_worker_s_oom():
    def judge(task, transcript):
        raise RewardError("the candidate program ran out of memory")   # the sample's failure, not ours

    try:
        out = score_group(_group(7), retries=1, reward=judge, timeout_s=5.0)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"score_group raised (the reward worker exits as oom): {type(exc).__name__}: {exc}")
    assert isinstance(out, Reject) and "ran out of memory" in out.reason


# --- 6. a numpy number is a finite number -------------------------------------------------------------------


@pytest.mark.parametrize("value", [np.float32(0.5), np.int64(1)], ids=["float32", "int64"])
def test_a_reward_returned_as_a_numpy_scalar_is_scored_not_dead_lettered(value):
    out = score_group(_group(7), retries=0, reward=lambda task, text: value, timeout_s=5.0)
    assert not isinstance(out, Reject), out.reason
    assert out.rewards == [float(value)] * 2


# --- 7. the rollout worker's evaluation calls env.reward unguarded and unbounded -------------------------------


class JudgeFails(Replies):
    def __init__(self, judge):
        super().__init__(lambda: Reply(done=True, finish="answer"))
        self.judge = judge

    def reward(self, task, transcript):
        return self.judge()


def test_an_eval_whose_reward_cannot_judge_does_not_crash_the_rollout_worker(r):
    def cannot():
        raise RewardError("cannot judge this transcript")

    s = _stage(r, JudgeFails(cannot))
    try:
        s.run_eval("periodic", claim="v1")
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"run_eval raised out of the rollout worker's between(): {type(exc).__name__}: {exc}")
    [(_id, rec)] = r.xrange(JobKeys(JOB).eval_results)
    assert rec[b"n"] == b"0" and rec[b"unjudged"] == b"1"   # left out of the rate, not counted as a 0


def test_an_eval_whose_reward_hangs_is_bounded_by_reward_timeout_s(r):
    release = threading.Event()
    s = _stage(r, JudgeFails(lambda: release.wait() and 1.0), "reward.timeout_s=0.5", "reward.verifier_retries=0")
    t = threading.Thread(target=lambda: s.run_eval("periodic", claim="v2"), daemon=True)
    t.start()
    t.join(timeout=5.0)
    hung = t.is_alive()
    release.set()
    t.join(timeout=5.0)
    assert not hung, "run_eval still waiting on a hung env.reward 5 s in (reward.timeout_s = 0.5)"


class NoReward(Replies):
    """An environment that leaves judging to ``[reward] entry``: its own ``reward`` is not implemented."""

    def __init__(self):
        super().__init__(lambda: Reply(done=True, finish="answer"))

    reward = Environment.reward


def judge_three_quarters(task, transcript) -> float:
    """A ``[reward] entry`` of the tests below."""
    return 0.75


def test_an_eval_scores_with_the_reward_entry_the_run_trains_on(r):
    """With ``[reward] entry`` set, the held-out evaluation judges with it too: an environment
    without a reward of its own has every episode judged (n = 1, rate 0.75), not every episode
    left out as unjudged and the rate reported as 0."""
    s = _stage(r, NoReward(), "reward.entry=tests.test_env_faults:judge_three_quarters")
    s.run_eval("periodic", claim="v3")
    [(_id, rec)] = r.xrange(JobKeys(JOB).eval_results)
    assert (rec[b"n"], rec[b"unjudged"], float(rec[b"success_rate"])) == (b"1", b"0", 0.75)


def test_a_held_out_rate_the_reward_judged_nothing_of_reads_none_judged_not_zero():
    """The run's start line and summary give a rate over no judged episode as such, not as 0.0%."""
    from pipeline.observe.measures import success_text

    assert success_text(0.0, 0).startswith("none judged")
    assert success_text(0.0, 200) == "0.0%" and success_text(0.425, None) == "42.5%"


class _FailsOnTurn(Environment):
    """Answers a tool call on every turn before ``turn``; the step of that turn raises (a tool service down)."""

    stop_strings = ("!",)

    def __init__(self, turn: int):
        self.turn = turn

    def start(self, task):
        return {"turns": 0}

    def step(self, state, task, turn, finish):
        state["turns"] += 1
        if state["turns"] >= self.turn:
            raise ConnectionError("tool service down")
        return Reply(text="r", tool_call=True)

    def reward(self, task, transcript):
        return 1.0


def test_a_tool_that_fails_on_the_last_turn_loses_nothing_and_the_group_is_trained(r):
    """On the episode's last turn a tool's reply would never be read (no turn follows): a failure there ends
    the episode as max_turns and its group goes on to be trained. Before, it dead-lettered the whole group,
    group_size trajectories of signal lost to a reply nobody would read. A failure on an earlier turn still
    dead-letters the group (its reply was needed)."""
    keys = JobKeys(JOB)
    assert _run_rollout_stage(r, _stage(r, _FailsOnTurn(2))) == []      # max_turns = 2: the last turn's failure
    [(_id, fields)] = r.xrange(keys.rollouts)
    group = m.decode(fields[m.FIELD], 1 << 30)
    assert [t.finish for t in group.trajectories] == ["max_turns", "max_turns"]
    assert [t.tool_calls for t in group.trajectories] == [1, 1]   # the last turn counts no call, as on success
    r.delete(keys.rollouts, keys.prompts, keys.dead_letters)
    reasons = _run_rollout_stage(r, _stage(r, _FailsOnTurn(1)))           # the first turn's: its reply was needed
    assert len(reasons) == 1 and "tool service down" in reasons[0]


# --- a tool or a start that wraps a command line's main(): SystemExit --------------------------------------------


class ExitingStep(Replies):
    def __init__(self):
        super().__init__(lambda: sys.exit(3))


class ExitingStart(Replies):
    def __init__(self):
        super().__init__(lambda: Reply(text="ok", tool_call=True))

    def start(self, task):
        raise SystemExit("sandbox set-up failed")


@pytest.mark.parametrize("env, said", [(ExitingStep, "env.step raised on 2 tries: SystemExit: 3"),
                                       (ExitingStart, "env.start raised SystemExit: sandbox set-up failed")],
                         ids=["step", "start"])
def test_a_tool_or_start_that_calls_sys_exit_dead_letters_its_group_not_the_worker(r, env, said):
    """docs/environments.md, "Tool errors": a step or a start that raises ends its episodes and dead-letters
    the group. A review's tool wrapping a command line's main() (sys.exit on failure): SystemExit passed the
    `except Exception` of the step and start calls, and the rollout worker exited with code 3; its agent
    restarted it into the same prompt until the run failed on a crash loop, with no word of the tool. The
    reward path already took SystemExit as the sample's failure."""
    reasons = _run_rollout_stage(r, _stage(r, env(), "rollout.tool_retries=1"))
    assert len(reasons) == 1 and said in reasons[0], reasons


BROKEN_TOOL = '''
from workers.envs.calc import Calculator


class BrokenCalculator(Calculator):
    """The calculator whose tool fails on every call (a sandbox that never comes up)."""

    def step(self, state, task, turn, finish):
        raise ConnectionRefusedError("sandbox at 10.0.0.9:8080 refused the connection")
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_tool_fails_on_every_call_fails_naming_the_cause(tmp_path):
    """A review's environment whose every step raised: its groups went to the dead-letter stream (5,800
    trajectories in 171 s) for as long as the run lasted, no step trained, and the error itself was never shown.
    The run now fails once two batches' worth are dead-lettered with none scored, saying the newest reason."""
    (tmp_path / "broken_env.py").write_text(BROKEN_TOOL)
    runs = tmp_path / "runs"
    sets = [f"run.runs_dir={json.dumps(str(runs))}", "env.entry=broken_env:BrokenCalculator", "job.steps=3",
            "job.eval_size=8", "job.eval_every=0", "learner.batch_size=32", "rollout.groups_per_call=4",
            "streams.max_queue_size=96", "rollout.tool_retries=0", "job.name=broken"]
    env = {k: v for k, v in os.environ.items() if k != ENV_URL} | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "examples/quickstart.toml",
                           *sum((["--set", s] for s in sets), [])], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "every group since the run started was dead-lettered" in out, out[-3000:]
    assert "ConnectionRefusedError: sandbox at 10.0.0.9:8080 refused the connection" in out, out[-3000:]
    assert "libra-ctl dlq replay --all --job broken" in out


# A sandbox that refuses the tool for about half the problems (by the problem's text): half the groups are
# dead-lettered, the other half train.
FLAKY_ENV = '''
import zlib
from workers.envs.calc import Calculator


class FlakyCalculator(Calculator):
    def step(self, state, task, turn, finish):
        if zlib.crc32(task.prompt.encode()) % 2 == 0:
            raise ConnectionRefusedError("sandbox for this problem refused the connection")
        return super().step(state, task, turn, finish)
'''

# A verifier that takes a while to come up on its first call (a sandbox starting, a model loading), then answers
# at once: merely slow, never failing.
SLOW_VERIFIER = '''
import time
from workers.envs.calc import verify

_T0 = None


def judge(task, transcript):
    global _T0
    if _T0 is None:
        _T0 = time.time()
    left = _T0 + 25 - time.time()
    if left > 0:
        time.sleep(left)
    return verify(task, transcript)
'''



@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_with_some_good_groups_and_a_slow_verifier_is_not_a_dead_end(tmp_path):
    """A review of the dead-end check above: it failed the run once 2 batches' worth were dead-lettered and
    none scored. With an environment whose tool fails on half the problems and a verifier that takes 25 s to
    answer its first call, the run failed after ~60 s with 48 of 80 generated trajectories dead-lettered: the
    other 32 were good, waiting at the reward stage. Groups not yet judged are no dead end: the run trains."""
    (tmp_path / "flaky_env.py").write_text(FLAKY_ENV)
    (tmp_path / "slow_verifier.py").write_text(SLOW_VERIFIER)
    runs = tmp_path / "runs"
    sets = [f"run.runs_dir={json.dumps(str(runs))}", "env.entry=flaky_env:FlakyCalculator",
            "reward.entry=slow_verifier:judge", "job.steps=2", "job.eval_size=8", "job.eval_every=0",
            "learner.batch_size=16", "rollout.groups_per_call=2", "rollout.tool_retries=0", "job.name=rvw8flaky"]
    env = {k: v for k, v in os.environ.items() if k != ENV_URL} | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "examples/quickstart.toml",
                           *sum((["--set", s] for s in sets), [])], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=380)
    out = proc.stdout + proc.stderr
    assert "every group since the run started was dead-lettered" not in out, out[-2500:]
    assert proc.returncode == 0, out[-2500:]
