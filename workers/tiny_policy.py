"""The policy's files and log-probs: any Hugging Face causal LM, and the tiny Qwen2 we build.

Who calls it: ``scripts/build_policy.py`` and the run setup (``ensure_policy``),
the learner process (``load_model``, ``completion_logprobs``, ``save_weights``)
and tests (``TorchGenerator``, ``greedy_episodes``: a pure-torch reference of
the rollout loop that vLLM must match).

``load_model``, ``save_weights`` and ``completion_logprobs`` work on any
``AutoModelForCausalLM`` directory; ``save_weights`` copies the source
directory's tokenizer files byte for byte, so a published or checkpointed
directory tokenizes exactly as the policy the run started from.

The tiny policy's directory holds config.json, generation_config.json,
model.safetensors (float32, HF parameter names) and the tokenizer files, and
loads in transformers and in vLLM. Its tokenizer maps every printable ASCII
character, space and newline to one token, so ``decode(encode(s)) == s`` and
one character of the task is one action (the episode loop and the warm start
rely on that: a character mask is a token mask).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import string
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.utils import logging as hf_logging

from pipeline.dataplane.lifeline import pid_alive
from workers.episode import Episode, TurnOutput, demonstration_episode, evaluate
from workers.chat import ChatFormat
from workers.envs import load_env
from workers.envs.base import Task

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = (PAD, EOS, UNK)  # ids 0, 1, 2
ALPHABET = "\n" + "".join(c for c in string.printable if c not in string.whitespace) + " "
# Bump when the model or tokenizer layout changes, so cached policies rebuild.
FORMAT_VERSION = 3

# The warm start's environment: the built-in toy is calibrated on the calculator (reached by name).
WARM_ENV = "calc"
CHECK_PROBLEMS = 100   # train problems the warm start holds back to check greedy success

# Defaults of ensure_policy's spec, calibrated (see the test and the report)
# so that the warm start succeeds sometimes and GRPO has room to improve.
DEFAULT_SPEC: dict = {
    "format": FORMAT_VERSION,
    "seed": 0,
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 256,
    "warm_steps": 700,
    "warm_lr": 1e-3,
    "warm_noise": 0.5,
    "warm_batch_size": 16,
    "warm_target_success": 0.3,
    "warm_problems": 4096,
}

Progress = Callable[[str], None]


# --- tokenizer ------------------------------------------------------------


def build_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE with no merges over ``ALPHABET``: one token per character.

    It is a ``Qwen2Tokenizer`` because transformers (and so vLLM) loads every
    qwen2 model's tokenizer as one, rebuilding its byte-level pipeline around
    the saved vocabulary; a tokenizer of any other shape (say WordLevel) would
    be silently re-interpreted and lose newlines and spaces. Characters
    outside the alphabet encode to nothing.
    """
    byte_symbol = bytes_to_unicode()  # byte-level spelling: "\n" is "Ċ", " " is "Ġ"
    vocab = {tok: i for i, tok in enumerate(list(SPECIALS) + [byte_symbol[ord(c)] for c in ALPHABET])}
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=UNK, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False)


def load_tokenizer(model_dir: str | Path):
    return AutoTokenizer.from_pretrained(str(model_dir))


# --- model files ----------------------------------------------------------


def build_policy(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
) -> Path:
    """Write a freshly initialised model directory; the weights depend only on the arguments."""
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        # Untied head: vLLM's in-place reload then maps every tensor by name.
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):   # seeded weights, the caller's RNG left as it was
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    # generation_config.json must carry no sampling defaults: vLLM would apply them.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = save_weights(model, out_dir, None)
    tokenizer.save_pretrained(str(out))
    return out


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """Any Hugging Face causal LM directory, on the CPU, in ``dtype`` (the learner's master weights: float32)."""
    hf_logging.disable_progress_bar()  # one bar per load would flood worker logs
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(dtype)


# Files of a model directory that save_pretrained writes from the model itself;
# everything else (tokenizer, chat template, generation config) is the source's.
_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
# spec.json describes how the tiny policy's initial weights were built, not these weights.
_NOT_COPIED = {"config.json", "spec.json"}


def tokenizer_files(source_dir: str | Path) -> list[Path]:
    """The files of a model directory that are not weights, config or index: what ``save_weights`` copies."""
    return sorted(p for p in Path(source_dir).iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name not in _NOT_COPIED
                  and not p.name.endswith(_MODEL_SUFFIXES))


