"""GRPO's arithmetic: group-normalised advantages and the clipped, token-level loss.

Pure torch, no Redis: called by the learner process and tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / std within one group; a group whose rewards are all equal gives zeros."""
    t = torch.tensor(rewards, dtype=torch.float64)
    std = t.std(unbiased=False)
    if std < eps:
        return [0.0] * len(rewards)
    return ((t - t.mean()) / (std + eps)).tolist()


@dataclass
class LossStats:
    tokens: int
    ratio_mean: float
    clip_frac: float
    max_abs_log_ratio: float
    mean_abs_ratio_dev: float  # mean |ratio - 1| over policy tokens


def clipped_loss(new_logp: list[torch.Tensor], old_logp: list[torch.Tensor], masks: list[torch.Tensor],
                 advantages: list[float], clip_eps: float, total_tokens: int) -> tuple[torch.Tensor, LossStats]:
    """Sum over trajectories of the PPO-clipped surrogate, divided by ``total_tokens``.

    Token-level: each policy token weighs the same whatever its trajectory's
    length; ``total_tokens`` counts the policy tokens of the whole batch so
    that micro-batches add up to the batch loss. Tool tokens have mask 0.
    """
    terms, log_ratios, clipped = [], [], []
    for new, old, mask, adv in zip(new_logp, old_logp, masks, advantages):
        m = mask.to(new.dtype)
        log_ratio = (new - old) * m
        ratio = torch.exp(log_ratio)
        unclipped = ratio * adv
        clipped_r = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
        terms.append(-(torch.minimum(unclipped, clipped_r) * m).sum())
        sel = m.bool()
        log_ratios.append(log_ratio[sel].detach())
        clipped.append(((ratio[sel] - 1).abs() > clip_eps).detach())
    loss = torch.stack(terms).sum() / max(total_tokens, 1)
    lr_all = torch.cat(log_ratios) if log_ratios else torch.zeros(0)
    n = int(lr_all.numel())
    stats = LossStats(
        tokens=n,
        ratio_mean=float(lr_all.exp().mean()) if n else 1.0,
        clip_frac=float(torch.cat(clipped).float().mean()) if n else 0.0,
        max_abs_log_ratio=float(lr_all.abs().max()) if n else 0.0,
        mean_abs_ratio_dev=float((lr_all.exp() - 1).abs().mean()) if n else 0.0,
    )
    return loss, stats
