"""The reward worker, the reward-model path and the model builders (tiny policy, stand-ins, warm start) under
faults: what a reward raises is its sample's failure (never the worker's end, never an endless back-off), a
reward model reads the text as it was trained to, and a failed build leaves nothing that looks built.

Models are built as small as the builders allow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.dataplane import messages
from pipeline.dataplane.streams import Reject
from workers.envs.base import Task


def _group(texts=("answer: 3", "answer: 4")) -> messages.Group:
    z = np.zeros(1, dtype=np.int32)
    trajs = tuple(messages.Trajectory(sample_idx=i, completion=z + 5, mask=z.astype(np.uint8) + 1,
                                      logprobs=z.astype(np.float32), text=t, finish="stop", turns=1, tool_calls=0,
                                      tool_latency_s=(), tool_timeouts=0) for i, t in enumerate(texts))
    return messages.Group(prompt_id="p@0", prompt="q", answer=3, prompt_tokens=z, version=0, worker="w",
                          generated_at=0.0, gen_s=0.0, trajectories=trajs)


# --- what a reward raises ------------------------------------------------------------------------------------


def test_a_reward_value_error_quoting_the_transcript_is_dead_lettered_not_taken_for_the_workers_oom():
    """A judge that reads the number after the last colon fails on a transcript ending "out of memory" (a
    coding task's tool output, say): ValueError("could not convert string to float: ' out of memory'"). That
    is the sample's failure, dead-lettered after its retries. Before, is_oom's text match took it for the
    worker's own memory: score_group re-raised it and the reward worker exited, as did every worker the
    group was reclaimed by."""
    from workers.reward import score_group

    def judge(task, transcript):
        return float(transcript.rsplit(":", 1)[-1])

    try:
        out = score_group(_group(("answer: 3", "answer: out of memory")), retries=0, reward=judge, timeout_s=5.0)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"score_group raised (the reward worker exits as oom): {type(exc).__name__}: {exc}")
    assert isinstance(out, Reject) and "could not convert" in out.reason




def test_an_allocation_failure_the_transcript_does_not_quote_is_still_the_workers_oom():
    """The text match stays for what the process itself ran out of: a reward model's "CUDA out of memory"
    RuntimeError on a transcript that says nothing of memory ends the worker as ``oom``."""
    from workers.reward import score_group

    def model_on_a_full_gpu(task, transcript):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        score_group(_group(), retries=2, reward=model_on_a_full_gpu, timeout_s=5.0)


def test_a_reward_that_raises_system_exit_is_dead_lettered_not_the_end_of_the_worker():
    """A verifier that wraps a command line's main() raises SystemExit; it comes back through the pool's
    future and is the sample's failure like any other: the group is dead-lettered naming it. Before, it
    escaped score_group's ``except Exception`` and the reward worker exited (code 0 here)."""
    from workers.reward import score_group

    def cli_verifier(task, transcript):
        raise SystemExit(0)

    try:
        out = score_group(_group(), retries=0, reward=cli_verifier, timeout_s=5.0)
    except BaseException as exc:  # noqa: BLE001
        pytest.fail(f"score_group let {type(exc).__name__}({exc}) through: the reward worker exits")
    assert isinstance(out, Reject) and "SystemExit" in out.reason




def test_reward_retry_backoff_is_capped(monkeypatch):
    """The pause between tries of a failing reward doubles up to 1 s, as the tool retries' does. Before, it
    doubled without a cap: with verifier_retries = 12 one failing sample slept 102 s before its last try and
    ~205 s in all, and a read of 16 groups held the stage ~55 min while a judge was down."""
    from workers import reward as reward_mod

    slept: list[float] = []
    monkeypatch.setattr(reward_mod.time, "sleep", lambda s: slept.append(s))

    def down(task, transcript):
        raise ConnectionError("judge down")

    out = reward_mod.score_group(_group(("x",)), retries=12, reward=down, timeout_s=5.0)
    assert isinstance(out, Reject)
    assert max(slept) <= 1.0, f"back-off of {max(slept):g}s before one retry ({sum(slept):g}s for one sample)"




def _encoder_reward_model(root, model_type: str, max_position_embeddings: int):
    """A tiny BERT-tokenizer sequence-classification directory (num_labels = 1) of ``model_type``."""
    from transformers import (BertConfig, BertForSequenceClassification, BertTokenizerFast, RobertaConfig,
                              RobertaForSequenceClassification)

    root.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghijklmnopqrstuvwxyz0123456789:?")
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # as real encoder checkpoints: the tokenizer's limit (512) below RoBERTa's position table (514)
    tok = BertTokenizerFast(vocab_file=str(root / "vocab.txt"), model_max_length=32)
    dims = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, num_labels=1, max_position_embeddings=max_position_embeddings)
    torch.manual_seed(0)
    if model_type == "bert":
        model = BertForSequenceClassification(BertConfig(**dims))
    else:
        model = RobertaForSequenceClassification(RobertaConfig(pad_token_id=0, **dims))
    model.eval().save_pretrained(str(root))
    tok.save_pretrained(str(root))
    return model, tok


