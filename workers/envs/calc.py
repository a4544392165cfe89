"""The calculator task: an agentic, multi-turn, sparse-reward arithmetic problem.

``Calculator`` is the environment (``workers.envs.base.Environment``) that
``[env] entry = "calc"`` names, the default: every stage reaches this module
through it (``workers.envs.load_env``), never by importing it.

Text format (one character is one token of ``workers.tiny_policy``)::

    prompt      Q:(17*23)+45\\n
    completion  <calc>17*23</calc><result>391</result><calc>391+45</calc><result>436</result><answer>436</answer>

A problem applies two binary integer operations (``+ - *``) to three operands,
evaluated as parenthesised: ``(a op b) op c`` or ``a op (b op c)``. The
calculator evaluates ONE binary operation per call, so the policy must call it
on the inner pair, carry the result into a second call, then answer. A turn of
the policy ends at a stop string (``TOOL_STOPS``): after ``</calc>`` the
environment appends ``<result>N</result>`` (or ``<result>error</result>``)
and the policy continues; ``</answer>`` ends the episode. The reward is 1.0 if
the last ``<answer>`` holds the right integer, else 0.0.

With a chat template (a BPE stand-in or a real model), the calls stay in
this format and each ``<result>`` arrives as a tool message.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from workers.envs.base import BadLine, Environment, Reply, RewardError, Task, cut_at_stop

OPS = ("+", "-", "*")
MAX_OPERAND = 99
# Operands the tool accepts: 12 digits bounds a product at 10^24, so no call
# can take long or allocate much, whatever the policy writes.
MAX_TOOL_DIGITS = 12
# One prompt in EVAL_MODULUS goes to the eval split, chosen by a hash of its
# text, so the splits are disjoint whatever the seeds and sizes asked for.
EVAL_MODULUS = 8

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TOOL_STOPS: tuple[str, ...] = (CALL_CLOSE, ANSWER_CLOSE)
ERROR_TEXT = "error"

_INT = rf"-?\d{{1,{MAX_TOOL_DIGITS}}}"
_BINARY_RE = re.compile(rf"({_INT})([+*-])({_INT})")
_ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)
_INT_RE = re.compile(_INT)
_RESULT_SPAN_RE = re.compile(re.escape(RESULT_OPEN) + r".*?" + re.escape(RESULT_CLOSE), re.DOTALL)


Problem = Task   # a calculator task: its answer is the integer value of the expression


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the environment appends, e.g. "<result>391</result>"
    latency_s: float
    timed_out: bool


# --- problems -------------------------------------------------------------


def apply_op(x: int, op: str, y: int) -> int:
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    if op == "*":
        return x * y
    raise ValueError(f"unknown operator {op!r}")


def _problem_text(a: int, op1: str, b: int, op2: str, c: int, inner_left: bool) -> str:
    return f"({a}{op1}{b}){op2}{c}" if inner_left else f"{a}{op1}({b}{op2}{c})"


def _answer(a: int, op1: str, b: int, op2: str, c: int, inner_left: bool) -> int:
    if inner_left:
        return apply_op(apply_op(a, op1, b), op2, c)
    return apply_op(a, op1, apply_op(b, op2, c))


def split_of(expression: str) -> str:
    digest = hashlib.sha256(expression.encode()).digest()
    return "eval" if digest[0] % EVAL_MODULUS == 0 else "train"


def prompt_id_of(expression: str) -> str:
    # The id is a function of the text alone: the same problem always has the
    # same id, whatever seed or list produced it.
    return "calc-" + hashlib.sha256(expression.encode()).hexdigest()[:16]


def make_problems(seed: int, n: int, split: str) -> list[Problem]:
    """``n`` distinct problems of one split ("train" or "eval"), deterministic in ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    rng = random.Random(f"calc:{seed}:{split}")
    seen: set[str] = set()
    problems: list[Problem] = []
    while len(problems) < n:
        a, b, c = (rng.randint(1, MAX_OPERAND) for _ in range(3))
        op1, op2 = rng.choice(OPS), rng.choice(OPS)
        inner_left = rng.random() < 0.5
        expr = _problem_text(a, op1, b, op2, c, inner_left)
        if expr in seen or split_of(expr) != split:
            continue
        seen.add(expr)
        answer = _answer(a, op1, b, op2, c, inner_left)
        problems.append(Problem(prompt_id_of(expr), f"Q:{expr}\n", answer))
    return problems