def save_weights(model, out_dir: str | Path, source_dir: str | Path | None) -> Path:
    """Write a complete model directory into ``out_dir``: weights and config, and ``source_dir``'s tokenizer files.

    ``source_dir`` is the directory the model was loaded from (the run's
    initial policy, or a checkpoint that carries its files); its tokenizer,
    chat template and generation config are copied byte for byte, over
    what save_pretrained wrote, so every version tokenizes and stops as the
    original did. None writes weights and config only (``build_policy``
    writes its own tokenizer). Files are overwritten in place; a publisher
    that readers watch should write to a fresh directory and rename it, so
    nobody loads half a checkpoint.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    # safetensors copies device tensors to the host: the files load on a CPU-only machine.
    model.save_pretrained(str(out), safe_serialization=True)
    if source_dir is not None and Path(source_dir).resolve() != out.resolve():
        for f in tokenizer_files(source_dir):
            shutil.copyfile(f, out / f.name)
    return out


# --- log-probs ------------------------------------------------------------


def _right_padded(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
    return ids


def pad_id(config) -> int:
    """A token id that exists in any vocabulary: the pad token, else the (first) EOS token, else 0."""
    vocab = getattr(config, "vocab_size", None)
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None and 0 <= value and (vocab is None or value < vocab):
            return int(value)
    return 0


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits from its final hidden states, as its own forward computes them.

    Some architectures post-process the LM head's output; the ones we know
    are applied here, and ``_check_head`` refuses a model whose forward
    still disagrees, rather than train on wrong log-probs.
    """
    logits = model.get_output_embeddings()(hidden)
    config = model.config
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    if getattr(model, "logit_scale", None) is not None:  # Cohere: a float attribute of the model
        logits = logits * model.logit_scale
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 and later
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _check_head(model) -> None:
    """Once per model: do base model + ``head_logits`` reproduce the model's forward on a short probe?"""
    if getattr(model, "_libra_head_checked", False):
        return
    device = next(model.parameters()).device
    ids = torch.arange(8, device=device)[None] % model.config.vocab_size
    was_training = model.training
    model.eval()  # dropout would make the two forwards differ
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            full = model(input_ids=ids, use_cache=False).logits.float()
            ours = head_logits(model, model.base_model(input_ids=ids, use_cache=False).last_hidden_state).float()
    finally:
        model.train(was_training)
    gap = float((full - ours).abs().max())
    if gap > 1e-4 * max(1.0, float(full.abs().max())):
        raise ValueError(f"{type(model).__name__}: logits from the final hidden states differ from the model's "
                         f"forward by {gap:.3g}; workers.tiny_policy.head_logits must learn this architecture's "
                         "logit post-processing before the learner can train it")
    model._libra_head_checked = True


def _token_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(target) for rows of final hidden states (N, H) -> (N,), float32."""
    logits = head_logits(model, hidden).float() / temperature  # (N, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _token_logprobs_entropy(model, hidden: torch.Tensor, targets: torch.Tensor,
                            temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``_token_logprobs`` and the entropy of each row's whole distribution (N,), without grad."""
    logp_all = torch.log_softmax(head_logits(model, hidden).float() / temperature, dim=-1)  # (N, V)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


