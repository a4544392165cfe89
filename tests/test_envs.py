"""The environment interface: loading by name or module path, the guessing game, rewards from the user.

No Redis and no engine: episodes run on a scripted generator through the real
episode loop (``workers.episode``), and the reward stage's ``score_group`` on
real message types.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pipeline.dataplane import messages
from pipeline.dataplane.streams import Reject
from workers.envs import EnvError, available, load_env
from workers.envs.base import Task, cut_at_stop
from workers.envs.guess import GuessNumber
from workers.episode import TurnOutput, run_episodes
from workers.reward import score_group


class CharTokenizer:
    """One token per character (the tiny policy's property, without building it)."""

    eos_token_id = 0
    eos_token = None
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class Scripted:
    """A generator that plays fixed turns per prompt id, one per call."""

    def __init__(self, turns: dict[str, list[str]]):
        self.turns, self.calls = turns, {}

    def generate(self, requests, *, greedy, seeds, max_tokens, stops):
        outs = []
        for req in requests:
            key = "".join(map(chr, req))
            pid = next(p for p in self.turns if key.startswith(p))
            k = self.calls.get(key, 0)
            text = self.turns[pid][len([1 for c in self.calls if c.startswith(pid)])]
            self.calls[key] = k + 1
            outs.append(TurnOutput([ord(c) for c in text], [-0.5] * len(text), text, "stop"))
        return outs


def play(env, task, turns):
    gen = Scripted({task.prompt: turns})
    [ep] = run_episodes(gen, CharTokenizer(), [(task, 0)], greedy=True, max_turns=8, max_tokens_per_turn=16,
                        tool_timeout_s=2.0, seed=0, env=env)
    return ep


def test_builtin_environments_are_registered_and_load_by_name():
    assert {"calc", "guess"} <= set(available())
    assert isinstance(load_env("guess", {"high": 8}), GuessNumber)
    with pytest.raises(EnvError, match="no environment of that name"):
        load_env("nope")
    with pytest.raises(EnvError, match="cannot import"):
        load_env("no_such_module_xyz:Env")
    with pytest.raises(EnvError, match="env.options"):
        load_env("guess", {"colour": "red"})


def test_the_guessing_game_replies_from_every_earlier_guess():
    env = GuessNumber(high=32, max_guesses=5)
    task = Task("g1", "Guess 1-32\n", {"secret": 10, "high": 32})
    ep = play(env, task, ["<g>16</g>", "<g>8</g>", "<g>20</g>", "<g>10</g>"])
    # the third guess is outside the range left (9-15): it narrows nothing
    assert ep.text == ("<g>16</g><f>down 1-15</f><g>8</g><f>up 9-15</f><g>20</g><f>down 9-15</f>"
                       "<g>10</g>")
    assert ep.finish == "solved" and ep.turns == 4
    assert env.reward(task, ep.text) == 1.0
    # replies are never trained: mask 0 exactly over the feedback spans
    text = "".join(map(chr, ep.completion_tokens))
    trained = "".join(c for c, m in zip(text, ep.completion_mask) if m)
    assert trained == "<g>16</g><g>8</g><g>20</g><g>10</g>"


def test_the_guessing_game_ends_after_its_guesses_and_scores_the_outcome():
    env = GuessNumber(high=32, max_guesses=3)
    task = Task("g2", "Guess 1-32\n", {"secret": 31, "high": 32})
    ep = play(env, task, ["<g>1</g>", "<g>2</g>", "<g>3</g>", "<g>31</g>"])
    assert ep.turns == 3 and ep.finish == "max_turns"
    assert env.reward(task, ep.text) == 0.0
    # a guess after the allowed ones does not count, even if a transcript holds it
    assert env.reward(task, "<g>1</g><g>2</g><g>3</g><g>31</g>") == 0.0


def test_guess_tasks_are_split_and_deterministic_and_the_answer_is_a_map():
    env = GuessNumber()
    train, again, held = env.make_tasks(0, 300, "train"), env.make_tasks(0, 300, "train"), env.make_tasks(0, 300, "eval")
    assert train == again and not {t.prompt_id for t in train} & {t.prompt_id for t in held}
    assert all(isinstance(t.answer, dict) and 1 <= t.answer["secret"] <= 32 for t in train)
    assert env.parse_task({"prompt_id": "x", "prompt": "p", "answer": {"secret": 3}}).answer == {"secret": 3}
    for bad, why in (({"prompt_id": "x", "prompt": "p", "answer": 3}, "map"),
                     ({"prompt_id": "x", "prompt": "p", "answer": {"secret": 99}}, "outside")):
        with pytest.raises(ValueError, match=why):
            env.parse_task(bad)


def test_noisy_demonstrations_win_less_than_clean_ones():
    env, tasks = GuessNumber(), GuessNumber().make_tasks(1, 200, "eval")

    def rate(noise):
        return np.mean([play(env, t, env.demonstration(t, random.Random(k), noise)).finish == "solved"
                        for k, t in enumerate(tasks)])

    assert rate(0.0) >= 0.95 and rate(1.0) <= 0.7


def test_cut_at_stop_keeps_the_first_stop_and_what_the_token_ran_past():
    assert cut_at_stop("<g>5</g>\n", ("</g>",)) == ("<g>5</g>", "</g>")
    assert cut_at_stop("no stop", ("</g>",)) == ("no stop", None)
    assert cut_at_stop("a</b>c</a>", ("</a>", "</b>")) == ("a</b>", "</b>")


def _group(answer, texts=("x", "y")):
    z = np.zeros(1, dtype=np.int32)
    trajs = tuple(messages.Trajectory(sample_idx=i, completion=z + 5, mask=z.astype(np.uint8) + 1,
                                      logprobs=z.astype(np.float32), text=t, finish="stop", turns=1, tool_calls=0,
                                      tool_latency_s=(), tool_timeouts=0) for i, t in enumerate(texts))
    return messages.Group(prompt_id="p@0", prompt="q", answer=answer, prompt_tokens=z, version=0, worker="w",
                          generated_at=0.0, gen_s=0.0, trajectories=trajs)


def test_a_reward_that_raises_is_retried_then_dead_lettered_never_zero():
    calls = []

    def flaky(task, transcript):
        calls.append(transcript)
        if len(calls) < 3:
            raise ConnectionError("judge unreachable")
        return 0.5

    scored = score_group(_group({"k": [1, 2]}, texts=("x",)), retries=2, reward=flaky)
    assert isinstance(scored, messages.Group) and scored.rewards == [0.5] and len(calls) == 3

    def down(task, transcript):
        raise ConnectionError("judge down")

    rejected = score_group(_group(7), retries=1, reward=down)
    assert isinstance(rejected, Reject) and "ConnectionError: judge down" in rejected.reason


@pytest.mark.parametrize("value", [None, float("nan"), "1.0", True])
def test_a_reward_that_is_not_a_finite_number_is_an_error(value):
    rejected = score_group(_group(1), retries=0, reward=lambda task, text: value)
    assert isinstance(rejected, Reject)


def test_answers_travel_as_any_json_value():
    for answer in (3, "paris", [1, "a", None], {"secret": 3, "tags": ["x"]}, 2.5):
        msg = messages.Prompt(prompt_id="p", prompt="q", answer=answer, issued_at=1.0)
        assert messages.decode(messages.encode(msg), 1 << 20).answer == answer
        assert messages.decode(messages.encode(_group(answer)), 1 << 20).answer == answer


def test_an_environment_outside_the_repository_runs_through_env_entry(tmp_path):
    (tmp_path / "echo_env.py").write_text(textwrap.dedent('''
        from workers.envs.base import Environment, Reply, Task

        class Echo(Environment):
            """Says the model's word back; reward 1 when the word is the task's answer."""
            stop_strings = ("!",)

            def __init__(self, shout: bool = False):
                self.shout = shout

            def step(self, state, task, turn, finish):
                if turn.startswith(task.answer):
                    return Reply(done=True, finish="said_it")
                return Reply(text=(turn.upper() if self.shout else turn) + "?")

            def reward(self, task, transcript):
                return 1.0 if transcript.startswith(task.answer) else 0.0
    '''))
    script = textwrap.dedent('''
        import json
        from pipeline import config
        from workers.envs import env_from_config
        from workers.episode import TurnOutput, run_episodes
        from workers.envs.base import Task

        class Tok:
            eos_token_id, eos_token, chat_template = 0, None, None
            def encode(self, text, add_special_tokens=False):
                return [ord(c) for c in text]

        class Gen:
            def generate(self, requests, *, greedy, seeds, max_tokens, stops):
                return [TurnOutput([ord(c) for c in "hi!"], [-1.0] * 3, "hi!", "stop") for _ in requests]

        cfg = config.load(None, ["env.entry=echo_env:Echo", "env.options={shout = true}"])
        env = env_from_config(cfg)
        eps = run_episodes(Gen(), Tok(), [(Task("t", "say:", "bye"), 0), (Task("u", "say:", "hi"), 0)],
                           greedy=True, max_turns=2, max_tokens_per_turn=4, tool_timeout_s=1.0, seed=0, env=env)
        print(json.dumps([[e.text, e.finish, env.reward(Task("t", "say:", a), e.text)]
                          for e, a in zip(eps, ("bye", "hi"))]))
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["hi!HI!?hi!", "max_turns", 0.0], ["hi!", "said_it", 1.0]]


def test_the_documented_example_environment_works_as_written(tmp_path):
    doc = (Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    code = doc.split("## A complete example", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "countdown_env.py").write_text(code)
    script = textwrap.dedent('''
        import json, random
        from workers.envs import load_env
        from workers.episode import TurnOutput, run_episodes

        env = load_env("countdown_env:Countdown", {"start_max": 4})
        tasks = env.make_tasks(0, 20, "train")

        class Tok:
            eos_token_id, eos_token, chat_template = 0, None, None
            def encode(self, text, add_special_tokens=False):
                return [ord(c) for c in text]

        class Demo:
            def __init__(self, noise):
                self.turns = {t.prompt_id: env.demonstration(t, random.Random(1), noise) for t in tasks}
                self.n = {}
            def generate(self, requests, *, greedy, seeds, max_tokens, stops):
                outs = []
                for pid in self.order:
                    k = self.n.get(pid, 0); self.n[pid] = k + 1
                    text = self.turns[pid][k]
                    outs.append(TurnOutput([ord(c) for c in text], [-1.0] * len(text), text, "stop"))
                return outs

        rates = []
        for noise in (0.0, 1.0):
            gen = Demo(noise)
            eps = []
            for t in tasks:
                gen.order = [t.prompt_id]
                eps += run_episodes(gen, Tok(), [(t, 0)], greedy=True, max_turns=8, max_tokens_per_turn=8,
                                    tool_timeout_s=1.0, seed=0, env=env)
            rates.append(sum(env.reward(t, e.text) for t, e in zip(tasks, eps)) / len(tasks))
        print(json.dumps(rates))
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [1.0, 0.0]


def test_a_reward_model_directory_scores_episodes_through_the_reward_stage(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from pipeline import config
    from workers import standin
    from workers.reward import reward_function

    lm = standin.build_standin(tmp_path / "lm", arch="llama", corpus=["<g>16</g><f>up 17-32</f>"] * 50,
                               vocab_size=300, max_position_embeddings=128)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(lm))
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2,
                                                    num_key_value_heads=1, num_labels=1,
                                                    pad_token_id=tok.pad_token_id, max_position_embeddings=128))
    rm.save_pretrained(str(tmp_path / "rm"))
    tok.save_pretrained(str(tmp_path / "rm"))
    score = reward_function(config.load(None, [f"reward.model={tmp_path / 'rm'}"]))
    a, b = score(Task("t", "Guess 1-32\n", None), "<g>16</g>"), score(Task("t", "Guess 1-32\n", None), "<g>3</g>")
    assert isinstance(a, float) and a != b and a == score(Task("t", "Guess 1-32\n", None), "<g>16</g>")
    scored = score_group(_group(None, texts=("<g>16</g>", "<g>3</g>")), retries=0, reward=score)
    assert scored.rewards == [score(Task("p@0", "q", None), t) for t in ("<g>16</g>", "<g>3</g>")]
    with pytest.raises(config.ConfigError, match="not both"):
        config.load(None, [f"reward.model={tmp_path / 'rm'}", "reward.entry=m:f"])