# --- prompt files ---------------------------------------------------------


def read_prompt_file(path: str | Path) -> Iterator[Problem | BadLine]:
    """Each line's problem, or a ``BadLine`` saying why not; blank lines are skipped."""
    return Calculator().read_prompts(path)


# --- the tool -------------------------------------------------------------


def parse_tool_call(turn_text: str) -> str | None:
    """The expression of the call a turn ends with, or None if it ends with none."""
    if not turn_text.endswith(CALL_CLOSE):
        return None
    body = turn_text[: -len(CALL_CLOSE)]
    start = body.rfind(CALL_OPEN)
    if start < 0:
        return None
    return body[start + len(CALL_OPEN) :]


def evaluate_binary(expr: str) -> int | None:
    """The value of one binary integer operation, or None if ``expr`` is not one."""
    m = _BINARY_RE.fullmatch(expr)
    if m is None:
        return None
    return apply_op(int(m.group(1)), m.group(2), int(m.group(3)))


def result_text(value: int | None) -> str:
    return f"{RESULT_OPEN}{ERROR_TEXT if value is None else value}{RESULT_CLOSE}"


def run_tools(exprs: list[str | None], timeout_s: float, *, delay_s: float = 0.0) -> list[ToolResult]:
    """Run several calls concurrently, each bounded by ``timeout_s`` (the environment's ``respond``).

    ``None`` (a turn that closed a call it never opened) gets an error result.
    ``delay_s`` simulates a slow tool service (benchmarks, timeout tests). A
    timed-out call is answered with an error; its thread finishes in the
    background (it cannot be killed, but it is bounded by ``delay_s``).
    """
    env = Calculator(tool_delay_s=delay_s)
    turns = [CALL_CLOSE if e is None else f"{CALL_OPEN}{e}{CALL_CLOSE}" for e in exprs]
    replies = env.respond([(None, None, t, "stop") for t in turns], timeout_s)
    return [ToolResult(r.text, r.latency_s, r.timed_out) for r in replies]


def run_tool(expr: str, timeout_s: float, *, delay_s: float = 0.0) -> ToolResult:
    """One calculator call: ``"17*23"`` -> ``ToolResult("<result>391</result>", ...)``."""
    return run_tools([expr], timeout_s, delay_s=delay_s)[0]


# --- reward and demonstrations ---------------------------------------------


def verify(problem: Problem, completion_text: str) -> float:
    """1.0 if the completion's last answer is the problem's answer, else 0.0.

    Raises ``RewardError`` when it cannot judge (bad inputs), never returns 0
    for its own failure: a wrong zero would train the policy on a false signal.
    """
    if not isinstance(completion_text, str):
        raise RewardError(f"completion is {type(completion_text).__name__}, not str")
    if not isinstance(problem.answer, int) or isinstance(problem.answer, bool):
        raise RewardError(f"problem {problem.prompt_id} has no integer answer")
    answers = _ANSWER_RE.findall(completion_text)
    if not answers or _INT_RE.fullmatch(answers[-1]) is None:
        return 0.0
    return 1.0 if int(answers[-1]) == problem.answer else 0.0


def tool_span_mask(completion_text: str) -> list[int]:
    """Per character: 0 inside a ``<result>...</result>`` span (the tool wrote it), else 1."""
    mask = [1] * len(completion_text)
    for m in _RESULT_SPAN_RE.finditer(completion_text):
        mask[m.start() : m.end()] = [0] * (m.end() - m.start())
    return mask


_EXPR_RE = re.compile(r"Q:(?:\((-?\d+)([+*-])(-?\d+)\)([+*-])(-?\d+)|(-?\d+)([+*-])\((-?\d+)([+*-])(-?\d+)\))\n")


def _steps(problem: Problem) -> tuple[tuple[int, str, int], str, int, bool]:
    """(inner operation, outer operator, outer operand, inner_left) of a prompt."""
    m = _EXPR_RE.fullmatch(problem.prompt)
    if m is None:
        raise ValueError(f"not a calc prompt: {problem.prompt!r}")
    if m.group(1) is not None:
        return (int(m.group(1)), m.group(2), int(m.group(3))), m.group(4), int(m.group(5)), True
    return (int(m.group(8)), m.group(9), int(m.group(10))), m.group(7), int(m.group(6)), False


