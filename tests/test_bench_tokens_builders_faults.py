"""bench rollout's token check and exit codes, the policy builders' side effects and debris, and the warm
start's report of an evaluation that judged nothing.

No vLLM: the bench's
pipeline run uses the fake rollout worker of ``tests/test_bench_rollout_faults.py`` and its direct run a
stand-in for the engine's episode loop; the builders build models of a few thousand parameters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import bench_rollout as br
from tests.test_bench_rollout_faults import CONFIG, SMALL, TOKENS_PER_TRAJ, cli_args, pipeline_run

ROOT = Path(__file__).resolve().parent.parent
TINY = {"hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "num_layers": 1, "intermediate_size": 64}


# --- 1. same_tokens compares counts only ----------------------------------------------------------------


def test_same_tokens_is_false_when_the_two_paths_generate_different_tokens_of_the_same_count(
        redis_url, tmp_path, monkeypatch):
    """``same_tokens`` ("the same tokens generated on both paths") is False when the pipeline and the direct
    loop sampled different tokens: it compares a digest of each group's tokens. Before, it compared each
    run's total token count, so runs that sampled different tokens, as many of them (every turn cut at
    max_tokens_per_turn), reported True. Here the fake worker's trajectories are tokens 0..4 and the direct
    loop's five 7s."""
    import workers.rollout as rollout_mod
    import workers.tiny_policy as tiny_policy
    from workers.episode import Episode

    pipe = pipeline_run(redis_url, tmp_path, SMALL, 6, monkeypatch=monkeypatch)

    def fake_play_groups(engine, tokenizer, env, chat_template, cfg, tasks):
        time.sleep(0.002)   # an engine call takes time (the figures divide by it)
        return [Episode(prompt_id=t.prompt_id, sample_idx=i, prompt_tokens=[1, 2],
                        completion_tokens=[7] * TOKENS_PER_TRAJ, completion_mask=[1] * TOKENS_PER_TRAJ,
                        logprobs=[0.0] * TOKENS_PER_TRAJ, text="", finish="stop", turns=1)
                for t in tasks for i in range(cfg.rollout.group_size)]

    monkeypatch.setattr(rollout_mod, "make_engine", lambda cfg, path: object())
    monkeypatch.setattr(rollout_mod, "play_groups", fake_play_groups)
    monkeypatch.setattr(tiny_policy, "load_tokenizer", lambda path: object())
    spec = br.RolloutBenchSpec(config=CONFIG, overrides=tuple(SMALL), prompts=6)
    cfg = br.bench_config(spec, "review-same-tokens")
    tasks = br.first_tasks(cfg, br.job_problems(cfg), 6)
    mine = tuple(sorted(os.sched_getaffinity(0)))   # _direct pins the calling thread: to what it has already
    direct = br._direct(cfg, str(tmp_path), tasks, mine)

    assert direct["all_tokens"] == pipe["all_tokens"]   # the same number of tokens ...
    res = br.summarise(spec, cfg, mine, [{"direct": direct, "pipeline": pipe}], None)
    assert res["same_tokens"] is False, "different tokens (0..4 vs 7s) reported as the same tokens"


# --- 2. exit codes: bad policy input, dead-lettered groups ----------------------------------------------


def test_a_missing_policy_path_is_a_usage_error_exit_2(tmp_path, monkeypatch, capsys):
    """``--set policy.path=<no such dir>`` is bad input, as a missing prompt file is: exit 2 with the message,
    as ``libra-ctl run`` does. Before, the bench took ``prepare_policy``'s RunFailed for a failed run: exit
    1."""
    def started(*_a, **_k):
        raise AssertionError("the bench started a run with a policy directory that does not exist")

    monkeypatch.setattr(br, "run_direct", started)
    monkeypatch.setattr(br, "run_pipeline", started)
    missing = tmp_path / "no-such-policy"
    code = br.cmd_bench_rollout(cli_args(CONFIG, "--set", f"policy.path={missing}", "--no-switch"))
    err = capsys.readouterr().err
    assert "no such directory" in err
    assert code == 2, f"exit {code} for a policy.path that does not exist (a usage error)"


def test_a_dead_lettered_group_is_reported_not_counted_as_lost():
    """A group the environment's error dead-letters is accounted for (received + dead-lettered = issued), so
    ``exactly_once.ok`` stays True, the group reported under ``dead_lettered``. Before, ``ok`` was ``received
    == issued``: one dead-lettered group of 6 made the bench exit 1, as for a lost group."""
    eo = {"issued_groups": 6, "received_groups": 5, "entries": 5, "distinct_trajectories": 40,
          "duplicate_trajectories": 0, "bad": 0, "dead_lettered": 1}
    res = br._exactly_once([{"exactly_once": eo}])
    assert res["dead_lettered"] == 1
    assert res["ok"], "a dead-lettered (accounted for) group counted as a lost one"


# --- 3. a killed build's temporary directory ------------------------------------------------------------


