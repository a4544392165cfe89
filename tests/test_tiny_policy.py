"""The tiny policy (tokenizer, model files, log-probs, torch generator, warm start) and the episode loop.

Fast tests use a freshly initialised model (~0.1 s to build); the warm-start
calibration test is marked slow (about a minute on 2 cores).
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2ForCausalLM

from workers import tiny_policy as tp
from workers.episode import Episode, TurnOutput, evaluate, request_seed, run_episodes
from workers.envs import calc


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return tp.build_policy(tmp_path_factory.mktemp("policy") / "m", seed=0)


@pytest.fixture(scope="module")
def tokenizer(policy_dir):
    return tp.load_tokenizer(policy_dir)


@pytest.fixture(scope="module")
def model(policy_dir):
    return tp.load_model(policy_dir).eval()


# --- tokenizer ------------------------------------------------------------


def test_tokenizer_is_one_token_per_character_and_round_trips(tokenizer):
    p = calc.make_problems(0, 1, "train")[0]
    texts = [p.prompt, calc.demonstration(p, random.Random(0), 0.0), "a  b\n\nQ:~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./ "]
    for s in texts:
        ids = tokenizer.encode(s, add_special_tokens=False)
        assert len(ids) == len(s)
        assert tokenizer.decode(ids) == s
    assert (
        tokenizer.decode(tokenizer.encode("1+1", add_special_tokens=False) + [tokenizer.eos_token_id], skip_special_tokens=True)
        == "1+1"
    )
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)


# --- model files ----------------------------------------------------------


def test_build_is_deterministic_in_the_seed(tmp_path, policy_dir):
    again = load_file(tp.build_policy(tmp_path / "a", seed=0) / "model.safetensors")
    other = load_file(tp.build_policy(tmp_path / "b", seed=1) / "model.safetensors")
    first = load_file(policy_dir / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
    assert all(t.dtype == torch.float32 for t in first.values())


def test_model_dir_is_complete_hf_layout(policy_dir, tokenizer):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (policy_dir / name).exists(), name
    model = Qwen2ForCausalLM.from_pretrained(str(policy_dir))
    assert model.config.vocab_size == len(tokenizer)
    assert next(model.parameters()).dtype == torch.float32


def test_save_weights_round_trips(tmp_path, model, policy_dir):
    ids = torch.tensor([[5, 6, 7, 8]])
    out = tp.save_weights(model, tmp_path / "saved", policy_dir)
    reloaded = tp.load_model(out).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert tp.load_tokenizer(out).encode("Q:1", add_special_tokens=False) == tp.build_tokenizer().encode(
        "Q:1", add_special_tokens=False
    )


def test_save_weights_copies_the_source_tokenizer_files_byte_for_byte(tmp_path, model, policy_dir):
    """Any tokenizer travels with the weights: the source's files, not the char tokenizer, end up in the copy."""
    source = tmp_path / "source"
    source.mkdir()
    extras = {
        "tokenizer.json": (policy_dir / "tokenizer.json").read_bytes() + b"\n",  # differs from what we would write
        "tokenizer_config.json": b'{"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 77}',
        "chat_template.jinja": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\u00e9{% endfor %}".encode(),
        "added_tokens.json": b'{"<tool>": 98}',
        "vocab.json": b'{"a": 0}',
        "merges.txt": b"#version: 0.2\n",
        "special_tokens_map.json": b'{"eos_token": "<eos>"}',
        "generation_config.json": b'{"eos_token_id": [1, 2], "temperature": 0.6}',
    }
    for name, data in extras.items():
        (source / name).write_bytes(data)
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json", "spec.json"):
        (source / name).write_bytes(b"not to be copied")
    out = tp.save_weights(model, tmp_path / "out", source)
    for name, data in extras.items():
        assert (out / name).read_bytes() == data, name
    assert (out / "config.json").read_bytes() != b"not to be copied"
    assert (out / "model.safetensors").read_bytes() != b"not to be copied"
    assert not (out / "model.safetensors.index.json").exists() and not (out / "spec.json").exists()
    tp.save_weights(model, out, out)  # in place (the warm start): the files stay as they are
    assert (out / "chat_template.jinja").read_bytes() == extras["chat_template.jinja"]


