"""Bringing your own model, environment and reward (README "Your own model and task", docs/environments.md):
what a user met, now fixed. The comment of each test says what happened before the fix."""

from __future__ import annotations

import io
import json
import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from workers.envs import EnvError, load_env  # noqa: E402


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory on sys.path (as PYTHONPATH puts it) for the user's own modules; names unique per test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("rv_own_"):
            del sys.modules[name]


# --- an environment module with a bug of its own: EnvError (exit 2), not a traceback ---------------------


@pytest.mark.parametrize("source", ["def f(:\n", "raise RuntimeError('cannot reach my word list')\n",
                                    "import json\nVALUE = json.loads('{')\n"])
def test_an_env_module_that_fails_to_import_is_an_env_error(user_dir, source):
    # Before: `libra-ctl run` with env.entry naming a module that has a syntax error, or raises at import,
    # printed a bare Python traceback through pipeline/cli.py and exits 1; resolve() catches ImportError only.
    (user_dir / "rv_own_broken.py").write_text(source)
    with pytest.raises(EnvError, match="rv_own_broken"):
        load_env("rv_own_broken:Env")


def test_an_env_whose_constructor_raises_is_an_env_error(user_dir):
    # Before: load_env turned only a TypeError of cls(**options) into EnvError: any other exception from the user's
    # __init__ (a missing data file, a KeyError) escapes check_prompt_files as a traceback, exit 1.
    (user_dir / "rv_own_init.py").write_text(textwrap.dedent("""
        from workers.envs.base import Environment

        class Env(Environment):
            def __init__(self):
                open("/nonexistent/rv_own_words.txt")
    """))
    with pytest.raises(EnvError, match="rv_own_init"):
        load_env("rv_own_init:Env", {})


# --- a reward entry that names nothing loadable: refused before anything starts ----------------------------


class Reached(Exception):
    pass


def _standin(tmp_path: Path) -> Path:
    from build_standins import env_corpus
    from workers import standin

    return standin.build_standin(tmp_path / "llama-guess", arch="llama", corpus=env_corpus(load_env("guess"), 0, 200))


@pytest.mark.parametrize("entry", ["rv_own_no_such_module:score", "rv_own_judges:nope"])
def test_a_reward_entry_that_cannot_be_imported_is_refused_before_the_run_starts(tmp_path, user_dir, monkeypatch,
                                                                                entry):
    # Before: env.entry was checked before anything starts (exit 2), but reward.entry only inside the reward and
    # rollout workers (workers/reward.py judge_function): `libra-ctl run` starts Redis, the controller and
    # the agent, the workers crash-loop on SystemExit with back-off, and only after CRASH_LOOP failures
    # does the run end as "run failed" (exit 1), minutes later.
    from pipeline import config as config_mod
    from pipeline import run as run_mod

    (user_dir / "rv_own_judges.py").write_text("def score(task, transcript):\n    return 1.0\n")
    policy = _standin(tmp_path)
    cfg = config_mod.load(str(ROOT / "examples" / "guess.toml"), [
        f"policy.path={json.dumps(str(policy))}",
        f"job.train_prompts={json.dumps(str(ROOT / 'examples/data/guess_train.jsonl'))}",
        f"job.eval_prompts={json.dumps(str(ROOT / 'examples/data/guess_eval.jsonl'))}",
        f"run.runs_dir={json.dumps(str(tmp_path / 'runs'))}",
        "job.name=rvownreward",
        f"reward.entry={json.dumps(entry)}",
    ])
    monkeypatch.delenv("LIBRA_REDIS_URL", raising=False)

    def reached(*a, **k):
        raise Reached("the run went on to start Redis and its workers")

    monkeypatch.setattr(run_mod, "_choose_redis", reached)
    monkeypatch.setattr(run_mod, "own_runs", lambda: None)
    out = io.StringIO()
    # run_job installs its own SIGTERM/SIGINT handlers: restored after the test
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = run_mod.run_job(cfg, ["libra-ctl", "run"], out=out)
    except Reached as exc:
        pytest.fail(f"reward.entry = {entry!r} was not refused before the run started: {exc}")
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    assert code == 2 and "reward.entry" in out.getvalue(), out.getvalue()


# --- README numbers for the stand-in -------------------------------------------------------------------------


def test_the_readme_states_the_standin_size_the_build_gives(tmp_path):
    # Before: README "Your own model and task" said "the stand-in (427k parameters, 512 BPE tokens)". The guessing
    # game's corpus saturates the BPE well below its 512-token bound: scripts/build_standins.py
    # .cache/standins --env guess --arch llama builds 371,584 parameters and 297 tokens.
    from build_standins import env_corpus
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from workers import standin

    text = (ROOT / "README.md").read_text()
    m = re.search(r"stand-in \((\d+)k parameters, (\d+) BPE tokens\)", text)
    assert m, "README no longer states the stand-in's size"
    claimed_k, claimed_tokens = int(m.group(1)), int(m.group(2))
    # as scripts/build_standins.py builds it (its default corpus size and seed)
    path = standin.build_standin(tmp_path / "llama", arch="llama", corpus=env_corpus(load_env("guess"), 0))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    params = sum(p.numel() for p in model.parameters())
    tokens = len(AutoTokenizer.from_pretrained(str(path)))
    assert (round(params / 1000), tokens) == (claimed_k, claimed_tokens)


# --- a reward that always fails: the console never says so -----------------------------------------------------


def test_the_progress_line_tells_of_dead_lettered_groups():
    # Before: a [reward] entry that raises on every call is retried and its groups dead-lettered (as documented;
    # `libra-ctl dlq list` showed 432 of them after a minute), but `libra-ctl run` goes on printing
    # "step 0/2  reward 0.000  success  0.0%" forever: the line (pipeline/run.py progress_line) shows no
    # dead-letter count and shows a reward of 0 that no episode got. Nothing ends the run either.
    import collections
    import time

    from pipeline import run as run_mod

    orch = object.__new__(run_mod.Orchestrator)
    orch.cfg = type("C", (), {"job": type("J", (), {"steps": 2})()})()
    orch.t0 = time.monotonic()
    orch.rate_samples = collections.deque()
    orch.stats = lambda: {}
    orch.counters = lambda: {"issued": 440, "dead_lettered": 432}
    line = orch.progress_line()
    assert "dead" in line or "dlq" in line.lower(), line


# --- [reward] model = a directory that is not a sequence classifier -----------------------------------------------


def test_a_causal_lm_is_not_taken_for_a_reward_model(tmp_path):
    # Before: RewardModel (workers/reward_model.py) loaded any directory with AutoModelForSequenceClassification and
    # checks only num_labels. A causal LM whose config says one label (id2label with one entry) loads with
    # a freshly initialised, random `score` head (transformers reports score.weight MISSING), and every
    # episode is then scored by noise: 0.113 and 0.138 for two different guesses here. It should refuse a
    # checkpoint whose classification head is not in it (or whose architectures is not *ForSequenceClassification).
    from workers.reward_model import RewardModel

    path = _standin(tmp_path)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="reward.model"):
        RewardModel(path)
