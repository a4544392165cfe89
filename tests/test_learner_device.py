"""The learner's compute: device, precision, chunked log-probs, token-sized micro-batches, files.

Fast tests run on the CPU with freshly initialised tiny models (no Redis, no
vLLM). Measured on 2 cores: chunked against full-logits log-probs differ by
at most ~5e-7 (Qwen2, GPT-2, Gemma 2), and the accumulated gradient is the
same to ~1e-6 relative however the rows are cut into micro-batches.

Tests marked ``gpu`` check the CUDA paths against the CPU; they skip without
a GPU: ``pytest -m gpu tests/test_learner_device.py`` on a GPU machine.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

from pipeline import config as config_mod
from pipeline.config import LearnerConfig
from workers import learner as ln
from workers import tiny_policy as tp
from workers.checkpoint import read_optimizer, write_checkpoint, write_published
from workers.grpo import clipped_loss
from workers.update import Row

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return tp.build_policy(tmp_path_factory.mktemp("policy") / "m", seed=0)


def _model(policy_dir):
    torch.manual_seed(0)
    return tp.load_model(policy_dir)


def _rows(n: int, vocab: int, seed: int = 0) -> list[tuple]:
    """Learner rows (prompt tokens, trajectory, advantage, staleness) of random lengths, tool spans masked."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = rng.integers(3, vocab, rng.integers(4, 20)).astype(np.int32)
        width = int(rng.integers(1, 40))
        mask = (rng.random(width) > 0.2).astype(np.uint8)
        # Behaviour log-probs near the policy's (about -log vocab), so some ratios clip and some do not.
        logprobs = (-np.log(vocab) + rng.normal(0, 0.3, width)).astype(np.float32) * mask
        traj = SimpleNamespace(completion=rng.integers(3, vocab, width).astype(np.int32), mask=mask, logprobs=logprobs)
        rows.append(Row(prompt, traj, float(rng.normal()), i % 3))
    return rows


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _rel_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) / max(float(y.abs().max()), 1e-12) for x, y in zip(a, b))


def _accumulate(model, rows, temperature: float = 1.0, **cfg):
    model.zero_grad(set_to_none=True)
    # the behaviour objective: what these tests compare with clipped_loss over full logits
    out = ln.accumulate_gradients(model, rows, LearnerConfig(**{"objective": "behaviour", **cfg}), temperature)
    return out, _grads(model)


