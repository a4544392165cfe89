"""The multi-turn episode loop, written once for every generator and every environment.

Who calls it: the rollout worker (``run_episodes`` over a ``VLLMEngine``), the
evaluator (``evaluate``), and tests and the warm-start check through
``workers.tiny_policy.TorchGenerator`` (a pure-torch reference).

An episode alternates model turns and environment replies
(``workers.envs.base.Environment``). Each turn, all unfinished sequences go
to the generator in one batched call; a turn ends at a stop string of the
environment (decided on tokens), at the end-of-turn token, or at
``max_tokens_per_turn``. The environment then answers every turn that goes
on (concurrently, each step bounded by its timeout), and its reply is
appended as tokens with mask 0 (``workers.chat``), so the learner never
trains on text the model did not sample. Token ids are never re-derived from
text: what the engine sampled is what the learner trains on.

Seeds: each request's seed is a hash of (run seed, prompt_id, sample_idx,
turn), so an episode regenerated under the same id samples the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from workers.chat import ChatFormat
from workers.envs import load_env
from workers.envs.base import CallTimeout, Environment, HungCalls, Task, check_reward, env_call, env_calls

DEFAULT_ENV = "calc"   # the environment when none is given (config's env.entry default)
# The longest ``env.start`` may take (at least a step's timeout): a start may build a sandbox, which is
# slower than a tool call, but one that never returns must still end its episode.
START_TIMEOUT_S = 60.0


@dataclass
class TurnOutput:
    token_ids: list[int]  # sampled tokens, EOS included when sampled
    logprobs: list[float]  # behaviour log-prob of each token in token_ids
    text: str  # decoded token_ids, EOS excluded
    finish_reason: str  # "stop" (a stop string ended it) | "eos" | "length"


class Generator(Protocol):
    def generate(
        self,
        requests: list[list[int]],
        *,
        greedy: bool,
        seeds: list[int] | None,
        max_tokens: int,
        stops: Sequence[str],
    ) -> list[TurnOutput]:
        """One turn for each request (a full token context); temperature 1 unless greedy."""
        ...


@dataclass
class Episode:
    prompt_id: str
    sample_idx: int
    prompt_tokens: list[int]
    completion_tokens: list[int]  # generated and environment tokens interleaved
    completion_mask: list[int]  # 1 = sampled from the policy, 0 = inserted by the environment
    logprobs: list[float]  # behaviour log-prob of each completion token, 0.0 where mask is 0
    text: str  # the transcript: the model's turns and the replies' text (no chat markup)
    turns: int = 0
    tool_calls: int = 0
    tool_latency_s: list[float] = field(default_factory=list)
    tool_timeouts: int = 0
    finish: str = ""  # the environment's reason ("answer", ...), or "length" | "max_turns" | "eos" | "error"
    state: Any = None  # the environment's state of this episode
    error: str = ""  # a tool call that raised on every try (the rollout worker dead-letters the group)


def request_seed(seed: int, prompt_id: str, sample_idx: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample_idx}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class Loop:
    """What every episode of a call shares: the environment, the token format and the limits."""

    env: Environment
    tokenizer: Any
    fmt: ChatFormat
    max_turns: int
    max_tokens_per_turn: int
    step_timeout_s: float
    max_total_tokens: int | None
    tool_retries: int = 0  # tries of a step that raises, after the first, within its timeout
    on_tool_timeout: str = "reply"  # a late step: "reply" (timeout_reply, the episode goes on) or "dead_letter"

    def new_episodes(self, items: Sequence[tuple[Task, int]]) -> list[Episode]:
        """Fresh episodes for (task, sample_idx) pairs; their ``env.start`` calls run at once on the step pool
        (a start may build a sandbox), each bounded (START_TIMEOUT_S); a failure is the episode's ``error``."""
        started = env_calls(self.env.start, [(task,) for task, _i in items],
                            timeout_s=max(self.step_timeout_s, START_TIMEOUT_S))
        episodes = []
        for (task, sample_idx), state in zip(items, started):
            ep = Episode(task.prompt_id, sample_idx, self.fmt.prompt_ids(self.tokenizer, task.prompt), [], [], [], "")
            if isinstance(state, CallTimeout):
                ep.finish, ep.error = "error", f"env.start: {state}"
            elif isinstance(state, (Exception, SystemExit)):   # user code: reported with the group, not a crash
                ep.finish, ep.error = "error", f"env.start raised {type(state).__name__}: {state}"
            else:
                ep.state = state
            episodes.append(ep)
        return episodes

    def close_turn(self, ep: Episode, out: TurnOutput) -> bool:
        """Record a turn's output; True if the environment should answer it."""
        _append(ep, out.token_ids, out.logprobs, out.text, sampled=True)
        ep.turns += 1
        if out.finish_reason == "length":
            ep.finish = "length"
            return False
        return True

    def answer(self, episodes: list[Episode], tasks: list[Task], outs: list[TurnOutput], last_turn: bool) -> list[int]:
        """The environment's replies to these turns; returns the indices of the episodes that go on."""
        calls = [(ep.state, task, out.text, out.finish_reason) for ep, task, out in zip(episodes, tasks, outs)]
        replies = self.env.respond(calls, self.step_timeout_s, retries=self.tool_retries,
                                   on_timeout=self.on_tool_timeout)
        going = []
        for k, (ep, out, reply) in enumerate(zip(episodes, outs, replies)):
            if reply.error and last_turn:   # no turn left to read its reply: the failure loses nothing
                ep.finish = "max_turns"     # and, as a last turn's reply that worked, it is not counted
                continue
            if reply.error:   # the tool failed on every try, or ran late: the episode ends, its group dead-lettered
                _count_call(ep, reply)
                ep.finish, ep.error = "error", reply.error
                continue
            if reply.done:
                _count_call(ep, reply)
                ep.finish = reply.finish or "done"
                continue
            if last_turn:   # no turn left to read the reply: it is not inserted, and not counted
                ep.finish = "max_turns"
                continue
            _count_call(ep, reply)
            if reply.text is not None:
                ids = self.fmt.reply_ids(self.tokenizer, reply.text, out.finish_reason == "eos")
                if not self.has_room(ep, len(ids)):   # no room for it and a turn after: not inserted
                    ep.finish = "length"
                    continue
                _append(ep, ids, [], reply.text, sampled=False)
            going.append(k)
        return going

    def has_room(self, ep: Episode, more: int = 0) -> bool:
        """Whether ``more`` tokens and one more turn fit in ``max_total_tokens`` (the engine's context)."""
        return (self.max_total_tokens is None or len(ep.prompt_tokens) + len(ep.completion_tokens) + more
                + self.max_tokens_per_turn <= self.max_total_tokens)

    def fit_context(self, episodes: list[Episode], active: list[int]) -> list[int]:
        """The active sequences with room for another turn; the rest end with "length"."""
        keep = []
        for i in active:
            if self.has_room(episodes[i]):
                keep.append(i)
            else:
                episodes[i].finish = "length"
        return keep


