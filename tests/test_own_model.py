"""Your own model and task, end to end: ``libra-ctl run`` on stand-in BPE models and a user environment.

No checkpoint can be downloaded, so the tests build stand-ins (``workers.standin``):
a Qwen2 with a byte-level BPE tokenizer trained on the calculator's text, run
on the calculator, and a Llama trained on the guessing game's text, run on
the guessing game; both through the chat template, real vLLM and the real
learner on the embedded Redis. Each run checks that published weights and
checkpoints load with transformers and carry the original tokenizer byte for
byte, and that the engine's and the learner's log-probs agree at staleness 0.
A third run takes its environment from a module written to a temporary
directory on ``PYTHONPATH``: nothing in the repository names it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from build_standins import env_corpus  # noqa: E402

from workers import standin  # noqa: E402
from workers.envs import load_env  # noqa: E402

# Same bound as the quick-start test (tests/test_e2e.py): float32 on both sides, kernel rounding only.
LOGPROB_TOL_MAX = 0.05
SMALL = ["job.steps=3", "job.eval_size=16", "job.eval_every=0", "learner.batch_size=32", "learner.checkpoint_every=2",
         "rollout.groups_per_call=4", "streams.max_queue_size=96"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build(tmp_path: Path, arch: str, env: str) -> Path:
    return standin.build_standin(tmp_path / f"{arch}-{env}", arch=arch, corpus=env_corpus(load_env(env), 0, 400))


# An untrained stand-in scores 0 on every calculator task: groups without signal are not trained, and
# nothing is compared. This reward of the user's (a module outside the repository) varies within a group.
VARIED_REWARD = '''
import zlib

def score(task, transcript):
    return float(zlib.crc32(transcript.encode()) % 3) / 2
'''


def run(tmp_path: Path, config: str, settings: list[str], extra_env: dict | None = None) -> tuple[Path, str]:
    runs = tmp_path / "runs"
    args = [sys.executable, "-m", "pipeline.cli", "run", config, "--set", f"run.runs_dir={json.dumps(str(runs))}",
            *sum((["--set", s] for s in SMALL + settings), [])]
    env = {k: v for k, v in os.environ.items() if k != "LIBRA_REDIS_URL"} | (extra_env or {})
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return next(runs.iterdir()), proc.stdout + proc.stderr


def check_files_and_logprobs(run_dir: Path, source: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    published = sorted((run_dir / "policy").glob("v*"))
    checkpoints = sorted(p / "model" for p in (run_dir / "checkpoints").iterdir() if (p / "model").is_dir())
    assert published and checkpoints
    for d in (published[-1], checkpoints[-1]):
        for name in TOKENIZER_FILES:
            assert (d / name).read_bytes() == (source / name).read_bytes(), f"{d / name} differs from the source"
        AutoModelForCausalLM.from_pretrained(str(d))
        tok = AutoTokenizer.from_pretrained(str(d))
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fresh = [s for s in steps if s.get("kind") == "learner_step" and s["ratio_fresh_tokens"]]
    assert fresh, "no staleness-0 trajectory reached the learner"
    assert max(s["ratio_fresh_max_abs_log"] for s in fresh) < LOGPROB_TOL_MAX
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["policy_version"] >= 3 and summary["trajectories_trained"] == 3 * 32


@pytest.mark.slow
def test_a_qwen2_standin_trains_on_the_calculator(tmp_path):
    model = build(tmp_path, "qwen2", "calc")
    (tmp_path / "varied_reward.py").write_text(VARIED_REWARD)
    run_dir, out = run(tmp_path, "examples/quickstart.toml",
                       [f"policy.path={json.dumps(str(model))}", "reward.entry=varied_reward:score"],
                       extra_env={"PYTHONPATH": str(tmp_path)})
    check_files_and_logprobs(run_dir, model)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["config"]["policy"]["path"] == str(model)


@pytest.mark.slow
def test_a_llama_standin_trains_on_the_guessing_game(tmp_path):
    from workers.warmstart import WarmStart, warm_start

    env = load_env("guess")
    base = build(tmp_path, "llama", "guess")
    model = tmp_path / "llama-guess-warm"   # a warm start, so that the game's own reward has signal
    result = warm_start(base, model, env, train=env.make_tasks(0, 2000, "train"),
                        held_out=env.make_tasks(0, 50, "eval"), ws=WarmStart(eval_size=50, eval_every=25))
    assert result["success"] >= 0.3
    run_dir, out = run(tmp_path, "examples/guess.toml", [f"policy.path={json.dumps(str(model))}"])
    check_files_and_logprobs(run_dir, model)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(s.get("kind") == "learner_step" and s["tool_calls"] == 0 for s in steps)  # replies are not tool calls


USER_ENV = '''
"""A user's environment, outside the repository: repeat the word of the prompt, then stop."""
import re
from workers.envs.base import Environment, Reply, RewardError, Task, cut_at_stop

WORD = re.compile(r"<w>(\\w+)</w>")


class Parrot(Environment):
    stop_strings = ("</w>",)
    reply_role = "user"

    def __init__(self, tries: int = 2):
        self.max_turns = tries

    def parse_task(self, record):
        task = super().parse_task(record)
        if not isinstance(task.answer, dict) or "word" not in task.answer:
            raise ValueError("answer must be {\\"word\\": ...}")
        return task

    def step(self, state, task, turn, finish):
        head, _ = cut_at_stop(turn, self.stop_strings)
        m = WORD.search(head)
        if m and m.group(1) == task.answer["word"]:
            return Reply(done=True, finish="said")
        return Reply(text="<again/>")

    def reward(self, task, transcript):
        """1 for the word said; else the share of its letters the text holds (partial credit)."""
        if not isinstance(task.answer, dict):
            raise RewardError("no word")
        word = task.answer["word"]
        if f"<w>{word}</w>" in transcript:
            return 1.0
        return len(set(word) & set(transcript)) / len(set(word)) / 2
'''


@pytest.mark.slow
def test_an_environment_outside_the_repository_runs_through_env_entry(tmp_path):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "parrot_env.py").write_text(textwrap.dedent(USER_ENV))
    words = ["apple", "river", "stone", "cloud"]
    prompts = tmp_path / "parrot.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_id": f"p{i}", "prompt": f"Say {w}\n", "answer": {"word": w}}) + "\n"
                               for i, w in enumerate(words * 10)))
    corpus = [f"Say {w}\n<w>{w}</w><again/>" for w in words] * 50
    model = standin.build_standin(tmp_path / "llama", arch="llama", corpus=corpus)
    run_dir, out = run(tmp_path, "examples/quickstart.toml",
                       [f"policy.path={json.dumps(str(model))}", "env.entry=parrot_env:Parrot",
                        "env.options={tries = 2}", f"job.train_prompts={json.dumps(str(prompts))}",
                        f"job.eval_prompts={json.dumps(str(prompts))}", "rollout.max_tokens_per_turn=8"],
                       extra_env={"PYTHONPATH": str(pkg)})
    check_files_and_logprobs(run_dir, model)
    assert "held-out greedy success at start" in out
