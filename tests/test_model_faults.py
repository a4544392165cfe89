"""Building, checking and talking to a policy: cases that used to go wrong.

The torch reference generator on a BPE stand-in (a token that completes a
stop string and carries more; a character of two byte tokens), the chat
template's own rendering of prompts and replies, a warm start on fewer
tasks than a batch, a sharded policy directory missing a shard, a tiny
policy width vLLM's CPU attention cannot run, and build_policy's seed. No
vLLM engine is started: the pure parts are tested directly.
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from workers import standin
from workers.chat import ChatFormat
from workers.envs import calc, load_env


def _calc_corpus(n: int = 300) -> list[str]:
    return [p.prompt + calc.demonstration(p, random.Random(i), noise=0.0)
            for i, p in enumerate(calc.make_problems(0, n, "train"))]


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = tmp_path_factory.mktemp("review_standins")
    corpus = _calc_corpus()
    return {arch: standin.build_standin(root / arch, arch=arch, corpus=corpus) for arch in ("qwen2", "llama")}


class _Scripted(torch.nn.Module):
    """A causal LM stand-in whose greedy choice is a fixed token script (one token per forward call)."""

    def __init__(self, config, script: list[int]):
        super().__init__()
        self.config = config
        self.script = script
        self.calls = 0
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **_kw):
        tok = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.config.vocab_size), -1e4)
        logits[..., tok] = 0.0
        return SimpleNamespace(logits=logits)


def _scripted_generator(model_dir: Path, text: str):
    from transformers import AutoConfig

    from workers.tiny_policy import TorchGenerator

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    script = tok.encode(text, add_special_tokens=False)
    model = _Scripted(AutoConfig.from_pretrained(str(model_dir)), script)
    return TorchGenerator(model, tok), tok, script


# --- TorchGenerator: the reference rollout loop vLLM is checked against --------------------------------------


def test_torch_generator_stops_on_the_token_that_completes_a_stop_string(standins):
    """The turn ends, finish "stop", on the token that completes "</calc>" while carrying the next "<"
    (as vLLM ends it); the text used to be checked for ending with the stop only, and ran to max_tokens."""
    gen, tok, script = _scripted_generator(standins["qwen2"], "<calc>1+2</calc><result>3</result>")
    pieces = [tok.decode([i]) for i in script]
    assert "><" in pieces, pieces          # the stand-in's BPE merges ">" of the stop with the next "<"
    stop_at = pieces.index("><")
    [out] = gen.generate([tok.encode("Q:1+2\n", add_special_tokens=False)], greedy=True, seeds=None,
                         max_tokens=len(script), stops=calc.TOOL_STOPS)
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    assert out.token_ids == script[:stop_at + 1]


def test_torch_generator_text_is_the_decoded_tokens_for_multibyte_characters(standins):
    """A turn's text is the decoding of its tokens ("café", as the vLLM wrapper gives it), not the
    decodings of each token joined ("caf" and two U+FFFD)."""
    gen, tok, script = _scripted_generator(standins["qwen2"], "café")
    [out] = gen.generate([tok.encode("Q:1+2\n", add_special_tokens=False)], greedy=True, seeds=None,
                         max_tokens=len(script), stops=calc.TOOL_STOPS)
    assert out.token_ids == script
    assert out.text == tok.decode(script) == "café"


# --- chat rendering -----------------------------------------------------------------------------------------


def test_chat_prompt_ids_match_the_chat_template_rendering(standins):
    """The prompt is the template's rendering of the user message with the generation prompt, and a reply
    is what the template appends for it: with Llama 3's template, which trims content, no "\\n" before
    <|eot_id|> (the prompt used to be spliced into a probe rendering untrimmed)."""
    tok = AutoTokenizer.from_pretrained(str(standins["llama"]))
    fmt = ChatFormat.for_tokenizer(tok, "tool")
    prompt = calc.make_problems(0, 1, "train")[0].prompt
    want = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    want_ids = tok.encode(want, add_special_tokens=False)
    got_ids = fmt.prompt_ids(tok, prompt)
    assert tok.decode(got_ids) == want
    assert got_ids == want_ids
    reply = tok.decode(fmt.reply_ids(tok, "42\n", turn_ended_by_eos=False))
    assert "42<|eot_id|>" in reply and "42\n<|eot_id|>" not in reply, reply


# --- warm start of any model ---------------------------------------------------------------------------------


def test_warmstart_batches_with_fewer_tasks_than_a_batch_does_not_hang(standins):
    """A warm start on 5 tasks with batches of 8 yields batches of the 5 (it used to loop forever without
    yielding: no full batch fits)."""
    from workers.warmstart import WarmStart, batches

    tok = AutoTokenizer.from_pretrained(str(standins["qwen2"]))
    env = load_env("calc")
    tasks = env.make_tasks(0, 5, "train")
    stream = batches(env, ChatFormat.for_tokenizer(tok, env.reply_role), tok, tasks, WarmStart(batch_size=8))

    def _alarm(*_):
        raise TimeoutError("batches() produced nothing in 10 s")

    before = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        batch = next(stream)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert len(batch[0]) >= 1


# --- run setup: the policy directory ------------------------------------------------------------------------


def test_check_policy_dir_refuses_a_sharded_directory_missing_a_shard(tmp_path):
    """A policy directory whose index names two shards and holds one (a copy cut short) is refused naming
    the missing shard, before anything starts (any *.safetensors used to be enough)."""
    from pipeline.run import RunFailed, check_policy_dir

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}))
    save_file({"a.weight": torch.zeros(2)}, str(tmp_path / shards[0]))
    with pytest.raises(RunFailed, match="00002"):
        check_policy_dir(tmp_path)


def test_a_policy_hidden_size_the_config_accepts_builds_a_model_the_cpu_engine_can_run(tmp_path, monkeypatch):
    """``policy.hidden_size = 64`` builds a policy whose head size vLLM's CPU attention runs (heads of 32;
    it used to keep 4 heads, head_dim 16, and every engine failed after the build and warm start)."""
    from pipeline import config as config_mod
    from pipeline.run import policy_spec
    from workers import tiny_policy as tp

    try:
        cfg = config_mod.load(None, ["policy.hidden_size=64"])
    except config_mod.ConfigError:
        return                                           # refused up front: fine
    monkeypatch.setattr(tp, "warm_start", lambda model_dir, **_kw: Path(model_dir))   # the layout only
    model_dir = tp.ensure_policy(tmp_path, policy_spec(cfg))
    conf = json.loads((model_dir / "config.json").read_text())
    head_dim = conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"]
    # vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes() (vllm 0.32;
    # importing vllm here would take ~30 s)
    assert head_dim in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512), head_dim


def test_build_policy_script_keeps_the_seed_given_in_spec(tmp_path, monkeypatch, capsys):
    """``build_policy.py --spec '{"seed": 5}'`` builds seed 5 (the default --seed 0 used to overwrite it)."""
    import importlib.util

    from workers import tiny_policy as tp

    spec_ = importlib.util.spec_from_file_location("review_build_policy", Path("scripts/build_policy.py").resolve())
    script = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(script)
    seen = []
    monkeypatch.setattr(tp, "ensure_policy", lambda cache_dir, spec, progress=None: seen.append(spec) or tmp_path)
    try:
        script.main(["--cache-dir", str(tmp_path), "--spec", '{"seed": 5}'])
    except SystemExit:
        return                                           # refused: fine
    assert seen and seen[0]["seed"] == 5, seen


@pytest.mark.parametrize("setting, says", [("rollout.max_model_len=512", "max_position_embeddings"),
                                           ('env.chat_template="on"', "no chat template")])
def test_settings_the_policy_cannot_serve_are_refused_before_any_worker_starts(tmp_path, setting, says):
    """A context longer than the policy's positions, or ``env.chat_template = "on"`` for a tokenizer with no
    template, is refused when the policy is prepared, not by every rollout worker's engine after its start
    (the crash loop then stopped the run much later)."""
    from pipeline import config as config_mod
    from pipeline.run import RunFailed, check_policy_fits

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 256}))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    check_policy_fits(config_mod.load(None, []), tmp_path)     # the defaults fit
    with pytest.raises(RunFailed, match=says):
        check_policy_fits(config_mod.load(None, [setting]), tmp_path)


def test_torch_generator_ends_a_turn_on_generation_configs_end_ids_as_vllm_does(standins):
    """A policy whose generation_config lists more end ids than the tokenizer's EOS (Llama 3.1's <|eom_id|>,
    Qwen2.5's <|endoftext|>): the reference generator ends the turn, finish "eos", on any of them, as vLLM
    does; it used to stop on the tokenizer's EOS alone and run on past them."""
    from workers.tiny_policy import TorchGenerator

    first, tok, script = _scripted_generator(standins["qwen2"], "12345")
    model = first.model
    model.generation_config = SimpleNamespace(eos_token_id=[tok.eos_token_id, script[2]])
    gen = TorchGenerator(model, tok)
    [out] = gen.generate([tok.encode("Q:1+2\n", add_special_tokens=False)], greedy=True, seeds=None,
                         max_tokens=len(script), stops=calc.TOOL_STOPS)
    assert (out.finish_reason, out.token_ids) == ("eos", script[:3])