def _count_call(ep: Episode, reply) -> None:
    if reply.tool_call:
        ep.tool_calls += 1
        ep.tool_latency_s.append(reply.latency_s)
        ep.tool_timeouts += int(reply.timed_out)


def _append(ep: Episode, token_ids: list[int], logprobs: list[float], text: str, sampled: bool) -> None:
    ep.completion_tokens.extend(token_ids)
    ep.completion_mask.extend([1 if sampled else 0] * len(token_ids))
    ep.logprobs.extend(logprobs if sampled else [0.0] * len(token_ids))
    ep.text += text


def make_loop(tokenizer, *, env: Environment | None, max_turns: int, max_tokens_per_turn: int, tool_timeout_s: float,
              max_total_tokens: int | None, chat_template: bool | None = None, tool_retries: int = 0,
              on_tool_timeout: str = "reply") -> Loop:
    env = env if env is not None else load_env(DEFAULT_ENV)
    return Loop(env=env, tokenizer=tokenizer,
                fmt=ChatFormat.for_tokenizer(tokenizer, env.reply_role, chat_template),
                max_turns=env.max_turns or max_turns, max_tokens_per_turn=max_tokens_per_turn,
                step_timeout_s=env.step_timeout_s or tool_timeout_s, max_total_tokens=max_total_tokens,
                tool_retries=tool_retries, on_tool_timeout=on_tool_timeout)


