"""The environment interface: what a task is, how an episode runs, and how it is scored.

An environment is a class, named in config by ``[env] entry =
"package.module:ClassName"`` (or by the name of an entry point of the group
``libra.envs``, e.g. ``"calc"``) and built with the ``[env] options`` table
as keyword arguments. Every stage process builds its own (``load_env``):

- the feeder reads prompt records through ``parse_task``;
- the rollout worker plays episodes (``workers.episode``): ``start`` a state
  per episode, then after every model turn ``step`` parses the turn and
  answers (a tool result, or the reply of a stateful environment), which the
  episode loop inserts as a span the learner never trains on, through the
  model's chat template when it has one;
- the reward worker scores each finished episode with ``reward`` (or a
  ``[reward] entry`` function), on the episode's transcript;
- the built-in warm start plays ``demonstration`` turns through ``step``.

``docs/environments.md`` is the guide, with a complete example to copy.
"""

from __future__ import annotations

import json
import math
import numbers
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Environment steps run on worker threads so that a slow one can be abandoned at its deadline.
# The pool is the environment service's concurrency: steps beyond it queue, and the queueing
# counts in their latency and against their timeout, as it would against a real service.
STEP_CONCURRENCY = 16
MAX_PROMPT_ID = 256   # characters of a prompt id (it names Redis keys and trajectory ids)
# Calls a process may abandon (threads stuck in a hung tool or verifier) before it gives up: past this
# it raises HungCalls and exits non-zero, and its agent starts a fresh process (the stuck threads die with it).
MAX_ABANDONED = 64


class HungCalls(RuntimeError):
    """Too many calls of a DeadlinePool never returned; the process should exit and be restarted."""