CHILD = """
import sys, time
from workers import tiny_policy
tiny_policy.warm_start = lambda *a, **k: time.sleep(600)   # killed here, mid-build
tiny_policy.ensure_policy(sys.argv[1], eval(sys.argv[2]))
"""


def test_a_killed_policy_build_leaves_no_temporary_directory_behind_after_the_next_build(tmp_path):
    """ensure_policy builds in ``.policy-<hash>.tmp-<pid>-<uuid>`` and removes it in a ``finally``, which a
    SIGKILL (an OOM kill, a node lost) never runs. The next build clears such debris (its builder is dead;
    here it is also a day old). Before, nothing ever removed a dead builder's: a half-built model stayed in
    the cache for good per killed build."""
    cache = tmp_path / "cache"
    spec = {"warm_steps": 0, **TINY}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(cache), repr(spec)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120   # a hang guard
        while not any(cache.glob(".policy-*.tmp-*/model.safetensors")):
            assert child.poll() is None, "the child build exited before it was killed"
            assert time.monotonic() < deadline, "the child build wrote no weights in time"
            time.sleep(0.1)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    (debris,) = cache.glob(".policy-*.tmp-*")
    day_ago = time.time() - 86400
    for p in [debris, *debris.rglob("*")]:
        os.utime(p, (day_ago, day_ago))

    from workers import tiny_policy

    final = tiny_policy.ensure_policy(cache, spec)
    assert (final / "spec.json").exists()
    left = sorted(p.name for p in cache.iterdir() if p.name.startswith("."))
    assert left == [], f"a killed build's temporary directory is still there after the next build: {left}"


# --- 4. the builders reseed the caller's global RNG -----------------------------------------------------


def test_build_policy_leaves_the_callers_torch_rng_as_it_was(tmp_path):
    """build_policy's weights depend only on its seed, and it draws them without touching the caller's RNG
    (as ``workers.standin._fresh_model`` does). Before, it seeded the global generator: the caller's next
    draws were those of seed 0, whatever the caller had seeded."""
    import torch

    from workers.tiny_policy import build_policy

    torch.manual_seed(1234)
    state = torch.get_rng_state()
    build_policy(tmp_path / "p", seed=0, **TINY)
    untouched = torch.equal(torch.get_rng_state(), state)
    assert untouched, "build_policy reseeded the global torch RNG"


@pytest.fixture(scope="module")
def guess_standin(tmp_path_factory):
    from workers.standin import build_standin

    return build_standin(tmp_path_factory.mktemp("standin") / "llama", arch="llama",
                         corpus=["Guess 1-32\n<g>16</g><f>up 17-32</f>"] * 20, vocab_size=300, hidden_size=32,
                         num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                         max_position_embeddings=128)


def test_the_stand_in_warm_start_leaves_the_callers_torch_rng_as_it_was(guess_standin, tmp_path):
    """``workers.warmstart.warm_start`` (scripts/build_standins.py, in the calling process) leaves the caller's
    torch RNG as it was. Before, it seeded the global generator."""
    import torch

    from workers import warmstart
    from workers.envs import load_env

    env = load_env("guess")
    ws = warmstart.WarmStart(max_steps=1, batch_size=2, eval_every=1, eval_size=1, target=None,
                             max_tokens_per_turn=2, max_turns=1)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    warmstart.warm_start(guess_standin, tmp_path / "out", env, train=env.make_tasks(0, 4, "train"),
                         held_out=env.make_tasks(0, 1, "eval"), ws=ws)
    untouched = torch.equal(torch.get_rng_state(), state)
    assert untouched, "the warm start reseeded the global torch RNG"


# --- 5. a warm start whose evaluation judges nothing ----------------------------------------------------


def _judges_nothing(env):
    class Unjudging(type(env)):
        def reward(self, task, transcript):
            raise RuntimeError("grader down")

    return Unjudging()


@pytest.mark.parametrize("case", ["reward-raises-on-every-episode", "no-held-out-task"])
def test_a_warm_start_whose_evaluation_judges_nothing_does_not_report_a_measured_zero(
        guess_standin, tmp_path, case):
    """``evaluate`` leaves an episode its reward cannot judge out of the rate and returns 0.0 when none is
    judged. The warm start now refuses such an evaluation (ValueError naming the cause), and an empty
    held-out list. Before, it took the 0.0 for a measured success: it never reached its target, trained the
    full ``max_steps`` and returned (and build_standins.py printed) "held-out success 0.00", a figure nothing
    measured."""
    from workers import warmstart
    from workers.envs import load_env

    env = load_env("guess")
    held = env.make_tasks(0, 2, "eval")
    if case == "reward-raises-on-every-episode":
        env = _judges_nothing(env)
    else:
        held = []
    ws = warmstart.WarmStart(max_steps=3, batch_size=2, eval_every=1, eval_size=2, target=0.3,
                             max_tokens_per_turn=2, max_turns=1)
    with pytest.raises(ValueError, match="judged none|held-out tasks"):
        warmstart.warm_start(guess_standin, tmp_path / "out", env, train=env.make_tasks(0, 4, "train"),
                             held_out=held, ws=ws)
    assert not (tmp_path / "out").exists()
