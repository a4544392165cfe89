"""Stand-in models: both families load in transformers and in vLLM, and behave like their family.

Fast tests build each stand-in once per module (~0.1 s each) and check the
files through transformers' Auto classes, as a user's code would load them.
The slow test starts one in-process vLLM engine per family (~30 s each on 2
cores) and checks its greedy tokens and log-probs against a torch argmax loop.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM

from workers import standin
from workers.envs import calc

ARCHS = ("qwen2", "llama")
MODEL_CLASS = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}
# Text the corpus never shows: accents, a currency sign, an emoji, tabs, CRLF.
UNSEEN = ("é€", "naïve café ☕ 😀", "tab\there\r\nand  two  spaces ", "\n\nQ:(1+2)*3\n", "")
USER = [{"role": "user", "content": "Q:(17*23)+45\n"}]
# vLLM's and torch's float32 kernels differ by ~1e-6 in a log-prob; see test_engine_vllm.
MAX_ABS_DLOGP = 1e-3


def _corpus(n: int = 500) -> list[str]:
    return [p.prompt + calc.demonstration(p, random.Random(i), noise=0.0) for i, p in enumerate(calc.make_problems(0, n, "train"))]


@pytest.fixture(scope="module")
def corpus():
    return _corpus()


@pytest.fixture(scope="module")
def standins(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("standins")
    return {arch: standin.build_standin(root / arch, arch=arch, corpus=corpus) for arch in ARCHS}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def tokenizer(standins, arch):
    return AutoTokenizer.from_pretrained(str(standins[arch]))


def test_loads_with_auto_classes_and_ids_agree(standins, arch, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(str(standins[arch]))
    assert type(model) is MODEL_CLASS[arch]
    assert model.dtype == torch.float32 and not model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer) > 256 + len(standin.FAMILIES[arch].specials)
    family = standin.FAMILIES[arch]
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (family.eos, family.pad, family.bos)
    for cfg in (model.config, model.generation_config):
        assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id)
    saved = json.loads((standins[arch] / "generation_config.json").read_text())
    assert not {"do_sample", "temperature", "top_p", "top_k", "repetition_penalty"} & saved.keys()


def test_any_text_round_trips(tokenizer):
    for text in UNSEEN:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


def test_bos_only_where_the_family_adds_it(tokenizer, arch):
    ids = tokenizer.encode("hi")
    if arch == "llama":
        assert ids[0] == tokenizer.bos_token_id and ids[1:] == tokenizer.encode("hi", add_special_tokens=False)
    else:
        assert tokenizer.bos_token_id is None and ids == tokenizer.encode("hi", add_special_tokens=False)


def test_reloaded_tokenizer_encodes_as_trained(tokenizer, arch, corpus):
    """transformers rebuilds a qwen2 tokenizer's pipeline on load: it must be the one trained."""
    trained = standin.train_tokenizer(standin.FAMILIES[arch], corpus, 512, 512)
    for text in [*corpus[:20], *UNSEEN]:
        assert tokenizer.encode(text) == trained.encode(text)


def test_task_text_has_multi_character_tokens(tokenizer):
    for text in ("</calc>", "<result>", "</answer>"):
        assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text)


def test_chat_template_renders_a_generation_prompt(tokenizer, arch):
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    end = {"qwen2": "<|im_start|>assistant\n", "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[arch]
    assert text.endswith(end) and USER[0]["content"].strip() in text
    ids = tokenizer.apply_chat_template(USER, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # every special token is one id, and spelled back
    without = tokenizer.apply_chat_template(USER, add_generation_prompt=False, tokenize=False)
    assert text.startswith(without) and not without.endswith(end)


def test_forward_runs(standins, arch, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(str(standins[arch])).eval()
    ids = torch.tensor([tokenizer.apply_chat_template(USER, add_generation_prompt=True, return_dict=False)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_same_arguments_same_files(tmp_path, corpus, arch):
    a = standin.build_standin(tmp_path / "a", arch=arch, corpus=corpus, seed=3)
    b = standin.build_standin(tmp_path / "b", arch=arch, corpus=corpus, seed=3)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and "model.safetensors" in files
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def _torch_greedy(model, prompt: list[int], max_tokens: int, eos_id: int) -> tuple[list[int], list[float]]:
    """Argmax decoding with each chosen token's log-prob; stops after EOS, as vLLM does."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
            tok = int(logp.argmax())
            ids.append(tok)
            logprobs.append(float(logp[tok]))
            if tok == eos_id:
                break
    return ids[len(prompt) :], logprobs


@pytest.mark.slow
def test_vllm_greedy_matches_torch(standins, arch, tokenizer):
    pytest.importorskip("vllm")
    from workers.engine_vllm import VLLMEngine

    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True, return_dict=False)
        for p in calc.make_problems(1, 4, "eval")
    ]
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it in its process
    engine = VLLMEngine(standins[arch], seed=0, in_process=True, threads=1)
    try:
        outs = engine.generate(prompts, greedy=True, seeds=None, max_tokens=12, stops=[])
    finally:
        del engine
        torch.set_num_threads = set_num_threads
    model = AutoModelForCausalLM.from_pretrained(str(standins[arch])).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logprobs = _torch_greedy(model, prompt, 12, tokenizer.eos_token_id)
        assert out.token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < MAX_ABS_DLOGP