def test_load_model_takes_any_causal_lm_and_pads_with_a_valid_id(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    # No pad token and a list of EOS ids, as Llama 3 ships: padding falls back to the first EOS id.
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=None, eos_token_id=[5, 6])
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    model = tp.load_model(tmp_path / "llama").eval()
    assert type(model).__name__ == "LlamaForCausalLM" and next(model.parameters()).dtype == torch.float32
    assert tp.pad_id(model.config) == 5
    cfg.eos_token_id = None
    assert tp.pad_id(cfg) == 0
    lps = tp.completion_logprobs(model, [[1, 2, 3], [4]], [[7, 8], [9, 10, 11]])
    assert [len(x) for x in lps] == [2, 3] and all(torch.isfinite(x).all() for x in lps)


# --- log-probs and the torch generator --------------------------------------


def _prompts(tokenizer, n):
    return [tokenizer.encode(p.prompt, add_special_tokens=False) for p in calc.make_problems(0, n, "eval")]


def test_completion_logprobs_batched_equals_single_and_has_grad(model, tokenizer):
    prompts = _prompts(tokenizer, 4)
    prompts[1] = prompts[1] + [7, 8, 9]  # uneven lengths exercise the padding
    completions = [[10, 11, 12], [13], [14, 15, 16, 17, 18], [19, 20]]
    batched = tp.completion_logprobs(model, prompts, completions)
    assert [len(x) for x in batched] == [len(c) for c in completions]
    assert batched[0].requires_grad
    for p, c, b in zip(prompts, completions, batched):
        single = tp.completion_logprobs(model, [p], [c])[0]
        assert torch.allclose(single, b, atol=1e-5)


def test_torch_generator_is_batch_invariant_and_logprobs_agree(model, tokenizer):
    gen = tp.TorchGenerator(model, tokenizer)
    requests = _prompts(tokenizer, 6)
    requests[0] = requests[0] + [20, 21, 22, 23]
    seeds = list(range(6))
    batched = gen.generate(requests, greedy=False, seeds=seeds, max_tokens=12, stops=calc.TOOL_STOPS)
    for r, s, out in zip(requests, seeds, batched):
        single = gen.generate([r], greedy=False, seeds=[s], max_tokens=12, stops=calc.TOOL_STOPS)[0]
        assert single.token_ids == out.token_ids
    with torch.no_grad():
        lps = tp.completion_logprobs(model, requests, [o.token_ids for o in batched])
    for out, lp in zip(batched, lps):
        assert torch.allclose(lp, torch.tensor(out.logprobs), atol=1e-4)


def _eos_model(policy_dir, tokenizer):
    """A model whose EOS logit copies the digit '7''s, so EOS is sampled often."""
    model = tp.load_model(policy_dir).eval()
    with torch.no_grad():
        w = model.lm_head.weight
        w[tokenizer.eos_token_id] = w[tokenizer.convert_tokens_to_ids("7")] + 0.5
    return model


def test_torch_generator_keeps_eos_token_out_of_text(policy_dir, tokenizer):
    model = _eos_model(policy_dir, tokenizer)
    outs = tp.TorchGenerator(model, tokenizer).generate(
        _prompts(tokenizer, 32), greedy=False, seeds=list(range(32)), max_tokens=40, stops=calc.TOOL_STOPS
    )
    eos = [o for o in outs if o.finish_reason == "eos"]
    assert eos
    for o in eos:
        assert o.token_ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in o.token_ids[:-1]
        assert o.text == tokenizer.decode(o.token_ids[:-1], skip_special_tokens=True)
        assert len(o.logprobs) == len(o.token_ids)


# --- the episode loop, with a scripted generator ------------------------------


