"""Sample diversity of GRPO groups: are a prompt's trajectories near-copies?

Pure functions over completion texts and rewards; no Redis, no torch. The
learner calls ``diversity_metrics`` every ``metrics.diversity_every`` steps on
the groups of the step and merges the result into its step metrics (the
``diversity_*`` keys of a ``learner_step`` line, see docs/observability.md).
The field guide's warning is the reason: high throughput with one collapsed
tool-call path is a failure, and groups whose rewards are all equal give GRPO
no signal at all.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable, Hashable, Iterable, Sequence

Tokenize = Callable[[str], Sequence[Hashable]]
NGRAM = 4  # token n-gram order of the similarity
EQUAL_REWARD_TOL = 1e-9  # rewards closer than this count as equal (floats from verifiers)


def normalise(text: str) -> str:
    """Whitespace-insensitive form of a completion: runs of whitespace become one space."""
    return " ".join(text.split())


def distinct_rate(texts: Sequence[str]) -> float:
    """Unique completions (after whitespace normalisation) over group size; 1.0 = all different."""
    if not texts:
        return 0.0
    return len({normalise(t) for t in texts}) / len(texts)


def ngrams(tokens: Sequence[Hashable], n: int = NGRAM) -> frozenset:
    """The set of token n-grams; a sequence shorter than n is its own single gram."""
    if len(tokens) < n:
        return frozenset([tuple(tokens)]) if tokens else frozenset()
    return frozenset(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 1.0  # two empty completions are identical
    return len(a & b) / len(a | b)


def mean_pairwise_similarity(texts: Sequence[str], tokenize: Tokenize = list, n: int = NGRAM) -> float | None:
    """Mean Jaccard similarity of the token n-gram sets over all pairs; None for fewer than two texts.

    Tokens default to characters (our policy is character level); pass the
    model tokenizer's ``encode`` for a subword policy. O(group_size^2) pairs,
    which is 28 for a group of 8 and 2,016 for 64.
    """
    if len(texts) < 2:
        return None
    grams = [ngrams(tokenize(t), n) for t in texts]
    pairs = [jaccard(a, b) for a, b in combinations(grams, 2)]
    return sum(pairs) / len(pairs)


def rewards_all_equal(rewards: Iterable[float]) -> bool:
    rs = list(rewards)
    return bool(rs) and max(rs) - min(rs) <= EQUAL_REWARD_TOL


def diversity_metrics(groups: Sequence[tuple[Sequence[str], Sequence[float]]],
                      tokenize: Tokenize = list, n: int = NGRAM) -> dict:
    """Diversity of a set of groups, each ``(completion texts, rewards)``; means over groups.

    Returns ``diversity_distinct_rate`` (mean unique share per group),
    ``diversity_similarity`` (mean pairwise n-gram Jaccard per group, None
    when no group has two samples), ``diversity_equal_reward_share`` (share of
    groups whose rewards are all equal) and ``diversity_groups``.
    """
    if not groups:
        return {"diversity_distinct_rate": None, "diversity_similarity": None,
                "diversity_equal_reward_share": None, "diversity_groups": 0}
    distinct = [distinct_rate(texts) for texts, _r in groups]
    sims = [s for s in (mean_pairwise_similarity(texts, tokenize, n) for texts, _r in groups) if s is not None]
    equal = sum(1 for _t, rewards in groups if rewards_all_equal(rewards))
    return {
        "diversity_distinct_rate": sum(distinct) / len(distinct),
        "diversity_similarity": sum(sims) / len(sims) if sims else None,
        "diversity_equal_reward_share": equal / len(groups),
        "diversity_groups": len(groups),
    }