def _typo(n: int, rng: random.Random) -> int:
    """``n`` with one digit changed: the slip of copying a number."""
    s = str(abs(n))
    i = rng.randrange(len(s))
    digits = [d for d in "0123456789" if d != s[i] and not (i == 0 and d == "0" and len(s) > 1)]
    s = s[:i] + rng.choice(digits) + s[i + 1 :]
    return -int(s) if n < 0 else int(s)


def _call_text(x: int, op: str, y: int) -> tuple[str, int | None]:
    expr = f"{x}{op}{y}"
    value = evaluate_binary(expr)
    return f"{CALL_OPEN}{expr}{CALL_CLOSE}{result_text(value)}", value


def _outer(carried: int, op: str, operand: int, inner_left: bool) -> tuple[int, str, int]:
    return (carried, op, operand) if inner_left else (operand, op, carried)


def demonstration(problem: Problem, rng: random.Random, noise: float) -> str:
    """The gold completion, or with probability ``noise`` a plausibly wrong one.

    The wrong ones are slips a weak policy makes: a digit typo in a copied
    operand or carried result, a skipped second call with a guessed answer, a
    typo in the final answer. Tool results in them are what the tool returns.
    """
    (x, op1, y), op2, z, inner_left = _steps(problem)
    kind = rng.choice(("operand", "carry", "skip", "answer")) if rng.random() < noise else "gold"
    if kind == "operand":
        if rng.random() < 0.5:
            x = _typo(x, rng)
        else:
            y = _typo(y, rng)
    first, inner = _call_text(x, op1, y)
    assert inner is not None  # operands are small integers
    if kind == "skip":
        guess = _typo(apply_op(*_outer(inner, op2, z, inner_left)), rng)
        return f"{first}{ANSWER_OPEN}{guess}{ANSWER_CLOSE}"
    carried = _typo(inner, rng) if kind == "carry" else inner
    second, final = _call_text(*_outer(carried, op2, z, inner_left))
    assert final is not None
    if kind == "answer":
        final = _typo(final, rng)
    return f"{first}{second}{ANSWER_OPEN}{final}{ANSWER_CLOSE}"


_TURN_RE = re.compile(".*?(?:" + re.escape(CALL_CLOSE) + "|" + re.escape(ANSWER_CLOSE) + ")", re.DOTALL)


def demonstration_turns(completion: str) -> list[str]:
    """A demonstration's model turns: each ends at a stop string; the tool's results are left out."""
    return _TURN_RE.findall(_RESULT_SPAN_RE.sub("", completion))


# --- the environment ---------------------------------------------------------------


class Calculator(Environment):
    """The calculator task as an environment; ``tool_delay_s`` simulates a slow tool service."""

    stop_strings = TOOL_STOPS
    reply_role = "tool"

    def __init__(self, tool_delay_s: float = 0.0):
        self.tool_delay_s = float(tool_delay_s)

    def parse_task(self, record) -> Task:
        task = super().parse_task(record)
        if "answer" not in record:
            raise ValueError("missing field 'answer'")
        # bool is an int subclass; true/false is not an answer.
        if not isinstance(task.answer, int) or isinstance(task.answer, bool):
            raise ValueError("field 'answer' must be int")
        return task

    def make_tasks(self, seed: int, n: int, split: str) -> list[Task]:
        return make_problems(seed, n, split)

    def step(self, state, task: Task, turn: str, finish: str) -> Reply:
        if finish == "eos":
            return Reply(done=True, finish="eos")
        head, stop = cut_at_stop(turn, TOOL_STOPS)
        if stop == ANSWER_CLOSE:
            return Reply(done=True, finish="answer")
        if stop is None:
            return Reply(done=True, finish="no_call")
        expr = parse_tool_call(head)
        if expr is not None and self.tool_delay_s > 0:
            time.sleep(self.tool_delay_s)
        return Reply(text=result_text(None if expr is None else evaluate_binary(expr)), tool_call=True)

    def timeout_reply(self, state, task: Task) -> Reply:
        return Reply(text=result_text(None), tool_call=True, timed_out=True)

    def reward(self, task: Task, transcript: str) -> float:
        return verify(task, transcript)

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> list[str]:
        return demonstration_turns(demonstration(task, rng, noise))
