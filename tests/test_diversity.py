"""Diversity metrics of GRPO groups: distinct rate, n-gram similarity, equal-reward share."""

from __future__ import annotations

import pytest

from pipeline.observe.diversity import (diversity_metrics, distinct_rate, jaccard, mean_pairwise_similarity, ngrams,
                                rewards_all_equal)


def test_distinct_rate_ignores_whitespace():
    assert distinct_rate(["a b", "a  b", " a b\n", "c"]) == pytest.approx(2 / 4)
    assert distinct_rate(["x", "y", "z"]) == 1.0
    assert distinct_rate([]) == 0.0


def test_ngrams_and_jaccard():
    assert ngrams("abcde") == {tuple("abcd"), tuple("bcde")}
    assert ngrams("ab") == {("a", "b")}  # shorter than n: one gram
    assert jaccard(ngrams("abcde"), ngrams("abcdf")) == pytest.approx(1 / 3)
    assert jaccard(frozenset(), frozenset()) == 1.0


def test_similarity_identical_vs_disjoint():
    assert mean_pairwise_similarity(["3+4=<calc>7</calc>"] * 4) == 1.0
    assert mean_pairwise_similarity(["aaaa", "bbbb", "cccc"]) == 0.0
    assert mean_pairwise_similarity(["one"]) is None


def test_similarity_accepts_a_tokenizer():
    words = str.split
    # Word 2-grams: "a b c" vs "a b d" share one of three distinct grams.
    assert mean_pairwise_similarity(["a b c", "a b d"], tokenize=words, n=2) == pytest.approx(1 / 3)


def test_equal_rewards():
    assert rewards_all_equal([1.0, 1.0, 1.0])
    assert rewards_all_equal([0.0, 1e-12])
    assert not rewards_all_equal([0.0, 1.0])
    assert not rewards_all_equal([])


def test_diversity_metrics_over_groups():
    collapsed = (["<calc>1+1</calc>2"] * 4, [1.0, 1.0, 1.0, 1.0])
    varied = (["alpha", "bravo", "charlie", "delta"], [0.0, 1.0, 0.0, 1.0])
    m = diversity_metrics([collapsed, varied])
    assert m["diversity_groups"] == 2
    assert m["diversity_distinct_rate"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["diversity_equal_reward_share"] == 0.5
    assert 0.5 <= m["diversity_similarity"] < 0.6  # 1.0 for the copies, ~0 for the varied group


def test_diversity_metrics_empty():
    m = diversity_metrics([])
    assert m["diversity_groups"] == 0 and m["diversity_distinct_rate"] is None