class ScriptedGenerator:
    """Plays the gold demonstration of each prompt, turn by turn (or ``script`` overrides)."""

    def __init__(self, tokenizer, problems, script=None):
        self.tok = tokenizer
        self.turns = {}
        for p in problems:
            gold = calc.demonstration(p, random.Random(0), 0.0)
            self.turns[p.prompt] = (script or {}).get(p.prompt) or _split_turns(gold)
        self.calls = []

    def generate(self, requests, *, greedy, seeds, max_tokens, stops):
        self.calls.append(len(requests))
        outs = []
        for r in requests:
            text = self.tok.decode(r)
            prompt = text[: text.index("\n") + 1]
            turn = self.turns[prompt][text.count(calc.RESULT_CLOSE)]
            ids = self.tok.encode(turn, add_special_tokens=False)[:max_tokens]
            finish = "stop" if turn.endswith(tuple(stops)) and len(ids) == len(turn) else "length"
            outs.append(TurnOutput(ids, [-0.25] * len(ids), self.tok.decode(ids), finish))
        return outs


def _split_turns(gold: str) -> list[str]:
    """The policy's turns of a completion: the text between tool results."""
    turns, rest = [], gold
    while calc.RESULT_OPEN in rest:
        head, rest = rest.split(calc.RESULT_OPEN, 1)
        turns.append(head)
        rest = rest.split(calc.RESULT_CLOSE, 1)[1]
    return turns + [rest]


def _run(gen, tokenizer, problems, **kw):
    args = {"greedy": True, "max_turns": 4, "max_tokens_per_turn": 32, "tool_timeout_s": 2.0, "seed": 0}
    return run_episodes(gen, tokenizer, [(p, 0) for p in problems], **{**args, **kw})


def test_loop_plays_gold_episodes_and_masks_tool_tokens(tokenizer):
    problems = calc.make_problems(0, 5, "eval")
    gen = ScriptedGenerator(tokenizer, problems)
    episodes = _run(gen, tokenizer, problems)
    assert gen.calls == [5, 5, 5]  # all sequences advance together, one call per turn
    for p, ep in zip(problems, episodes):
        assert ep.text == calc.demonstration(p, random.Random(0), 0.0)
        assert calc.verify(p, ep.text) == 1.0
        assert (ep.finish, ep.turns, ep.tool_calls, ep.tool_timeouts) == ("answer", 3, 2, 0)
        assert tokenizer.decode(ep.completion_tokens) == ep.text
        assert len(ep.completion_tokens) == len(ep.completion_mask) == len(ep.logprobs)
        assert ep.completion_mask == calc.tool_span_mask(ep.text)
        assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(ep.logprobs, ep.completion_mask))
        assert len(ep.tool_latency_s) == 2


def test_loop_finishes_on_max_turns_length_and_eos(tokenizer):
    problems = calc.make_problems(0, 3, "eval")
    script = {
        problems[0].prompt: ["<calc>1+1</calc>"] * 5,
        problems[1].prompt: ["1" * 40],
        problems[2].prompt: ["<calc>2*3</calc>", "done"],
    }
    gen = ScriptedGenerator(tokenizer, problems, script)
    episodes = _run(gen, tokenizer, problems, max_turns=3)
    assert [e.finish for e in episodes] == ["max_turns", "length", "length"]
    assert episodes[0].tool_calls == 2 and episodes[0].turns == 3
    assert gen.calls == [3, 2, 1]  # finished sequences drop out


def test_loop_records_tool_timeouts(tokenizer):
    problems = calc.make_problems(0, 4, "eval")
    # the deadline covers the final answer's step too, which does not sleep: at 0.05 s a loaded machine
    # missed it (the answer got a timeout reply and the episode a fourth turn), so 1 s against a 10 s tool
    episodes = _run(ScriptedGenerator(tokenizer, problems), tokenizer, problems, tool_timeout_s=1.0,
                    env=calc.Calculator(tool_delay_s=10.0))
    for ep in episodes:
        assert ep.tool_timeouts == ep.tool_calls == 2
        assert "<result>error</result>" in ep.text
        # a loop that waited for the tool takes its 10 s; one that gave up takes the 1 s deadline and what
        # a loaded machine adds: half the delay tells them apart without a race
        assert all(lat < 5.0 for lat in ep.tool_latency_s)


