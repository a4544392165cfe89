"""Stand-in Hugging Face models: real architectures and tokenizers, untrained weights.

No real checkpoint can be downloaded here, so code that must handle a model
of a real family (a BPE tokenizer whose tokens span several characters, a
chat template, special tokens, vLLM's loader for that architecture) is
exercised on a stand-in: a small, freshly initialised ``Qwen2ForCausalLM`` or
``LlamaForCausalLM`` with a byte-level BPE tokenizer trained on the task's own
text and the family's chat format. Who calls it: the tests,
``scripts/build_standins.py`` and the README's own-model example build
stand-ins with it (``build_standin``, in the calling process).

The tokenizer's pipeline is the family's: Qwen2's NFC normaliser and
pre-tokenizer regex (one digit per pre-token) and Llama-3's regex (up to three
digits), each followed by byte-level encoding without its own regex, and a
byte-level decoder. Qwen2's must be exactly that: transformers (and so vLLM)
loads any qwen2 directory's tokenizer as ``Qwen2Tokenizer``, which rebuilds
that pipeline around the saved vocabulary and merges. Every byte is in the
initial alphabet, so any text encodes and ``decode(encode(s)) == s`` for
NFC-normalised ``s``. As in Llama 3, the llama tokenizer prepends BOS when
``add_special_tokens`` is true and its chat template starts with BOS.

Everything written depends only on the arguments, ``corpus`` order included:
the BPE trainer is deterministic (the files are byte-identical across
processes and thread counts) and the weights are drawn under a forked torch
RNG seeded with ``seed``, leaving the caller's RNG as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from workers.tiny_policy import built_whole

# Pre-tokenizer regexes of the real families (transformers' Qwen2Tokenizer;
# Meta-Llama-3's tokenizer.json): they differ in how digits group.
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# ChatML, as Qwen2 writes it (without the default system prompt): every turn
# is <|im_start|>role\n...<|im_end|>\n.
QWEN2_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Llama 3.1's header format: BOS, then per turn a role header, the trimmed
# content and <|eot_id|>; tool results take Llama 3.1's role name "ipython".
LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool', 'ipython'] -%}"
    "{{- raise_exception('unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class Family:
    split: str
    specials: tuple[str, ...]  # ids 0.. in this order
    bos: str | None
    eos: str  # ends an assistant turn, as in the family's instruct models
    pad: str
    chat_template: str
    nfc: bool  # Qwen2Tokenizer normalises to NFC; Llama 3 does not normalise
    config_cls: type
    model_cls: type


FAMILIES: dict[str, Family] = {
    "qwen2": Family(
        split=QWEN2_SPLIT,
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=QWEN2_TEMPLATE,
        nfc=True,
        config_cls=Qwen2Config,
        model_cls=Qwen2ForCausalLM,
    ),
    "llama": Family(
        split=LLAMA3_SPLIT,
        specials=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        chat_template=LLAMA3_TEMPLATE,
        nfc=False,
        config_cls=LlamaConfig,
        model_cls=LlamaForCausalLM,
    ),
}


def train_tokenizer(family: Family, corpus: list[str], vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``vocab_size`` tokens (specials included) trained on ``corpus``.

    Fewer when the corpus runs out of pairs to merge: BPE never merges across
    pre-tokens, and Qwen2's regex makes every digit its own pre-token.
    """
    tok = Tokenizer(models.BPE())
    if family.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(family.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if family.bos is not None:
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos}:0 $A:0",
            pair=f"{family.bos}:0 $A:0 {family.bos}:1 $B:1",
            special_tokens=[(family.bos, bos_id)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        chat_template=family.chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def _fresh_model(family: Family, tokenizer, seed: int, **dims):
    config = family.config_cls(
        vocab_size=len(tokenizer),
        # Untied head: vLLM's in-place reload then maps every tensor by name.
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **dims,
    )
    with torch.random.fork_rng(devices=[]):  # seeded weights without touching the caller's RNG
        torch.manual_seed(seed)
        model = family.model_cls(config).to(torch.float32)
    # Only token ids: generation_config.json must carry no sampling defaults, vLLM would apply them.
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(config, name))
    return model


def build_standin(
    out_dir: str | Path,
    *,
    arch: str,
    corpus: list[str],
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Write a stand-in model directory of family ``arch`` ("qwen2" or "llama") into ``out_dir``.

    ``vocab_size`` bounds the tokenizer's size, counting the specials and the
    256 byte tokens; the BPE learns the rest from ``corpus`` (see
    ``train_tokenizer``) and the model's vocabulary is the tokenizer's.
    """
    if arch not in FAMILIES:
        raise ValueError(f"arch must be one of {sorted(FAMILIES)}, got {arch!r}")
    family = FAMILIES[arch]
    if vocab_size <= 256 + len(family.specials):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges: use more than {256 + len(family.specials)}")
    tokenizer = train_tokenizer(family, corpus, vocab_size, max_position_embeddings)
    model = _fresh_model(
        family,
        tokenizer,
        seed,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
    )
    hf_logging.disable_progress_bar()
    with built_whole(out_dir) as tmp:   # whole or not at all: scripts test for config.json
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
    return Path(out_dir)
