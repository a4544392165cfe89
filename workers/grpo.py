"""GRPO's arithmetic: group advantages and the token-level policy losses.

Pure torch, no Redis: called by the learner process and tested on its own.

Two objectives (``learner.objective``):

- ``behaviour``: PPO's clipped surrogate with the ratio taken against the
  behaviour policy (the log-probs the engine sampled with). One optimizer step
  per batch. A stale token whose ratio has left the clip range in the
  direction of its advantage gets no gradient, one in the other direction
  gets an unbounded weight (ratio 10, weight 10).
- ``decoupled``: the clip is anchored at the proximal policy (the learner's
  weights before the update), and the behaviour policy enters only through
  an importance weight pi_prox / pi_behaviour, truncated at ``is_cap`` (and
  optionally masking tokens beyond ``is_mask``). Staleness then scales a
  token's weight instead of switching its gradient off, the clip keeps several
  mini-batch steps near the proximal policy, and dual clip bounds the term
  of a negative advantage.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


SIGNAL_EPS = 1e-6   # rewards whose spread is below this are equal: the group has no signal


def no_signal(rewards: list[float]) -> bool:
    """Whether a group's rewards are all equal (0.1 + 0.2 and 0.3 too): its advantages are zeros."""
    return float(torch.tensor(rewards, dtype=torch.float64).std(unbiased=False)) < SIGNAL_EPS


def group_advantages(rewards: list[float], mode: str = "grpo") -> list[float]:
    """Advantages of one group's samples; a group whose rewards are all equal (``no_signal``) gives zeros.

    ``grpo``: (r - mean) / std. ``dr_grpo``: r - mean (Dr. GRPO: dividing by
    the std weighs nearly-solved and nearly-failed prompts up).
    """
    if no_signal(rewards):
        return [0.0] * len(rewards)
    t = torch.tensor(rewards, dtype=torch.float64)
    centred = t - t.mean()
    if mode == "dr_grpo":
        return centred.tolist()
    return (centred / (t.std(unbiased=False) + SIGNAL_EPS)).tolist()