def _full_logits_logprobs(model, prompts, completions, temperature=1.0):
    """The reference: every position's logits at once, from the model's own forward."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    ids = tp._right_padded(seqs, tp.pad_id(model.config)).to(next(model.parameters()).device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    logits = model(input_ids=ids, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return [logp[r, len(p) - 1:len(p) - 1 + len(c)] for r, (p, c) in enumerate(zip(prompts, completions))]


# --- device and config ------------------------------------------------------------------


def test_device_is_the_slots_gpu_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ln.pick_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ln.pick_device() == torch.device("cuda:0")


@pytest.mark.parametrize("override,needle", [
    (["learner.dtype=fp16"], "learner.dtype"),
    (["learner.micro_batch_tokens=0"], "learner.micro_batch_tokens"),
    (["learner.logprob_chunk=0"], "learner.logprob_chunk"),
    (["rollout.temperature=2.5"], "rollout.temperature"),
    (["rollout.dtype=fp32"], "rollout.dtype"),
    (["rollout.tensor_parallel_size=0"], "rollout.tensor_parallel_size"),
    (["rollout.kv_cache_bytes=-1"], "rollout.kv_cache_bytes"),
])
def test_new_settings_are_validated(override, needle):
    with pytest.raises(config_mod.ConfigError, match=needle):
        config_mod.load(None, override)


def test_new_settings_defaults_and_accepted_values():
    cfg = config_mod.load(None, ["rollout.temperature=0.7", "learner.dtype=bf16", "rollout.dtype=bfloat16",
                                 "rollout.kv_cache_bytes=0", "learner.gradient_checkpointing=true"])
    assert cfg.rollout.temperature == 0.7 and cfg.learner.dtype == "bf16" and cfg.rollout.kv_cache_bytes == 0
    d = config_mod.load(None)
    assert (d.learner.dtype, d.learner.micro_batch_tokens, d.learner.logprob_chunk, d.learner.gradient_checkpointing) \
        == ("fp32", 8192, 1024, False)
    assert (d.rollout.dtype, d.rollout.kv_cache_bytes, d.rollout.enforce_eager, d.rollout.tensor_parallel_size,
            d.rollout.temperature) == ("float32", 1 << 30, True, 1, 1.0)


# --- chunked log-probs ------------------------------------------------------------------------


def _arch(name: str):
    common = {"vocab_size": 98, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2}
    if name == "qwen2":
        cfg = transformers.Qwen2Config(**common, **small, tie_word_embeddings=False)
    elif name == "gpt2":  # tied head, another base-model prefix ("transformer"), dropout in train mode
        cfg = transformers.GPT2Config(vocab_size=98, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      eos_token_id=1, bos_token_id=1)
    else:  # gemma2: the logits are soft-capped after the head
        cfg = transformers.Gemma2Config(**common, **small, head_dim=16, final_logit_softcapping=30.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "gemma2"])
def test_chunked_logprobs_equal_the_full_logits(arch):
    model = _arch(arch)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 98, (n,), generator=g).tolist() for n in (5, 9, 1, 12)]
    completions = [torch.randint(3, 98, (n,), generator=g).tolist() for n in (7, 2, 15, 4)]
    ref = _full_logits_logprobs(model, prompts, completions)
    sum(x.sum() for x in ref).backward()
    ref_grads = _grads(model)
    for chunk in (None, 5, 1):
        model.zero_grad(set_to_none=True)
        out = tp.completion_logprobs(model, prompts, completions, chunk_tokens=chunk)
        assert [len(x) for x in out] == [len(c) for c in completions]
        assert max(float((a - b).detach().abs().max()) for a, b in zip(out, ref)) < 1e-6
        sum(x.sum() for x in out).backward()
        assert _rel_gap(_grads(model), ref_grads) < 1e-5


def test_temperature_divides_the_logits(policy_dir):
    model = _model(policy_dir).eval()
    prompts, completions = [[3, 4, 5], [6, 7]], [[8, 9, 10, 11], [12]]
    with torch.no_grad():
        ref = _full_logits_logprobs(model, prompts, completions, temperature=0.7)
        out = tp.completion_logprobs(model, prompts, completions, temperature=0.7, chunk_tokens=2)
        at_one = tp.completion_logprobs(model, prompts, completions)
    assert max(float((a - b).abs().max()) for a, b in zip(out, ref)) < 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(out, at_one)) > 1e-3


def test_a_model_whose_forward_disagrees_is_refused():
    model = _arch("qwen2")

    class Capped(type(model)):  # post-processes its logits in a way head_logits does not know
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = torch.tanh(out.logits / 3.0) * 3.0
            return out

    model.__class__ = Capped
    with pytest.raises(ValueError, match="head_logits"):
        tp.completion_logprobs(model, [[3, 4]], [[5]])


# --- micro-batches and the accumulated gradient -------------------------------------------------


def test_micro_batches_fit_the_token_budget():
    rows = _rows(40, 98)
    for budget in (1, 60, 300, 10_000):
        batches = ln.micro_batches(rows, budget)
        assert sorted(id(r) for b in batches for r in b) == sorted(id(r) for r in rows)
        for b in batches:
            assert len(b) == 1 or len(b) * max(ln.row_tokens(r) for r in b) <= budget
    assert len(ln.micro_batches(rows, 1)) == 40 and len(ln.micro_batches(rows, 10_000)) == 1


def test_gradient_is_the_batchs_however_rows_are_cut(policy_dir):
    """Token-level weighting over the whole batch: the old 64-trajectory loop and any token budget agree."""
    model = _model(policy_dir).train()
    rows = _rows(80, model.config.vocab_size)
    # Today's learner before this change: 64 trajectories per micro-batch, in arrival order, full logits.
    model.zero_grad(set_to_none=True)
    total = int(sum(int(r[1].mask.sum()) for r in rows))
    old_loss = 0.0
    for i in range(0, len(rows), 64):
        chunk = rows[i:i + 64]
        new = _full_logits_logprobs(model, [r[0].tolist() for r in chunk], [r[1].completion.tolist() for r in chunk])
        loss, _ = clipped_loss(new, [torch.from_numpy(r[1].logprobs) for r in chunk],
                               [torch.from_numpy(r[1].mask.astype(np.float32)) for r in chunk],
                               [r[2] for r in chunk], 0.2, total)
        loss.backward()
        old_loss += float(loss.detach())
    old_grads = _grads(model)
    for budget, chunk in ((1, 1024), (500, 7), (8192, 1024), (10 ** 9, 1)):
        (loss, stats, fresh), grads = _accumulate(model, rows, micro_batch_tokens=budget, logprob_chunk=chunk)
        assert abs(loss - old_loss) < 1e-6 * max(1.0, abs(old_loss))
        assert _rel_gap(grads, old_grads) < 1e-5
        assert sum(s.tokens for s in stats) == total
        assert len(fresh) == sum(int(r[1].mask.sum()) for r in rows if r[3] == 0)


def test_gradient_checkpointing_gives_the_same_gradient(policy_dir):
    model = _model(policy_dir).train()
    rows = _rows(24, model.config.vocab_size)
    _, plain = _accumulate(model, rows, micro_batch_tokens=400)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, ckpt = _accumulate(model, rows, micro_batch_tokens=400)
    assert _rel_gap(ckpt, plain) < 1e-5


def test_bf16_autocast_keeps_fp32_master_weights(policy_dir):
    """CPU autocast runs the same code path as the GPU's: bf16 matmuls, float32 weights, grads and log-softmax."""
    model = _model(policy_dir).train()
    rows = _rows(24, model.config.vocab_size)
    (loss32, _, _), g32 = _accumulate(model, rows)
    (loss16, _, _), g16 = _accumulate(model, rows, dtype="bf16")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 for g in g16)
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in g16]),
                                                torch.cat([g.flatten() for g in g32]), dim=0)
    assert float(cos) > 0.99 and abs(loss16 - loss32) < 0.05 * max(1.0, abs(loss32))
    with ln.autocast(torch.device("cpu"), "bf16"):
        lps = tp.completion_logprobs(model, [[3, 4, 5]], [[6, 7]])
    assert lps[0].dtype == torch.float32


