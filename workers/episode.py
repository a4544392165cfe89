"""The multi-turn tool loop, written once for every generator.

Who calls it: the rollout worker (``run_episodes`` over a ``VLLMEngine``), the
evaluator (``evaluate``), and tests and the warm-start check through
``workers.tiny_policy.TorchGenerator`` (a pure-torch reference).

An episode alternates policy turns and tool results. Each turn, all
unfinished sequences go to the generator in one batched call; a turn ends at a
stop string of the environment (``calc.TOOL_STOPS``), at EOS, or at
``max_tokens_per_turn``. After ``</calc>`` the tool runs (all of a turn's
calls concurrently) and its result is appended as tokens with mask 0, so the
learner never trains on text the policy did not sample.

Seeds: each request's seed is a hash of (run seed, prompt_id, sample_idx,
turn), so an episode regenerated under the same id samples the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from workers.envs import calc
from workers.envs.calc import Problem


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
    completion_tokens: list[int]  # generated and tool tokens interleaved
    completion_mask: list[int]  # 1 = sampled from the policy, 0 = inserted by the tool
    logprobs: list[float]  # behaviour log-prob of each completion token, 0.0 where mask is 0
    text: str  # the completion as text (EOS excluded)
    turns: int = 0
    tool_calls: int = 0
    tool_latency_s: list[float] = field(default_factory=list)
    tool_timeouts: int = 0
    finish: str = ""  # "answer" | "length" | "max_turns" | "eos"


def request_seed(seed: int, prompt_id: str, sample_idx: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample_idx}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _new_episode(tokenizer, problem: Problem, sample_idx: int) -> Episode:
    prompt_tokens = tokenizer.encode(problem.prompt, add_special_tokens=False)
    return Episode(problem.prompt_id, sample_idx, prompt_tokens, [], [], [], "")


def _append(ep: Episode, token_ids: list[int], logprobs: list[float], text: str, sampled: bool) -> None:
    ep.completion_tokens.extend(token_ids)
    ep.completion_mask.extend([1 if sampled else 0] * len(token_ids))
    ep.logprobs.extend(logprobs if sampled else [0.0] * len(token_ids))
    ep.text += text


def _close_turn(ep: Episode, out: TurnOutput, last_turn: bool) -> bool:
    """Record a turn's output; True if the episode now wants a tool call."""
    _append(ep, out.token_ids, out.logprobs, out.text, sampled=True)
    ep.turns += 1
    if out.finish_reason == "eos":
        ep.finish = "eos"
    elif out.finish_reason == "length":
        ep.finish = "length"
    elif out.text.endswith(calc.ANSWER_CLOSE):
        ep.finish = "answer"
    elif last_turn:
        ep.finish = "max_turns"
    else:
        return True
    return False


def _run_tools(tokenizer, episodes: list[Episode], turn_texts: list[str], tool_timeout_s: float, tool_delay_s: float) -> None:
    exprs = [calc.parse_tool_call(t) for t in turn_texts]
    results = calc.run_tools(exprs, tool_timeout_s, delay_s=tool_delay_s)
    for ep, res in zip(episodes, results):
        ids = tokenizer.encode(res.text, add_special_tokens=False)
        _append(ep, ids, [], res.text, sampled=False)
        ep.tool_calls += 1
        ep.tool_latency_s.append(res.latency_s)
        ep.tool_timeouts += int(res.timed_out)


def run_episodes(
    generator: Generator,
    tokenizer,
    items: list[tuple[Problem, int]],
    *,
    greedy: bool,
    max_turns: int,
    max_tokens_per_turn: int,
    tool_timeout_s: float,
    seed: int,
    max_total_tokens: int | None = None,
    tool_delay_s: float = 0.0,
) -> list[Episode]:
    """Play one episode per (problem, sample_idx), all advanced turn by turn in batches.

    ``max_total_tokens`` (prompt + completion) ends a sequence with "length"
    before a turn that could overflow it; it defaults to the generator's
    ``max_model_len`` if it has one. ``tool_delay_s`` simulates a slow tool.
    """
    if max_total_tokens is None:
        max_total_tokens = getattr(generator, "max_model_len", None)
    episodes = [_new_episode(tokenizer, p, i) for p, i in items]
    active = list(range(len(episodes)))
    for turn in range(max_turns):
        active = _fit_context(episodes, active, max_tokens_per_turn, max_total_tokens)
        if not active:
            break
        requests = [episodes[i].prompt_tokens + episodes[i].completion_tokens for i in active]
        seeds = None if greedy else [request_seed(seed, episodes[i].prompt_id, episodes[i].sample_idx, turn) for i in active]
        outs = generator.generate(requests, greedy=greedy, seeds=seeds, max_tokens=max_tokens_per_turn, stops=calc.TOOL_STOPS)
        calling = [(i, out.text) for i, out in zip(active, outs) if _close_turn(episodes[i], out, turn == max_turns - 1)]
        _run_tools(tokenizer, [episodes[i] for i, _ in calling], [t for _, t in calling], tool_timeout_s, tool_delay_s)
        active = [i for i, _ in calling]
    return episodes


def _fit_context(episodes: list[Episode], active: list[int], max_tokens: int, max_total: int | None) -> list[int]:
    """The active sequences with room for another turn; the rest end with "length"."""
    if max_total is None:
        return active
    keep = []
    for i in active:
        ep = episodes[i]
        if len(ep.prompt_tokens) + len(ep.completion_tokens) + max_tokens > max_total:
            ep.finish = "length"
        else:
            keep.append(i)
    return keep


def evaluate(
    generator: Generator,
    tokenizer,
    problems: list[Problem],
    *,
    max_turns: int,
    max_tokens_per_turn: int,
    tool_timeout_s: float,
    max_total_tokens: int | None = None,
) -> tuple[float, list[Episode]]:
    """Greedy success rate on ``problems`` and the episodes behind it."""
    episodes = run_episodes(
        generator,
        tokenizer,
        [(p, 0) for p in problems],
        greedy=True,
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        tool_timeout_s=tool_timeout_s,
        seed=0,
        max_total_tokens=max_total_tokens,
    )
    rewards = [calc.verify(p, ep.text) for p, ep in zip(problems, episodes)]
    return (sum(rewards) / len(rewards) if rewards else 0.0), episodes
