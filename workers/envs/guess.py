"""A guessing game with feedback: a stateful, multi-turn environment, unlike the calculator.

``[env] entry = "guess"``. The environment holds a secret integer in
``1..high``; each model turn is one guess, and the reply depends on every
guess so far: the direction and the range still possible, narrowed by all
earlier answers (a guess outside the range narrows nothing). The episode ends
when the guess is right (``finish = "solved"``) or after ``max_guesses``.
The reward is the outcome: 1.0 if the secret was guessed, else 0.0. With the
defaults (1..32, five guesses) halving the range wins 31 games in 32, a
random guess within the range about one in two.

Text format (raw; with a chat template each feedback is a user message)::

    prompt      Guess 1-32\n
    completion  <g>16</g><f>down 1-15</f><g>8</g><f>up 9-15</f><g>12</g><f>down 9-11</f><g>10</g>

The answer on the wire is a map, ``{"secret": 10, "high": 32}``: answers are
any JSON value, not only integers.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from workers.envs.base import Environment, Reply, RewardError, Task, cut_at_stop

GUESS_OPEN, GUESS_CLOSE = "<g>", "</g>"
FEEDBACK_OPEN, FEEDBACK_CLOSE = "<f>", "</f>"
EVAL_MODULUS = 5   # one (secret, seed) in five goes to the eval split, by a hash
_GUESS_RE = re.compile(re.escape(GUESS_OPEN) + r"\s*(\d{1,6})\s*" + re.escape(GUESS_CLOSE))


@dataclass
class Game:
    """One episode's state: the range still possible and the guesses made."""

    low: int
    high: int
    guesses: int = 0
    solved: bool = False


def feedback(text: str) -> str:
    return f"{FEEDBACK_OPEN}{text}{FEEDBACK_CLOSE}"


def parse_guess(turn: str) -> int | None:
    """The guess a turn ends with, or None when it holds none."""
    found = _GUESS_RE.findall(turn)
    return int(found[-1]) if found else None


class GuessNumber(Environment):
    """Find the secret in ``1..high`` within ``max_guesses`` guesses."""

    stop_strings = (GUESS_CLOSE,)
    reply_role = "user"

    def __init__(self, high: int = 32, max_guesses: int = 5):
        if high < 2 or max_guesses < 1:
            raise TypeError(f"high = {high} and max_guesses = {max_guesses}: need high >= 2 and max_guesses >= 1")
        self.high, self.max_guesses = int(high), int(max_guesses)
        self.max_turns = self.max_guesses

    # --- tasks -------------------------------------------------------------------------------------

    def parse_task(self, record) -> Task:
        task = super().parse_task(record)
        answer = task.answer
        if not isinstance(answer, dict) or not _is_int(answer.get("secret")):
            raise ValueError("field 'answer' must be a map with an integer 'secret'")
        high = answer.get("high", self.high)
        if not _is_int(high):
            raise ValueError(f"field 'answer': 'high' must be an integer, not {type(high).__name__}")
        if not 1 <= answer["secret"] <= high:
            raise ValueError(f"secret {answer['secret']} is outside 1..{high}")
        return task

    def make_tasks(self, seed: int, n: int, split: str) -> list[Task]:
        """``n`` games of one split; a game is (secret, nonce), split by a hash so splits never share one."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        rng = random.Random(f"guess:{seed}:{split}")
        out: list[Task] = []
        while len(out) < n:
            secret, nonce = rng.randint(1, self.high), rng.getrandbits(32)
            key = f"{self.high}:{secret}:{nonce}"
            digest = hashlib.sha256(key.encode()).digest()
            if (digest[0] % EVAL_MODULUS == 0) != (split == "eval"):
                continue
            out.append(Task(f"guess-{digest[:8].hex()}", f"Guess 1-{self.high}\n",
                            {"secret": secret, "high": self.high}))
        return out

    # --- episodes ----------------------------------------------------------------------------------

    def start(self, task: Task) -> Game:
        return Game(1, int(task.answer.get("high", self.high)))

    def step(self, state: Game, task: Task, turn: str, finish: str) -> Reply:
        head, _stop = cut_at_stop(turn, self.stop_strings)
        guess = parse_guess(head)
        if guess is None:
            return Reply(done=True, finish="no_guess")
        state.guesses += 1
        secret = task.answer["secret"]
        if guess == secret:
            state.solved = True
            return Reply(done=True, finish="solved")
        if guess < secret:
            state.low = max(state.low, guess + 1)
            return Reply(text=feedback(f"up {state.low}-{state.high}"))
        state.high = min(state.high, guess - 1)
        return Reply(text=feedback(f"down {state.low}-{state.high}"))

    # --- reward ------------------------------------------------------------------------------------

    def reward(self, task: Task, transcript: str) -> float:
        """1.0 if one of the first ``max_guesses`` guesses is the secret, else 0.0."""
        if not isinstance(transcript, str):
            raise RewardError(f"transcript is {type(transcript).__name__}, not str")
        if not isinstance(task.answer, dict) or not isinstance(task.answer.get("secret"), int):
            raise RewardError(f"task {task.prompt_id} has no secret")
        guesses = [int(g) for g in _GUESS_RE.findall(transcript)][: self.max_guesses]
        return 1.0 if task.answer["secret"] in guesses else 0.0

    # --- warm start --------------------------------------------------------------------------------

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> list[str]:
        """Halving guesses; each guess, with probability ``noise``, a random one within the range instead."""
        game, secret, turns = self.start(task), task.answer["secret"], []
        while len(turns) < self.max_guesses:
            guess = (game.low + game.high) // 2
            if rng.random() < noise:
                guess = rng.randint(game.low, game.high)
            turns.append(f"{GUESS_OPEN}{guess}{GUESS_CLOSE}")
            if guess == secret:
                break
            game.low, game.high = (max(game.low, guess + 1), game.high) if guess < secret else \
                (game.low, min(game.high, guess - 1))
        return turns


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)   # true/false is not a number