def test_reward_model_scores_the_text_as_its_tokenizer_encodes_it(tmp_path):
    """The reward is the model's own score for the prompt followed by the transcript, encoded with the
    tokenizer's special tokens. Before, the text was encoded with add_special_tokens=False, so an encoder
    reward model (BERT, DeBERTa, ELECTRA, RoBERTa pool the [CLS] token at position 0) pooled the first word
    instead, and a Llama-style one lost its BOS: 0.0180 where the model scores the text 0.0093."""
    from workers.reward_model import RewardModel

    model, tok = _encoder_reward_model(tmp_path / "bert", "bert", 64)
    with torch.no_grad():
        want = float(model(**tok("q:" + "a b c", return_tensors="pt")).logits[0, 0])
    got = RewardModel(tmp_path / "bert", device="cpu")(Task("t", "q:", None), "a b c")
    assert got == pytest.approx(want, abs=1e-5), f"RewardModel scored {got}, the model scores the text {want}"


def test_reward_model_scores_a_long_transcript_of_a_roberta_family_model(tmp_path):
    """A transcript longer than the model reads is cut from the front to the tokenizer's stated limit.
    Before, the limit was config.max_position_embeddings, and RoBERTa-family models (RoBERTa, XLM-R,
    CamemBERT, Longformer) use 2 entries fewer (514 -> 512, as their tokenizer says): any longer transcript
    raised "index 34 is out of bounds", and every group with a long episode was dead-lettered."""
    from workers.reward_model import RewardModel

    _encoder_reward_model(tmp_path / "roberta", "roberta", 34)
    score = RewardModel(tmp_path / "roberta", device="cpu")
    try:
        value = score(Task("t", "q:", None), "a " * 60)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"a 121-character transcript cannot be scored: {type(exc).__name__}: {exc}")
    assert np.isfinite(value)




def test_a_warm_start_that_fails_while_saving_leaves_no_directory_that_looks_built(tmp_path, monkeypatch):
    """A warm start that fails while saving (a full disk, a kill) leaves no out_dir: it is built in a
    temporary sibling and renamed whole. Before, it saved in place (config.json and weights, then the
    tokenizer files), and scripts/demo_own_model, which builds only when .cache/standins/llama-guess/
    config.json is missing, then ran every later demo on the broken directory."""
    from workers import standin, tiny_policy, warmstart
    from workers.envs import load_env

    env = load_env("guess")
    src = standin.build_standin(tmp_path / "llama", arch="llama", corpus=["Guess 1-32\n<g>16</g><f>up 17-32</f>"] * 20,
                                vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                intermediate_size=64, max_position_embeddings=128)
    out = tmp_path / "llama-guess"
    ws = warmstart.WarmStart(max_steps=1, batch_size=2, eval_every=1, eval_size=1, target=None,
                             max_tokens_per_turn=2, max_turns=1)

    def disk_full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tiny_policy.shutil, "copyfile", disk_full)
    with pytest.raises(OSError):
        warmstart.warm_start(src, out, env, train=env.make_tasks(0, 4, "train"),
                             held_out=env.make_tasks(0, 1, "eval"), ws=ws)
    assert not (out / "config.json").exists(), \
        f"a failed warm start left {sorted(p.name for p in out.iterdir())}: it looks built"




def test_ensure_policy_with_too_few_warm_problems_is_refused_naming_the_setting(tmp_path):
    """warm_problems (build_policy.py --spec) too few for the warm start's 100 held-back check problems and
    a batch is refused up front, naming the key and the least value. Before, the build failed deep inside
    with "Sample larger than population or is negative", naming nothing the user set."""
    from workers import tiny_policy

    spec = {"warm_problems": 100, "warm_steps": 1, "warm_target_success": None, "hidden_size": 64,
            "num_heads": 2, "num_kv_heads": 1, "num_layers": 1, "intermediate_size": 64}
    with pytest.raises(ValueError, match="warm_problems = 100: .* use at least 116"):
        tiny_policy.ensure_policy(tmp_path / "cache", spec)
    assert not list((tmp_path / "cache").glob(".policy-*"))


def test_a_rebuilt_directory_replaces_the_old_one_whole(tmp_path):
    """built_whole puts a finished build at its name in one rename, replacing an older one; a failed build
    leaves the older one as it was."""
    from workers.tiny_policy import built_whole

    final = tmp_path / "model"
    with built_whole(final) as d:
        (d / "config.json").write_text("v1")
    with pytest.raises(OSError):
        with built_whole(final) as d:
            (d / "config.json").write_text("half")
            raise OSError(28, "No space left on device")
    assert (final / "config.json").read_text() == "v1"
    with built_whole(final) as d:
        (d / "config.json").write_text("v2")
    assert (final / "config.json").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]   # no temporary or old copy left


@pytest.mark.parametrize("field", ["warmup_steps", "eval_every", "batch_size"])
def test_a_warm_start_setting_below_one_is_refused_naming_it(field):
    """WarmStart refuses a count below 1, naming it. Before, warmup_steps = 0 or eval_every = 0 ended the warm
    start in a ZeroDivisionError after its first evaluation."""
    from workers.warmstart import WarmStart

    with pytest.raises(ValueError, match=f"WarmStart {field} = 0"):
        WarmStart(**{field: 0})