class DeadlinePool:
    """Daemon threads that run calls each bounded by a deadline; a call past it is abandoned.

    Not a ThreadPoolExecutor: its threads are joined when the interpreter
    exits, so one call that never returns (a tool that hangs) would hang the
    worker's exit, and each one would shrink the pool for good. Here a call
    past its deadline (``abandon``) leaves its thread behind, stuck in user
    code that cannot be interrupted: the thread is a daemon, so it never
    holds the process up; it exits by itself if the call ever returns; and a
    fresh thread takes its place, so the pool keeps ``size`` live threads.
    Once more than ``max_abandoned`` such calls are still running (one that
    returns late no longer counts), ``abandon`` raises HungCalls.
    """

    def __init__(self, size: int, name: str, max_abandoned: int = MAX_ABANDONED):
        self.size, self.name, self.max_abandoned = size, name, max_abandoned
        self.abandoned = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0
        self._lost: set[int] = set()   # id() of futures whose thread was abandoned

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        with self._lock:
            while self._live < self.size:
                self._live += 1
                threading.Thread(target=self._work, daemon=True, name=f"{self.name}-{self._live}").start()
        return fut

    def call(self, fn: Callable, *args, timeout_s: float):
        """``fn(*args)`` on a pool thread; CallTimeout once ``timeout_s`` has passed (the call is abandoned)."""
        fut = self.submit(fn, *args)
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            self.abandon(fut)
            raise late(fn, timeout_s) from None

    def abandon(self, fut: Future) -> None:
        """Give up on ``fut``: cancelled if it has not started, else its thread is left behind and replaced."""
        if fut.cancel():
            return
        with self._lock:
            # done() under the lock: a call that finished just now keeps its thread (see _work)
            if fut.done():
                return
            self._lost.add(id(fut))
            self._live -= 1
            self.abandoned += 1
            over = self.abandoned > self.max_abandoned
        if over:
            raise HungCalls(f"{self.abandoned} calls of the {self.name} pool never returned (over "
                            f"{self.max_abandoned}); exiting so that a fresh process takes over")

    def _work(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who decides
                fut.set_exception(exc)
            with self._lock:   # abandon() marks a call lost only while it is not done, under this lock
                if id(fut) in self._lost:   # abandoned while it ran: a replacement serves the queue now
                    self._lost.discard(id(fut))
                    self.abandoned -= 1   # it returned after all: not a stuck thread
                    return


class CallTimeout(TimeoutError):
    """A call of a DeadlinePool ran past its deadline and was abandoned."""


def late(fn: Callable, timeout_s: float) -> CallTimeout:
    return CallTimeout(f"{getattr(fn, '__qualname__', fn)!s} did not return within {timeout_s:g}s")


_POOL = DeadlinePool(STEP_CONCURRENCY, "env-step")


def env_call(fn: Callable, *args, timeout_s: float):
    """One call into the environment other than ``step`` (``start``), on the step pool, bounded by ``timeout_s``."""
    return _POOL.call(fn, *args, timeout_s=timeout_s)


def env_calls(fn: Callable, args: Sequence[tuple], timeout_s: float) -> list:
    """``fn(*a)`` for each ``a`` of ``args`` at once on the step pool, each bounded by ``timeout_s`` from now:
    per call its result, or the exception it raised (CallTimeout past the deadline; HungCalls is raised)."""
    start = time.monotonic()
    futures = [_POOL.submit(fn, *a) for a in args]
    out: list = []
    for fut in futures:
        try:
            out.append(fut.result(timeout=max(0.0, start + timeout_s - time.monotonic())))
        except FutureTimeout:
            _POOL.abandon(fut)
            out.append(late(fn, timeout_s))
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code (a wrapped main() too): the caller reports it
            out.append(exc)
    return out


@dataclass(frozen=True)
class Task:
    """One prompt record: the text the model is shown and the ground truth it is judged on.

    ``answer`` is any JSON value (a number, a string, a list, a map of whatever
    the environment needs); the model never sees it.
    """

    prompt_id: str
    prompt: str
    answer: Any = None


@dataclass(frozen=True)
class BadLine:
    """A prompt-file line that could not be read; the feeder reports and skips it."""

    lineno: int
    reason: str


@dataclass(frozen=True)
class Reply:
    """The environment's answer to one model turn.

    ``text`` is inserted after the turn as a span the learner never trains on
    (None: nothing); ``done`` ends the episode, with ``finish`` as its reason
    (and no text is inserted after the last turn).
    ``tool_call`` counts the step as a tool call in the metrics.
    ``error`` (set by ``respond``, not by ``step``): the step raised on every
    try; the episode ends and its group goes to the dead-letter stream.
    """

    text: str | None = None
    done: bool = False
    finish: str = ""
    tool_call: bool = False
    latency_s: float = 0.0
    timed_out: bool = False
    error: str = ""  # set by ``respond`` when ``step`` raised on every try: the episode's group is dead-lettered


class RewardError(RuntimeError):
    """The reward could not be judged (bad input, a verifier down): retried, then dead-lettered, never a 0."""


class Environment:
    """Subclass this; every method has a working default except ``step`` and ``reward``.

    Class attributes:
      ``stop_strings``: a model turn ends at the first token that completes one
        of these (decided on tokens: the turn's text always ends at a token
        boundary, so it may run a few characters past the stop string);
      ``reply_role``: the chat role the environment's replies take
        (``"tool"`` or ``"user"``) when the model has a chat template;
      ``max_turns``: model turns per episode; None takes ``rollout.max_turns``;
      ``step_timeout_s``: the longest one ``step`` may take; None takes
        ``rollout.tool_timeout_s``. A step past it is answered ``timeout_reply``.
    """

    stop_strings: tuple[str, ...] = ()
    reply_role: str = "tool"
    max_turns: int | None = None
    step_timeout_s: float | None = None

    def __init__(self, **options):
        if options:
            raise TypeError(f"{type(self).__name__} takes no options; got {', '.join(sorted(options))}")

    # --- tasks -------------------------------------------------------------------------------------

    def parse_task(self, record: Any) -> Task:
        """A prompt record (one decoded JSONL line) as a Task; ValueError names what is wrong.

        The default schema: ``{"prompt_id": str, "prompt": str, "answer": JSON}``.
        """
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        for key in ("prompt_id", "prompt"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"missing field {key!r}" if key not in record else f"field {key!r} must be str")
        prompt_id = record["prompt_id"]
        if not prompt_id:
            raise ValueError("empty prompt_id")
        # The id names the group's Redis marks (JobKeys.seen) and every trajectory id: no control
        # characters, and a bound on its length.
        if len(prompt_id) > MAX_PROMPT_ID or any(ord(c) < 32 or ord(c) == 127 for c in prompt_id):
            raise ValueError(f"prompt_id must be at most {MAX_PROMPT_ID} characters, none a control character")
        return Task(prompt_id, record["prompt"], record.get("answer"))

    def read_prompts(self, path: str | Path) -> Iterator[Task | BadLine]:
        """Each line's task, or a ``BadLine`` saying why not; blank lines are skipped.

        A prompt id already used by an earlier line is a bad line: the feeder
        issues ``<id>@<epoch>``, unique per issue only while the file's ids are.
        """
        first_line: dict[str, int] = {}
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    task = self.parse_task(json.loads(line))
                    if task.prompt_id in first_line:
                        yield BadLine(lineno, f"prompt_id {task.prompt_id!r} is already the id of line "
                                              f"{first_line[task.prompt_id]} (ids must be unique)")
                        continue
                    first_line[task.prompt_id] = lineno
                    yield task
                except json.JSONDecodeError as exc:
                    yield BadLine(lineno, f"bad JSON: {exc.msg}")
                except ValueError as exc:
                    yield BadLine(lineno, str(exc))
                except RecursionError:   # json recurses once per nesting level
                    yield BadLine(lineno, "bad JSON: nested too deeply")

    def make_tasks(self, seed: int, n: int, split: str) -> list[Task]:
        """``n`` tasks of ``split`` ("train" | "eval"), for environments that generate their own."""
        raise NotImplementedError(f"{type(self).__name__} does not generate tasks; give it a prompt file")

    # --- episodes ----------------------------------------------------------------------------------

    def start(self, task: Task) -> Any:
        """The state of a new episode (any object; ``step`` receives it back). Default: None."""
        return None

    def step(self, state: Any, task: Task, turn: str, finish: str) -> Reply:
        """Parse the model's turn and answer it, or end the episode.

        ``turn`` is the turn's text; ``finish`` is why the model stopped:
        ``"stop"`` (a stop string), ``"eos"`` (its end-of-turn token).
        """
        raise NotImplementedError

    def timeout_reply(self, state: Any, task: Task) -> Reply:
        """What a step that ran past its deadline answers."""
        return Reply(text="timeout", tool_call=True, timed_out=True)

    def respond(self, calls: Sequence[tuple[Any, Task, str, str]], timeout_s: float,
                retries: int = 0, on_timeout: str = "reply") -> list[Reply]:
        """``step`` for several episodes at once, concurrently, each bounded by ``timeout_s``.

        A step that raises is tried again, up to ``retries`` more times within
        the same deadline; one that raised on every try is answered with a
        Reply whose ``error`` names the exception. A step still running at
        the deadline has its thread abandoned (``DeadlinePool``) and is
        answered ``timeout_reply`` (``on_timeout="reply"``) or with a Reply
        whose ``error`` says so (``"dead_letter"``). A late step is not tried
        again: its abandoned thread may still be changing the episode's state.
        """
        start = time.monotonic()
        pending: list[tuple[Future[Reply], list[float]]] = []
        for call in calls:
            done_at: list[float] = []
            pending.append((_POOL.submit(_timed_step, self, call, done_at, retries), done_at))
        out = []
        for (fut, done_at), (state, task, _turn, _finish) in zip(pending, calls):
            remaining = max(0.0, start + timeout_s - time.monotonic())
            try:
                reply = fut.result(timeout=remaining)
            except FutureTimeout:
                _POOL.abandon(fut)
                timed = (_checked_timeout_reply(self, state, task) if on_timeout == "reply" else
                         Reply(done=True, finish="error", tool_call=True, timed_out=True,
                               error=f"tool call timed out after {timeout_s:g}s ({type(self).__name__}.step)"))
                out.append(_with_latency(timed, time.monotonic() - start))
                continue
            out.append(_with_latency(reply, done_at[0] - start))
        return out

    # --- reward ------------------------------------------------------------------------------------

    def reward(self, task: Task, transcript: str) -> float:
        """The episode's reward from its transcript (the model's turns and the replies, as text).

        Raise ``RewardError`` when it cannot judge; never return 0 for a failure of its own.
        """
        raise NotImplementedError

    # --- warm start (optional) ---------------------------------------------------------------------

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> list[str]:
        """The model turns of a good episode (or, with probability ``noise``, a plausibly bad one)."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations: warm-start your own model")


def write_prompt_file(path: str | Path, tasks: Iterable[Task]) -> None:
    """Tasks as JSONL prompt records (the default schema ``parse_task`` reads)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt_id": t.prompt_id, "prompt": t.prompt, "answer": t.answer}) + "\n"
                     for t in tasks)


