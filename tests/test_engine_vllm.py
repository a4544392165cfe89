"""vLLM (CPU) against the torch reference: greedy episodes, behaviour log-probs, in-place reload.

Slow: builds a partly warm-started tiny policy (~20 s) and starts one
in-process vLLM engine (~20 s) for the whole module; the tests themselves take
seconds. Measured on 2 cores: max |Δ log p| ~2e-5 between vLLM's behaviour
log-probs and ``completion_logprobs``, mean |ratio - 1| ~1e-7; at
temperature 0.7, 3e-5 and 1e-7 (2.5 if the learner forgot to divide by T).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from workers import tiny_policy as tp
from workers.episode import run_episodes
from workers.envs import calc

if os.environ.get("CI") == "true":
    import vllm  # noqa: F401  -- under CI the engine's tests run: a missing vLLM fails them, not skips them
else:
    pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

LOOP = {"max_turns": 4, "max_tokens_per_turn": 32, "tool_timeout_s": 5.0}
# Far below what breaks a ratio (|log r| of 1e-3 is a 0.1% weight error) and
# ~50x above what float32 kernels on CPU differ by.
MAX_ABS_DLOGP = 1e-3
# Enough training to write well-formed multi-turn episodes, not to solve them:
# the tests compare engines, they do not need a good policy.
SPEC = {"warm_steps": 300, "warm_target_success": None}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return tp.ensure_policy(tmp_path_factory.mktemp("policies"), SPEC)


@pytest.fixture(scope="module")
def tokenizer(policy_dir):
    return tp.load_tokenizer(policy_dir)


@pytest.fixture(scope="module")
def engine(policy_dir):
    from workers.engine_vllm import VLLMEngine

    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it in its process
    yield VLLMEngine(policy_dir, seed=0, in_process=True, threads=1)
    torch.set_num_threads = set_num_threads


@pytest.fixture(scope="module")
def problems():
    return calc.make_problems(5, 20, "eval")


def _greedy(generator_or_model, tokenizer, problems):
    if isinstance(generator_or_model, torch.nn.Module):
        return tp.greedy_episodes(generator_or_model, tokenizer, problems, LOOP["max_turns"], LOOP["max_tokens_per_turn"])
    return run_episodes(generator_or_model, tokenizer, [(p, 0) for p in problems], greedy=True, seed=0, **LOOP)


def _assert_same_episodes(vllm_eps, torch_eps):
    for v, t in zip(vllm_eps, torch_eps, strict=True):
        assert v.completion_tokens == t.completion_tokens, (v.text, t.text)
        assert v.completion_mask == t.completion_mask
        assert (v.finish, v.turns, v.tool_calls) == (t.finish, t.turns, t.tool_calls)


def _logprob_gap(model, episodes, temperature: float = 1.0) -> tuple[float, float]:
    """(max |Δ log p|, mean |ratio - 1|) of behaviour log-probs against torch's, over sampled tokens."""
    with torch.no_grad():
        ref = tp.completion_logprobs(model, [e.prompt_tokens for e in episodes], [e.completion_tokens for e in episodes],
                                     temperature=temperature)
    gaps = [new - old for e, lp in zip(episodes, ref) for new, old, m in zip(lp.tolist(), e.logprobs, e.completion_mask) if m]
    return max(abs(g) for g in gaps), sum(abs(math.exp(g) - 1) for g in gaps) / len(gaps)


def _sample(engine, tokenizer, problems, seed):
    items = [(p, i) for p in problems for i in range(4)]
    return run_episodes(engine, tokenizer, items, greedy=False, seed=seed, **LOOP)


def test_greedy_episodes_match_torch(engine, tokenizer, policy_dir, problems):
    model = tp.load_model(policy_dir).eval()
    vllm_eps = _greedy(engine, tokenizer, problems)
    _assert_same_episodes(vllm_eps, _greedy(model, tokenizer, problems))
    assert sum(e.tool_calls for e in vllm_eps) >= len(problems)  # the loop was really multi-turn


def test_behaviour_logprobs_match_torch_and_seeds_reproduce(engine, tokenizer, policy_dir, problems):
    model = tp.load_model(policy_dir).eval()
    episodes = _sample(engine, tokenizer, problems, seed=3)
    max_gap, mean_ratio_err = _logprob_gap(model, episodes)
    assert max_gap < MAX_ABS_DLOGP
    assert mean_ratio_err < 1e-4
    again = _sample(engine, tokenizer, problems, seed=3)
    assert [e.completion_tokens for e in again] == [e.completion_tokens for e in episodes]
    other = _sample(engine, tokenizer, problems, seed=4)
    assert [e.completion_tokens for e in other] != [e.completion_tokens for e in episodes]


def test_behaviour_logprobs_match_the_learner_at_temperature_0_7(engine, tokenizer, policy_dir, problems):
    """At T != 1 vLLM's processed log-probs are those of softmax(logits / T); the learner divides by T too."""
    model = tp.load_model(policy_dir).eval()
    engine.temperature = 0.7
    try:
        episodes = _sample(engine, tokenizer, problems, seed=6)
    finally:
        engine.temperature = 1.0
    max_gap, mean_ratio_err = _logprob_gap(model, episodes, temperature=0.7)
    assert max_gap < MAX_ABS_DLOGP
    assert mean_ratio_err < 1e-4
    # Unscaled learner log-probs disagree far beyond the tolerance: the check has teeth.
    assert _logprob_gap(model, episodes)[0] > 100 * MAX_ABS_DLOGP


def _perturbed(policy_dir, tokenizer):
    """The policy with small noise added and EOS made likely.

    EOS's logit becomes 1.1x the digit 7's: EOS wins wherever 7 led by a
    clear margin (an exact tie would let float noise pick the winner).
    """
    model = tp.load_model(policy_dir).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.005)
        w = model.lm_head.weight
        w[tokenizer.eos_token_id] = 1.1 * w[tokenizer.convert_tokens_to_ids("7")]
    return model


def test_reload_serves_the_new_weights_and_eos_agrees(engine, tokenizer, policy_dir, problems, tmp_path):
    before = _greedy(engine, tokenizer, problems)  # fills the prefix cache with the old weights' KV
    model = _perturbed(policy_dir, tokenizer)
    engine.reload(tp.save_weights(model, tmp_path / "v1", policy_dir))
    try:
        after = _greedy(engine, tokenizer, problems)
        _assert_same_episodes(after, _greedy(model, tokenizer, problems))
        assert [e.completion_tokens for e in after] != [e.completion_tokens for e in before]
        sampled = _sample(engine, tokenizer, problems, seed=5)
        assert _logprob_gap(model, sampled)[0] < MAX_ABS_DLOGP
        ended = [e for e in after + sampled if e.finish == "eos"]
        assert ended, "the perturbed policy should emit EOS"
        assert any(e.finish == "answer" for e in after)  # still a policy, not noise
        for e in ended:
            assert e.completion_tokens[-1] == tokenizer.eos_token_id and e.completion_mask[-1] == 1
            assert e.text == tokenizer.decode(e.completion_tokens[:-1], skip_special_tokens=True)
    finally:
        engine.reload(policy_dir)
    _assert_same_episodes(_greedy(engine, tokenizer, problems), before)