def test_loop_respects_max_total_tokens(tokenizer):
    problems = calc.make_problems(0, 2, "eval")
    episodes = _run(ScriptedGenerator(tokenizer, problems), tokenizer, problems, max_total_tokens=60)
    assert all(e.finish == "length" for e in episodes)
    assert all(len(e.prompt_tokens) + len(e.completion_tokens) <= 60 for e in episodes)


def test_request_seeds_depend_on_episode_identity_only():
    assert request_seed(1, "p", 0, 0) == request_seed(1, "p", 0, 0)
    assert len({request_seed(1, "p", i, t) for i in range(8) for t in range(4)}) == 32


def test_torch_loop_is_reproducible_per_episode_id(model, tokenizer):
    problems = calc.make_problems(0, 4, "eval")
    gen = tp.TorchGenerator(model, tokenizer)
    kw = {"greedy": False, "max_turns": 3, "max_tokens_per_turn": 16, "tool_timeout_s": 2.0, "seed": 7}
    both = run_episodes(gen, tokenizer, [(p, i) for p in problems for i in range(2)], **kw)
    alone = run_episodes(gen, tokenizer, [(problems[2], 1)], **kw)
    assert alone[0].completion_tokens == both[5].completion_tokens
    assert isinstance(both[0], Episode)


# --- cached build and warm start --------------------------------------------


def test_ensure_policy_caches_by_spec(tmp_path):
    spec = {"warm_steps": 3, "warm_problems": 200, "warm_target_success": None}
    first = tp.ensure_policy(tmp_path, spec)
    said: list[str] = []
    assert tp.ensure_policy(tmp_path, spec, progress=said.append) == first
    assert said == []                         # found in the cache: nothing trained, nothing built
    assert tp.ensure_policy(tmp_path, {**spec, "seed": 1}) != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    with pytest.raises(ValueError, match="unknown"):
        tp.ensure_policy(tmp_path, {"hidden": 3})


def test_builders_with_the_same_pid_on_a_shared_cache_build_apart(tmp_path, monkeypatch):
    """Two builders of one spec at once, with the same pid (containers on a shared cache volume are all pid
    1; here two threads of one process): each builds in its own temp directory, so neither deletes or
    writes into the other's, and both get the one policy. Before, the temp directory was named by pid
    alone, and the second builder removed the first one's half-built directory."""
    import threading

    building, together = [], threading.Barrier(2, timeout=30)

    def build(out_dir, spec, progress):
        building.append(out_dir)
        out_dir.mkdir(parents=True)
        together.wait()   # both builds under way at once
        (out_dir / "spec.json").write_text("{}")

    monkeypatch.setattr(tp, "_build_into", build)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(tp.ensure_policy(tmp_path, {"seed": 3}))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(set(building)) == 2, building
    assert len(got) == 2 and got[0] == got[1] and (got[0] / "spec.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_warm_start_succeeds_sometimes_but_not_mostly(tmp_path):
    # (how long the build takes is a figure `scripts/build_policy.py` prints, ~50 s on an idle 2-core
    # machine, not a test's to assert: a loaded run took longer than the 180 s once held here)
    model_dir = tp.ensure_policy(tmp_path, {})
    tokenizer, model = tp.load_tokenizer(model_dir), tp.load_model(model_dir).eval()
    rate, episodes = evaluate(
        tp.TorchGenerator(model, tokenizer),
        tokenizer,
        calc.make_problems(1, 200, "eval"),
        max_turns=4,
        max_tokens_per_turn=32,
        tool_timeout_s=5.0,
    )
    assert 0.15 <= rate <= 0.6, rate
    assert sum(e.finish == "answer" for e in episodes) >= 150  # the format is learned
