"""Warm start any Hugging Face policy on an environment's demonstrations, so that GRPO starts with signal.

GRPO learns nothing from a group whose samples all fail (or all succeed): a
policy has to solve some tasks before RL can help. This runs supervised steps
on ``Environment.demonstration`` episodes, played through the environment
and rendered exactly as the episode loop renders them (``workers.chat``: the
chat template when the tokenizer has one), with the loss on the model's
tokens only, and stops once greedy held-out success reaches ``target``.

Called by ``scripts/build_standins.py --warm-start`` for the stand-in models;
the tiny built-in policy has its own cached build (``workers.tiny_policy``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.chat import ChatFormat
from workers.envs.base import Environment, Task
from workers.episode import demonstration_episode, evaluate, unjudged
from workers.tiny_policy import TorchGenerator, built_whole, load_model, load_tokenizer, save_weights, sft_loss


@dataclass(frozen=True)
class WarmStart:
    """The supervised run: steps, batch, learning rate, demonstration noise, when to stop."""

    max_steps: int = 600
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 20
    noise: float = 0.2               # share of demonstration turns that go wrong (a weak teacher)
    target: float | None = 0.3       # stop once greedy held-out success reaches this (None: run max_steps)
    eval_every: int = 50
    eval_size: int = 100
    max_tokens_per_turn: int = 32
    max_turns: int = 8
    seed: int = 0

    def __post_init__(self):
        for name in ("max_steps", "batch_size", "warmup_steps", "eval_every", "eval_size", "max_tokens_per_turn",
                     "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"WarmStart {name} = {getattr(self, name)}: give at least 1")


def batches(env, fmt, tokenizer, tasks: list[Task], ws: WarmStart) -> Iterator[tuple[list, list, list]]:
    """Endless shuffled batches of demonstration sequences (of every task, where there are fewer than a batch)."""
    if not tasks:
        raise ValueError("the warm start has no training tasks")
    rng = random.Random(ws.seed)
    size = min(ws.batch_size, len(tasks))
    while True:
        order = rng.sample(range(len(tasks)), len(tasks))
        for start in range(0, len(order) - size + 1, size):
            seqs = [demonstration_episode(env, fmt, tokenizer, tasks[i], rng, ws.noise)
                    for i in order[start:start + size]]
            yield tuple(map(list, zip(*seqs)))


def greedy_success(model, tokenizer, env: Environment, tasks: list[Task], ws: WarmStart) -> float:
    """Greedy success on ``tasks``; ValueError when the environment's reward judged none of them (its rate
    would read 0.0, a figure nothing measured, and the warm start would train on to ``max_steps`` for it)."""
    model.eval()
    with torch.no_grad():
        rate, episodes = evaluate(TorchGenerator(model, tokenizer), tokenizer, tasks, env=env,
                                  max_turns=ws.max_turns, max_tokens_per_turn=ws.max_tokens_per_turn,
                                  tool_timeout_s=5.0)
    model.train()
    if unjudged(episodes) == len(episodes):
        errors = sorted({ep.error for ep in episodes})
        raise ValueError(f"the warm start's evaluation judged none of its {len(tasks)} held-out tasks: "
                         f"{errors[0] if errors else 'no episode'}")
    return rate


def warm_start(model_dir: str | Path, out_dir: str | Path, env: Environment, *, train: list[Task],
               held_out: list[Task], ws: WarmStart = WarmStart(),
               progress: Callable[[str], None] = lambda line: None) -> dict:
    """Train ``model_dir``'s policy on ``env``'s demonstrations into ``out_dir``; returns what happened.

    Seeded by ``ws.seed``; the caller's torch RNG is left as it was."""
    if not held_out:
        raise ValueError("the warm start needs held-out tasks to measure its success on (held_out is empty)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ws.seed)
        return _warm_start(model_dir, out_dir, env, train, held_out, ws, progress)


def _warm_start(model_dir, out_dir, env: Environment, train: list[Task], held_out: list[Task], ws: WarmStart,
                progress: Callable[[str], None]) -> dict:
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    fmt = ChatFormat.for_tokenizer(tokenizer, env.reply_role)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    held = held_out[:ws.eval_size]
    history = [(0, greedy_success(model, tokenizer, env, held, ws))]
    progress(f"step 0: held-out success {history[-1][1]:.2f}")
    t0, step, stream = time.monotonic(), 0, batches(env, fmt, tokenizer, train, ws)
    while step < ws.max_steps and not (ws.target is not None and history[-1][1] >= ws.target):
        for group in opt.param_groups:
            group["lr"] = ws.lr * min(1.0, (step + 1) / ws.warmup_steps)
        loss = sft_loss(model, *next(stream))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % ws.eval_every == 0 or step == ws.max_steps:
            history.append((step, greedy_success(model, tokenizer, env, held, ws)))
            progress(f"step {step}: loss {loss.item():.3f}, held-out success {history[-1][1]:.2f} "
                     f"({time.monotonic() - t0:.0f}s)")
    with built_whole(out_dir) as tmp:   # a failed save leaves no directory that looks built
        save_weights(model, tmp, model_dir)
    return {"steps": step, "success": history[-1][1], "history": history, "seconds": time.monotonic() - t0}