def test_a_turn_text_is_the_decoding_of_its_tokens_even_past_a_stop_string(tmp_path):
    from types import SimpleNamespace

    from workers import standin
    from workers.engine_vllm import _turn_output

    # "</g>\n" is one token of this BPE: the stop string ends inside it
    model = standin.build_standin(tmp_path / "m", arch="llama", corpus=["<g>12</g>\n<f>up 13-32</f>\n"] * 200,
                                  vocab_size=300)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(model))
    ids = tok.encode("<g>12</g>\n", add_special_tokens=False)
    assert not tok.decode(ids[:-1]).endswith("</g>") and tok.decode(ids).endswith("</g>\n")
    steps = [{i: SimpleNamespace(logprob=-0.1)} for i in ids]
    # what vLLM reports: the text cut at the stop string, the ids including the whole last token
    out = _turn_output(SimpleNamespace(token_ids=ids, logprobs=steps, finish_reason="stop", stop_reason="</g>",
                                       text="<g>12</g>"), tok)
    assert out.text == tok.decode(ids) and out.finish_reason == "stop"
    assert cut_at_stop(out.text, ("</g>",)) == ("<g>12</g>", "</g>")
    eos = ids + [tok.eos_token_id]
    out = _turn_output(SimpleNamespace(token_ids=eos, logprobs=steps + [{tok.eos_token_id: SimpleNamespace(logprob=-1.0)}],
                                       finish_reason="stop", stop_reason=tok.eos_token_id, text="x"), tok)
    assert out.finish_reason == "eos" and out.text == tok.decode(ids) and out.token_ids == eos