def _timed_step(env: Environment, call: tuple[Any, Task, str, str], done_at: list[float], retries: int) -> Reply:
    for attempt in range(retries + 1):
        try:
            reply = check_reply(env.step(*call), f"{type(env).__name__}.step")
            break
        # The step is user code: whatever it raises (SystemExit too: a tool wrapping a command line's main())
        # is the tool's failure, retried and then reported with its type and message (the group is
        # dead-lettered), never turned into a reply the model trains on, nor the end of the rollout worker.
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            if attempt == retries:
                reply = Reply(done=True, finish="error", tool_call=True,
                              error=f"env.step raised on {retries + 1} tries: {type(exc).__name__}: {exc}")
                break
            time.sleep(min(0.05 * 2 ** attempt, 1.0))
    done_at.append(time.monotonic())
    return reply


def check_reply(reply: Any, where: str) -> Reply:
    """``reply`` if it is a Reply whose text (if any) is a str that UTF-8 can carry; else TypeError or ValueError.

    Checked where the environment's code runs, so that a wrong return is the
    tool's failure (its group dead-lettered with this message), not an error
    further on, in the worker's loop or when the group is encoded.
    """
    if not isinstance(reply, Reply):
        raise TypeError(f"{where} returned a {type(reply).__name__}, not a Reply")
    if reply.text is not None:
        if not isinstance(reply.text, str):
            raise TypeError(f"{where} returned a Reply whose text is a {type(reply.text).__name__}, not a str")
        try:
            reply.text.encode("utf-8")
        except UnicodeEncodeError as exc:   # a lone surrogate (json.loads makes them from "\ud800")
            raise ValueError(f"{where} returned text UTF-8 cannot carry: {exc}") from None
    return reply


def _checked_timeout_reply(env: Environment, state: Any, task: Task) -> Reply:
    try:
        return check_reply(env.timeout_reply(state, task), f"{type(env).__name__}.timeout_reply")
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code: its failure ends the episode, dead-lettered
        return Reply(done=True, finish="error", tool_call=True, timed_out=True,
                     error=f"a step ran late and timeout_reply failed: {type(exc).__name__}: {exc}")


def _with_latency(reply: Reply, latency_s: float) -> Reply:
    if not reply.tool_call:
        return reply
    return Reply(reply.text, reply.done, reply.finish, reply.tool_call, latency_s, reply.timed_out, reply.error)


def cut_at_stop(text: str, stops: Iterable[str]) -> tuple[str, str | None]:
    """``text`` up to and including the first stop string in it, and that stop (None: no stop)."""
    best, which = -1, None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best < 0 or i + len(stop) < best):
            best, which = i + len(stop), stop
    return (text[:best], which) if which is not None else (text, None)


def check_reward(value: Any) -> float:
    """A reward as a finite float (numpy's numbers too); RewardError otherwise (a None or a NaN is not a zero)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"reward is a {type(value).__name__}, not a number")
    if not math.isfinite(value):
        raise RewardError(f"reward is {value}")
    return float(value)