def completion_logprobs(model, prompts: list[list[int]], completions: list[list[int]], *,
                        temperature: float = 1.0, chunk_tokens: int | None = None, entropy: bool = False):
    """Log-prob of each completion token given all tokens before it, with grad.

    Right padding needs no attention mask: pads come after every real token,
    so causal attention already hides them, and positions are 0..len-1 as in
    the rollout engine. The model runs once to its final hidden states; the
    LM head, the ``1 / temperature`` scaling (vLLM's processed log-probs at
    that temperature) and the log-softmax then run only on the positions
    that predict a completion token, ``chunk_tokens`` positions at a time
    (None: all at once). With grad, each chunk's logits are recomputed in
    the backward pass instead of kept, so memory holds one chunk x vocab,
    never batch x length x vocab. Returns one float32 tensor of
    len(completion) per row, on the model's device; with ``entropy``, also
    the entropy (nats, no grad) of the policy's distribution at each of those
    positions, as a second list.
    """
    _check_head(model)
    device = next(model.parameters()).device
    seqs = [p + c for p, c in zip(prompts, completions)]
    ids = _right_padded(seqs, pad_id=pad_id(model.config)).to(device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    hidden = model.base_model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state  # (B, T, H)
    # Position len(p) - 1 + j predicts completion token j.
    rows = torch.cat([torch.full((len(c),), b, dtype=torch.long) for b, c in enumerate(completions)]).to(device)
    cols = torch.cat([torch.arange(len(p) - 1, len(p) - 1 + len(c)) for p, c in zip(prompts, completions)]).to(device)
    picked, targets = hidden[rows, cols], ids[rows, cols + 1]  # (N, H), (N,)
    step = chunk_tokens or max(1, len(targets))
    recompute = torch.is_grad_enabled() and picked.requires_grad
    fn = _token_logprobs_entropy if entropy else _token_logprobs
    parts = []
    for i in range(0, len(targets), step):
        h, t = picked[i:i + step], targets[i:i + step]
        if recompute:
            parts.append(checkpoint(fn, model, h, t, temperature, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(fn(model, h, t, temperature))
    sizes = [len(c) for c in completions]
    empty = hidden.new_zeros(0, dtype=torch.float32)
    if not entropy:
        return list((torch.cat(parts) if parts else empty).split(sizes))
    logp = torch.cat([p[0] for p in parts]) if parts else empty
    ent = torch.cat([p[1] for p in parts]) if parts else empty
    return list(logp.split(sizes)), list(ent.split(sizes))


# --- torch reference generator ---------------------------------------------


class TorchGenerator:
    """A ``Generator`` on a torch model: left-padded batches and a KV cache.

    It is the reference vLLM is checked against, and a sampler for torch-only
    experiments. A turn's text is the decoding of its tokens (as
    ``engine_vllm._turn_output`` makes it: a character of several byte-level
    tokens is whole), and a turn ends on exactly the token whose text first
    holds a stop string, as in vLLM, even where that token carries more
    characters after it (``"><"`` completing ``"</calc>"``).
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 512):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        # the end-of-turn ids vLLM stops on: the tokenizer's EOS and generation_config's (a list for
        # Llama 3.1's <|eom_id|>, Qwen2.5's <|endoftext|>)
        extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = {i for i in [tokenizer.eos_token_id, *(extra if isinstance(extra, (list, tuple)) else [extra])]
                        if i is not None}
        self.pad_id = pad_id(model.config)

    def generate(self, requests, *, greedy, seeds, max_tokens, stops) -> list[TurnOutput]:
        outs: list[TurnOutput] = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start : start + self.batch_size]
            chunk_seeds = None if seeds is None else seeds[start : start + self.batch_size]
            outs.extend(self._generate_batch(chunk, greedy, chunk_seeds, max_tokens, tuple(stops)))
        return outs

    def _prefill(self, requests: list[list[int]]):
        width = max(len(r) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, r in enumerate(requests):
            ids[row, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[row, width - len(r) :] = 1
        # Left padding: each row's first real token is at position 0.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        return out.logits[:, -1], mask, positions[:, -1] + 1, cache

    def _pick(self, logp: torch.Tensor, greedy: bool, gens: list[torch.Generator] | None) -> torch.Tensor:
        if greedy:
            return logp.argmax(-1)
        probs = logp.exp()
        if gens is None:
            return torch.multinomial(probs, 1).squeeze(-1)
        return torch.cat([torch.multinomial(probs[row], 1, generator=g) for row, g in enumerate(gens)])

    @torch.no_grad()
    def _generate_batch(self, requests, greedy, seeds, max_tokens, stops) -> list[TurnOutput]:
        gens = None if seeds is None else [torch.Generator().manual_seed(s) for s in seeds]
        logits, mask, next_pos, cache = self._prefill(requests)
        outs = [TurnOutput([], [], "", "") for _ in requests]
        for step in range(max_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            tokens = self._pick(logp, greedy, gens)
            chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
            for row, out in enumerate(outs):
                if not out.finish_reason:
                    self._extend(out, int(tokens[row]), float(chosen[row]), stops)
            if all(o.finish_reason for o in outs) or step == max_tokens - 1:
                break
            mask = torch.cat([mask, mask.new_ones((len(requests), 1))], dim=1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits, next_pos = out.logits[:, -1], next_pos + 1
        for out in outs:
            out.finish_reason = out.finish_reason or "length"
        return outs

    def _extend(self, out: TurnOutput, token: int, logprob: float, stops: tuple[str, ...]) -> None:
        out.token_ids.append(token)
        out.logprobs.append(logprob)
        if token in self.eos_ids:
            out.finish_reason = "eos"
            return
        out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        if any(stop in out.text for stop in stops):   # the text before this token held none
            out.finish_reason = "stop"


def greedy_episodes(
    model, tokenizer, problems: list[Task], max_turns: int, max_tokens_per_turn: int, *, tool_timeout_s: float = 5.0
) -> list[Episode]:
    """The rollout loop on the torch model, greedy: what vLLM must reproduce."""
    _rate, episodes = evaluate(TorchGenerator(model, tokenizer), tokenizer, problems, max_turns=max_turns,
                               max_tokens_per_turn=max_tokens_per_turn, tool_timeout_s=tool_timeout_s)
    return episodes


# --- warm start -----------------------------------------------------------


def demonstration_batch(tokenizer, problems: list[Task], rng: random.Random, noise: float):
    """(prompt ids, completion ids, completion loss mask) of one calculator demonstration each, as plain text."""
    env = load_env(WARM_ENV)
    seqs = [demonstration_episode(env, ChatFormat(), tokenizer, p, rng, noise) for p in problems]
    return tuple(map(list, zip(*seqs)))


def _lr_at(step: int, lr: float, warmup: int = 30) -> float:
    # Constant after warmup: success then grows smoothly with steps, so a stop
    # at a target success lands near it (a decaying schedule jumps past it).
    return lr * min(1.0, (step + 1) / warmup)


def sft_loss(model, prompts, completions, masks) -> torch.Tensor:
    logps = completion_logprobs(model, prompts, completions)
    num = sum((lp * torch.tensor(m, dtype=lp.dtype, device=lp.device)).sum() for lp, m in zip(logps, masks))
    return -num / max(1, sum(sum(m) for m in masks))


def _greedy_success(model, tokenizer, problems: list[Task]) -> float:
    model.eval()
    rate, _ = evaluate(
        TorchGenerator(model, tokenizer), tokenizer, problems, max_turns=4, max_tokens_per_turn=32, tool_timeout_s=5.0
    )
    model.train()
    return rate


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with ``n`` intra-op threads (None: unchanged), then restore."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warm_start(
    model_dir: str | Path,
    *,
    problems: list[Task],
    steps: int,
    lr: float,
    noise: float,
    seed: int,
    batch_size: int = 16,
    target_success: float | None = None,
    check_every: int = 50,
    check_from: int = 250,
    check_problems: int = CHECK_PROBLEMS,
    threads: int | None = 1,
    progress: Progress | None = None,
) -> Path:
    """Short supervised pass on (noisy) demonstrations, written back into ``model_dir``.

    The loss covers only the tokens the policy writes (tool results masked),
    as the RL loss will. With ``target_success``, training stops once greedy
    success on ``check_problems`` held-back train problems reaches it: RL
    needs a policy that succeeds sometimes, not one that already solved the
    task, and where a fixed step count lands varies a lot with the seed.
    Checks start at ``check_from`` (no policy copies operands before) and
    come every ``check_every`` steps, 5x as often once half way there.

    One thread by default: on a shared 2-core machine two OpenMP threads
    that must wait for each other ran 4-8x slower than one (they spin while
    the other is descheduled); on an idle one they save only ~30%.
    """
    rng = random.Random(seed)
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    check, pool = problems[:check_problems], problems[check_problems:]
    with torch_threads(threads), torch.random.fork_rng(devices=[]):   # the caller's RNG left as it was
        torch.manual_seed(seed)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        next_check = check_from
        for step in range(1, steps + 1):
            batch = demonstration_batch(tokenizer, rng.sample(pool, batch_size), rng, noise)
            loss = _sft_step(model, opt, batch, _lr_at(step - 1, lr))
            if step < next_check and step != steps:
                continue
            success = float("nan") if target_success is None else _greedy_success(model, tokenizer, check)
            if progress:
                progress(f"warm_start step {step}/{steps} loss {loss:.4f} success {success:.2f}")
            if target_success is not None and success >= target_success:
                break
            next_check = step + _check_interval(success, target_success, check_every)
    model.eval()
    return save_weights(model, model_dir, model_dir)


def _check_interval(success: float, target: float | None, every: int) -> int:
    # Success can jump 30 points in 50 steps once copying clicks, so look
    # closely near the target and rarely far from it (a check costs ~10 steps).
    if target is not None and success >= target / 2:
        return max(1, every // 5)
    return every


def _sft_step(model, opt, batch, lr: float) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    loss = sft_loss(model, *batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


# --- cached build ---------------------------------------------------------


def full_spec(spec: dict) -> dict:
    unknown = set(spec) - set(DEFAULT_SPEC)
    if unknown:
        raise ValueError(f"unknown policy spec keys {sorted(unknown)}; known: {sorted(DEFAULT_SPEC)}")
    full = {**DEFAULT_SPEC, **spec}
    need = CHECK_PROBLEMS + full["warm_batch_size"]
    if full["warm_steps"] > 0 and full["warm_problems"] < need:
        raise ValueError(f"warm_problems = {full['warm_problems']}: the warm start holds {CHECK_PROBLEMS} problems "
                         f"back for its success checks and draws batches of warm_batch_size = "
                         f"{full['warm_batch_size']} from the rest: use at least {need}")
    return full


def spec_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(full_spec(spec), sort_keys=True).encode()).hexdigest()[:16]


def _build_into(out_dir: Path, spec: dict, progress: Progress | None) -> None:
    arch = ("seed", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position_embeddings")
    build_policy(out_dir, **{k: spec[k] for k in arch})
    problems = load_env(WARM_ENV).make_tasks(spec["seed"], spec["warm_problems"], "train")
    warm_start(
        out_dir,
        problems=problems,
        steps=spec["warm_steps"],
        lr=spec["warm_lr"],
        noise=spec["warm_noise"],
        seed=spec["seed"],
        batch_size=spec["warm_batch_size"],
        target_success=spec["warm_target_success"],
        progress=progress,
    )
    (out_dir / "spec.json").write_text(json.dumps(spec, sort_keys=True, indent=1) + "\n")


def ensure_policy(cache_dir: str | Path, spec: dict, *, progress: Progress | None = None) -> Path:
    """The warm-started policy for ``spec`` (defaults filled in), built once and cached.

    The directory is keyed by a hash of the full spec and appears atomically
    (built in a temp dir, then renamed), so concurrent callers and crashed
    builds never leave a half-written policy behind the final name.
    """
    spec = full_spec(spec)
    final = Path(cache_dir) / f"policy-{spec_hash(spec)}"
    if (final / "spec.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    clear_dead_siblings(final)
    tmp = _sibling(final, "tmp")
    started = time.monotonic()

    def touching(msg: str) -> None:   # a build in progress stays fresh: clear_dead_siblings elsewhere leaves it
        with contextlib.suppress(OSError):
            os.utime(tmp)
        if progress:
            progress(msg)

    try:
        _build_into(tmp, spec, touching)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a rename
    if progress:
        progress(f"policy built in {time.monotonic() - started:.1f}s at {final}")
    return final


def _sibling(final: Path, kind: str) -> Path:
    """A hidden name beside ``final``; builders on a shared cache may share a pid (containers are pid 1), so
    each gets a name of its own."""
    return final.parent / f".{final.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


DEAD_SIBLING_S = 3600.0   # a sibling untouched this long, of a pid not alive here, is a killed builder's


def clear_dead_siblings(final: Path) -> list[Path]:
    """Remove what killed builders left beside ``final`` (``_sibling``'s names: a SIGKILL skips their
    cleanup), returning what went. Only a sibling whose pid is not alive on this host and whose newest file is
    over ``DEAD_SIBLING_S`` old: a live builder, here or on another host of a shared cache, keeps its own."""
    gone = []
    for path in final.parent.glob(f".{final.name}.*-*-*"):
        kind_pid, _sep, _tag = path.name[len(final.name) + 2:].rpartition("-")
        kind, _sep, pid = kind_pid.rpartition("-")
        if kind not in ("tmp", "old") or not pid.isdigit() or pid_alive(int(pid)):
            continue
        try:
            newest = max((f.stat().st_mtime for f in [path, *path.rglob("*")]), default=0.0)
        except OSError:
            continue   # going away under us
        if time.time() - newest > DEAD_SIBLING_S:
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


@contextlib.contextmanager
def built_whole(final: str | Path):
    """Build a model directory in a temporary sibling, then put it at ``final`` in one rename.

    Yields the directory to write into. On success an older ``final`` is
    replaced (moved aside, then removed); on any failure the partial build is
    removed and ``final`` is left as it was. A later check such as "config.json
    exists" never finds half a model.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clear_dead_siblings(final)
    tmp = _sibling(final, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        old = _sibling(final, "old") if final.exists() else None
        if old is not None:
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:
            if old is not None:
                os.rename(old, final)   # the older build goes back where it was
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError:
        # Another process renamed its build first; theirs is the same policy.
        if not (final / "spec.json").exists():
            raise


def torch_success(model_dir: str | Path, problems: list[Task], *, max_turns: int = 4, max_tokens_per_turn: int = 32) -> float:
    """Greedy success rate of a model directory, on torch (no vLLM needed)."""
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    rate, _ = evaluate(
        TorchGenerator(model, tokenizer),
        tokenizer,
        problems,
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        tool_timeout_s=5.0,
    )
    return rate