def run_episodes(
    generator: Generator,
    tokenizer,
    items: list[tuple[Task, int]],
    *,
    greedy: bool,
    max_turns: int,
    max_tokens_per_turn: int,
    tool_timeout_s: float,
    seed: int,
    env: Environment | None = None,
    max_total_tokens: int | None = None,
    chat_template: bool | None = None,
    tool_retries: int = 0,
    on_tool_timeout: str = "reply",
) -> list[Episode]:
    """Play one episode per (task, sample_idx), all advanced turn by turn in batches.

    ``env``: the environment (default: the calculator, ``DEFAULT_ENV``).
    ``max_total_tokens`` (prompt + completion) ends a sequence with "length"
    before a turn that could overflow it; it defaults to the generator's
    ``max_model_len`` if it has one. ``chat_template``: render through the
    tokenizer's chat template (None: when it has one). ``tool_retries``: tries
    of an environment step that raises, after the first; an episode whose
    step raised on every try ends with ``finish = "error"`` and its ``error``;
    so does one whose step ran past its deadline with ``on_tool_timeout =
    "dead_letter"`` (the rollout worker's setting; evaluations keep "reply").
    """
    if max_total_tokens is None:
        max_total_tokens = getattr(generator, "max_model_len", None)
    loop = make_loop(tokenizer, env=env, max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn,
                     tool_timeout_s=tool_timeout_s, max_total_tokens=max_total_tokens, chat_template=chat_template,
                     tool_retries=tool_retries, on_tool_timeout=on_tool_timeout)
    tasks = [t for t, _ in items]
    episodes = loop.new_episodes(items)
    active = [i for i, ep in enumerate(episodes) if not ep.error]
    for turn in range(loop.max_turns):
        active = loop.fit_context(episodes, active)
        if not active:
            break
        requests = [episodes[i].prompt_tokens + episodes[i].completion_tokens for i in active]
        seeds = None if greedy else [request_seed(seed, episodes[i].prompt_id, episodes[i].sample_idx, turn)
                                     for i in active]
        outs = generator.generate(requests, greedy=greedy, seeds=seeds, max_tokens=max_tokens_per_turn,
                                  stops=loop.env.stop_strings)
        turned = [(i, out) for i, out in zip(active, outs) if loop.close_turn(episodes[i], out)]
        going = loop.answer([episodes[i] for i, _ in turned], [tasks[i] for i, _ in turned],
                            [out for _, out in turned], last_turn=turn == loop.max_turns - 1)
        active = [turned[k][0] for k in going]
    return episodes


UNJUDGED = "reward: "   # the start of the error of an episode evaluate's reward could not judge


def evaluate(
    generator: Generator,
    tokenizer,
    tasks: list[Task],
    *,
    max_turns: int,
    max_tokens_per_turn: int,
    tool_timeout_s: float,
    env: Environment | None = None,
    max_total_tokens: int | None = None,
    chat_template: bool | None = None,
    reward_timeout_s: float = 60.0,
    reward: Callable[[Task, str], float] | None = None,
    tool_retries: int = 0,
) -> tuple[float, list[Episode]]:
    """Greedy success rate on ``tasks`` (mean reward, clipped to [0, 1]) and the episodes behind it.

    ``tool_retries``: as in training (``rollout.tool_retries``), a step that raises is tried again.

    ``reward`` scores them (default: ``env.reward``), each call bounded by ``reward_timeout_s``. An episode the reward
    cannot judge (it raises, runs late or returns no number) has its
    ``error`` set and is left out of the rate, never counted as a 0.
    """
    env = env if env is not None else load_env(DEFAULT_ENV)
    episodes = run_episodes(generator, tokenizer, [(t, 0) for t in tasks], greedy=True, max_turns=max_turns,
                            max_tokens_per_turn=max_tokens_per_turn, tool_timeout_s=tool_timeout_s, seed=0,
                            env=env, max_total_tokens=max_total_tokens, chat_template=chat_template,
                            tool_retries=tool_retries)
    reward = reward if reward is not None else env.reward
    rewards = []
    for t, ep in zip(tasks, episodes):
        try:
            rewards.append(min(1.0, max(0.0, check_reward(env_call(reward, t, ep.text,
                                                                   timeout_s=reward_timeout_s)))))
        except HungCalls:
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the reward is user code: its failure leaves this episode out
            ep.error = f"{UNJUDGED}{type(exc).__name__}: {exc}"
    return (sum(rewards) / len(rewards) if rewards else 0.0), episodes


def unjudged(episodes: list[Episode]) -> int:
    """How many of ``evaluate``'s episodes its reward could not judge (left out of its rate)."""
    return sum(ep.error.startswith(UNJUDGED) for ep in episodes)


def demonstration_episode(env: Environment, fmt: ChatFormat, tokenizer, task: Task, rng: random.Random,
                           noise: float) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, mask) of one demonstration, rendered as the loop renders an episode.

    The turns come from ``env.demonstration`` and the replies from playing them
    through ``env.step``; mask 1 on the model's tokens only. The warm starts
    (``workers.warmstart``, ``workers.tiny_policy``) train on these.
    """
    state, completion, mask = env.start(task), [], []
    turns = env.demonstration(task, rng, noise)
    for k, turn in enumerate(turns):
        ids = tokenizer.encode(turn, add_special_tokens=False)
        completion += ids
        mask += [1] * len(ids)
        reply = env.step(state, task, turn, "stop")
        if reply.done or k == len(turns) - 1:
            break
        if reply.text is not None:
            ids = fmt.reply_ids(tokenizer, reply.text, turn_ended_by_eos=False)
            completion += ids
            mask += [0] * len(ids)
    return fmt.prompt_ids(tokenizer, task.prompt), completion, mask