# --- files ----------------------------------------------------------------------------------


def test_checkpoint_and_published_dirs_are_complete_and_load_on_cpu(policy_dir, tmp_path):
    model = _model(policy_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _accumulate(model, _rows(8, model.config.vocab_size))
    opt.step()
    write_checkpoint(tmp_path / "ckpt", model, opt, ["a/0"], [], {"step": 1, "version": 1}, policy_dir)
    pub = write_published(tmp_path / "pub", 1, model, tmp_path / "ckpt" / "step-000001" / "model")
    for d in (tmp_path / "ckpt" / "step-000001" / "model", pub):
        for f in tp.tokenizer_files(policy_dir):
            assert (d / f.name).read_bytes() == f.read_bytes(), (d, f.name)
        reloaded = tp.load_model(d)
        assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))
    state = read_optimizer(tmp_path / "ckpt" / "step-000001")
    assert all(t.device.type == "cpu" for s in state["state"].values() for t in s.values() if torch.is_tensor(t))


# --- the CUDA paths (skipped without a GPU) -------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_gradient_matches_cpu(policy_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = _rows(40, 98)
    cpu = _model(policy_dir).train()
    (loss_cpu, _, _), g_cpu = _accumulate(cpu, rows, micro_batch_tokens=600, logprob_chunk=64)
    gpu = _model(policy_dir).to("cuda").train()
    (loss_gpu, _, _), g_gpu = _accumulate(gpu, rows, micro_batch_tokens=600, logprob_chunk=64)
    assert all(g.device.type == "cuda" for g in g_gpu)
    assert abs(loss_gpu - loss_cpu) < 1e-4 * max(1.0, abs(loss_cpu))
    assert _rel_gap([g.cpu() for g in g_gpu], g_cpu) < 1e-3
    _, g16 = _accumulate(gpu, rows, dtype="bf16")
    assert all(p.dtype == torch.float32 for p in gpu.parameters())
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten().cpu() for g in g16]),
                                                torch.cat([g.flatten() for g in g_cpu]), dim=0)
    assert float(cos) > 0.99


@pytest.mark.gpu
@needs_cuda
def test_files_written_from_cuda_load_on_cpu(policy_dir, tmp_path):
    model = _model(policy_dir).to("cuda").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _accumulate(model, _rows(8, 98))
    opt.step()
    write_checkpoint(tmp_path / "ckpt", model, opt, [], [], {"step": 1, "version": 1}, policy_dir)
    ckpt = tmp_path / "ckpt" / "step-000001"
    reloaded = tp.load_model(ckpt / "model")
    assert all(torch.equal(a, b.cpu()) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)  # no map_location: must already be on the CPU
    fresh = torch.optim.AdamW(reloaded.to("cuda").parameters(), lr=1e-3)
    fresh.load_state_dict(state)
    assert all(t.device.type == "cuda" for s in fresh.state.values() for t in s.values() if t.dim())