@dataclass
class TokenCounts:
    """Sums over policy tokens that add up over micro-batches, mini-batches and ranks."""

    tokens: float = 0.0          # policy tokens in the loss (masked-out tokens excluded)
    clipped: float = 0.0         # of those, with |ratio - 1| > clip_eps
    pos: float = 0.0             # tokens with a positive advantage
    clipped_pos: float = 0.0
    neg: float = 0.0             # tokens with a negative advantage
    clipped_neg: float = 0.0
    masked: float = 0.0          # tokens taken out by is_mask (decoupled)
    truncated: float = 0.0       # tokens whose importance weight was cut at is_cap (decoupled)
    weight_sum: float = 0.0      # sum of the importance weights used (1 per token for behaviour)
    entropy_sum: float = 0.0     # sum of the current policy's entropy at each policy token
    entropy_n: float = 0.0
    log_ratio_max: float = 0.0   # max |log ratio| (a max, not a sum: combined with max)

    def add(self, other: "TokenCounts") -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name == "log_ratio_max" else mine + theirs)

    def as_list(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_list(cls, values) -> "TokenCounts":
        return cls(*map(float, values))

    def rates(self) -> dict:
        """The step's figures: clip fractions (all, and by the sign of the advantage), masking, entropy."""
        def frac(a, b):
            return a / b if b else 0.0
        return {"clip_frac": frac(self.clipped, self.tokens), "clip_frac_pos": frac(self.clipped_pos, self.pos),
                "clip_frac_neg": frac(self.clipped_neg, self.neg),
                "is_masked_frac": frac(self.masked, self.tokens + self.masked),
                "is_truncated_frac": frac(self.truncated, self.tokens),
                "is_weight_mean": frac(self.weight_sum, self.tokens) if self.tokens else 1.0,
                "entropy": frac(self.entropy_sum, self.entropy_n) if self.entropy_n else None}


@dataclass
class LossStats:
    tokens: int
    ratio_mean: float
    clip_frac: float
    max_abs_log_ratio: float
    mean_abs_ratio_dev: float  # mean |ratio - 1| over policy tokens
    counts: TokenCounts | None = None


def _count_tokens(counts: TokenCounts, log_ratios: list, clipped: list, log_ratio: torch.Tensor,
                  ratio: torch.Tensor, sel: torch.Tensor, clip_eps: float, adv: float) -> float:
    """Count one trajectory's tokens in the loss (``sel``) and the clipped ones, by the advantage's sign."""
    out = ((ratio[sel] - 1).abs() > clip_eps).detach()
    log_ratios.append(log_ratio[sel].detach())
    clipped.append(out)
    n, c = float(sel.sum()), float(out.sum())
    counts.tokens += n
    counts.clipped += c
    if adv > 0:
        counts.pos += n
        counts.clipped_pos += c
    elif adv < 0:
        counts.neg += n
        counts.clipped_neg += c
    return n


def _stats(log_ratios: list, clipped: list, counts: TokenCounts) -> LossStats:
    lr_all = torch.cat(log_ratios) if log_ratios else torch.zeros(0)
    n = int(lr_all.numel())
    counts.log_ratio_max = float(lr_all.abs().max()) if n else 0.0
    return LossStats(
        tokens=n,
        ratio_mean=float(lr_all.exp().mean()) if n else 1.0,
        clip_frac=float(torch.cat(clipped).float().mean()) if n else 0.0,
        max_abs_log_ratio=counts.log_ratio_max,
        mean_abs_ratio_dev=float((lr_all.exp() - 1).abs().mean()) if n else 0.0,
        counts=counts,
    )


def clipped_loss(new_logp: list[torch.Tensor], old_logp: list[torch.Tensor], masks: list[torch.Tensor],
                 advantages: list[float], clip_eps: float, total_tokens: float) -> tuple[torch.Tensor, LossStats]:
    """The ``behaviour`` objective: sum over trajectories of the PPO-clipped surrogate, divided by ``total_tokens``.

    The ratio is new / behaviour. Token-level: each policy token weighs the
    same whatever its trajectory's length; ``total_tokens`` is the batch's
    normaliser (its policy tokens), so that micro-batches add up to the batch
    loss. Tool tokens have mask 0.
    """
    terms, log_ratios, clipped = [], [], []
    counts = TokenCounts()
    for new, old, mask, adv in zip(new_logp, old_logp, masks, advantages):
        m = mask.to(new.dtype)
        log_ratio = (new - old) * m
        ratio = torch.exp(log_ratio)
        unclipped = ratio * adv
        clipped_r = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
        terms.append(-(torch.minimum(unclipped, clipped_r) * m).sum())
        n = _count_tokens(counts, log_ratios, clipped, log_ratio, ratio, m.bool(), clip_eps, adv)
        counts.weight_sum += n
    loss = torch.stack(terms).sum() / max(total_tokens, 1)
    return loss, _stats(log_ratios, clipped, counts)


def decoupled_loss(new_logp: list[torch.Tensor], prox_logp: list[torch.Tensor], behav_logp: list[torch.Tensor],
                   masks: list[torch.Tensor], advantages: list[float], *, clip_eps: float, is_cap: float,
                   is_mask: float, dual_clip: float, total_tokens: float,
                   trust_clip: float = 0.0) -> tuple[torch.Tensor, LossStats]:
    """The ``decoupled`` objective: w x clipped(new / prox) x advantage, summed and divided by ``total_tokens``.

    Masked-out tokens (``is_mask``, ``trust_clip``) are counted in ``masked``.

    w = pi_prox / pi_behaviour per token, truncated at ``is_cap``; with
    ``is_mask`` > 0 a token whose w lies outside [1 / is_mask, is_mask] is
    left out altogether. ``trust_clip`` > 0 leaves out a token that has
    already moved more than that since it was sampled in its advantage's
    direction (w > 1 + trust_clip with a positive advantage, w < 1 -
    trust_clip with a negative one): the trust region of PPO's clip, which
    pushing such tokens on through stale samples breaks (measured: a
    quick-start run at staleness 4 without it fell from 27% to 3% held-out
    success). ``dual_clip`` > 0 bounds the term of a negative advantage below
    by dual_clip x advantage. ``prox_logp`` carries no gradient. With one mini-batch, prox is the current weights, so the ratio
    is 1 and the gradient is w x advantage x grad log pi.
    """
    terms, log_ratios, clipped = [], [], []
    counts = TokenCounts()
    for new, prox, behav, mask, adv in zip(new_logp, prox_logp, behav_logp, masks, advantages):
        m = mask.to(new.dtype)
        prox = prox.detach()
        w_raw = torch.exp((prox - behav) * m)
        keep = m
        if is_mask > 0:
            keep = keep * ((w_raw <= is_mask) & (w_raw >= 1.0 / is_mask)).to(m.dtype)
        if trust_clip > 0 and adv != 0:
            moved = w_raw > 1 + trust_clip if adv > 0 else w_raw < 1 - trust_clip
            keep = keep * (~moved).to(m.dtype)
        w = torch.clamp(w_raw, max=is_cap)
        log_ratio = (new - prox) * keep
        ratio = torch.exp(log_ratio)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
        if dual_clip > 0 and adv < 0:
            surrogate = torch.maximum(surrogate, torch.full_like(surrogate, dual_clip * adv))
        terms.append(-(w * surrogate * keep).sum())
        sel = keep.bool()
        n = _count_tokens(counts, log_ratios, clipped, log_ratio, ratio, sel, clip_eps, adv)
        counts.masked += float(m.sum()) - n
        counts.truncated += float(((w_raw > is_cap) & sel).sum())
        counts.weight_sum += float(w[sel].sum())
    loss = torch.stack(terms).sum() / max(total_tokens, 1)
    return loss, _stats(log_ratios, clipped, counts)
