"""The learner's training math where it used to part from what the loss sees or the engine samples.

The learning rate a step reports; log-probs under dropout, which the engine
never applies; a group whose rewards differ by float rounding only. Tiny
hand-made inputs: a few-hundred-parameter causal model, groups of two or
three trajectories; no Redis, no real policy build.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline import config as config_mod
from pipeline.config import LearnerConfig
from pipeline.dataplane import messages
from pipeline.dataplane.lineage import Lineage
from pipeline.dataplane.lookahead import InHand
from workers import learner as ln
from workers import update
from workers.grpo import group_advantages
from workers.tiny_policy import completion_logprobs

V, H = 7, 4


class _Base(torch.nn.Module):
    """Embedding + position embedding, a causal running mean and a tanh mix: ~100 parameters."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.pos = torch.nn.Embedding(64, H)
        self.mix = torch.nn.Linear(H, H)

    def forward(self, input_ids, position_ids=None, use_cache=False, **_kw):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        x = self.emb(input_ids) + self.pos(position_ids)
        c = x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[None, :, None]
        return SimpleNamespace(last_hidden_state=torch.tanh(self.mix(c)) + x)


class Tiny(torch.nn.Module):
    """A causal LM with the surface ``completion_logprobs`` uses (base_model, output embeddings, config)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = _Base()
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.config = SimpleNamespace(vocab_size=V, pad_token_id=0, eos_token_id=1)

    @property
    def base_model(self):
        return self.model

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, use_cache=False, **kw):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids, **kw).last_hidden_state))


def _traj(i, comp, mask, lps, reward) -> messages.Trajectory:
    return messages.Trajectory(sample_idx=i, completion=np.array(comp, np.int32), mask=np.array(mask, np.uint8),
                               logprobs=np.array(lps, np.float32), text="", finish="eos", turns=1, tool_calls=0,
                               tool_latency_s=(), tool_timeouts=0, reward=reward)


def _group(pid, prompt, trajs, version=0) -> messages.Group:
    return messages.Group(prompt_id=pid, prompt="", answer=None, prompt_tokens=np.array(prompt, np.int32),
                          version=version, worker="t", generated_at=0.0, gen_s=0.0, trajectories=tuple(trajs))


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the learning rate a step reports ------------------------------------------------------------------


def _stub_learner(cfg) -> ln.Learner:
    """A Learner with just what ``Learner.train`` reads (no Redis, one rank, no prefetch)."""
    learner = object.__new__(ln.Learner)
    learner.ctx = SimpleNamespace(cfg=cfg, log=None)
    learner.cfg = cfg.learner
    learner.model = Tiny()
    learner.optimizer = update.make_optimizer(learner.model, learner.cfg)
    learner.prefetch, learner.ranks = None, None
    learner.version, learner.step, learner.world = 0, 0, 1
    learner.set_lr()
    return learner


def test_step_metrics_report_the_learning_rate_the_step_trained_with(monkeypatch):
    """A step's ``lr`` is the rate its optimizer step used (warmup 3, lr 1: 0.25, 0.5, 0.75, 1.0), not the
    next step's (0.5, 0.75, 1.0, 1.0: the warmup looked a step shorter on every dashboard)."""
    cfg = config_mod.load(None, ["rollout.group_size=2", "learner.batch_size=2", "learner.warmup_steps=3",
                                 "learner.lr=1.0", "learner.prefetch=false"])
    learner = _stub_learner(cfg)
    used = []
    step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        used.append(self.param_groups[0]["lr"])
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    g = _group("p", [2, 3], [_traj(0, [4, 5], [1, 1], [-2.0, -2.0], 1.0), _traj(1, [5], [1], [-2.0], 0.0)])
    reported = [learner.train(ln.Batch(groups=[g], staleness=[0]))["lr"] for _ in range(4)]
    assert used == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert reported == pytest.approx(used)


# --- the learner's log-probs are the engine's distribution ------------------------------------------------


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=8, n_embd=4, n_layer=1, n_head=1, n_positions=16, n_inner=4,
                                  eos_token_id=1, bos_token_id=1)   # default dropout 0.1, as GPT-2's own config
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).float()   # 240 parameters


def test_fresh_samples_have_ratio_one_on_a_model_with_dropout(tmp_path):
    """A policy whose config has dropout (GPT-2, OPT, Phi: 0.1), loaded as the learner loads it: on samples
    these very weights generated (the engine applies no dropout) the importance ratio is 1; it was ~1e-2
    off on a 240-parameter GPT-2, so the clip and the importance weights acted on noise. The config the
    published versions carry keeps its dropout."""
    _tiny_gpt2().save_pretrained(tmp_path)
    model = update.load_policy(tmp_path, torch.device("cpu"), LearnerConfig())
    assert model.config.resid_pdrop == 0.1
    prompt, comps = [2, 3, 4], [[5, 6, 7, 3], [4, 4, 2, 6], [7, 7, 7, 7]]
    model.eval()
    with torch.no_grad():
        lps = completion_logprobs(model, [prompt] * 3, comps)
    g = _group("p", prompt, [_traj(i, c, [1] * 4, lp.numpy(), float(i)) for i, (c, lp) in enumerate(zip(comps, lps))])
    cfg = LearnerConfig(objective="behaviour", warmup_steps=0)
    sums = update.train_share(model, update.make_optimizer(model, cfg), update.plan_shares([g], [0], 0, 0, 1, cfg)[0],
                              cfg, 1.0)
    assert sums.fresh_n == 8   # the two trajectories with a non-zero advantage
    assert sums.fresh_max < 1e-5, f"fresh samples' max |log ratio| {sums.fresh_max:.3g}: dropout is on in the loss"


# --- zero-signal groups: what counts as one ----------------------------------------------------------------


def test_dynamic_sampling_counts_a_group_with_zero_advantages_as_no_signal():
    """Rewards 0.1 + 0.2 and 0.3 give zero advantages: the group is one without signal (with dynamic sampling
    it does not fill the batch), as the loss sees it, not a signal group by exact float inequality."""
    rewards = [0.1 + 0.2, 0.3]
    assert group_advantages(rewards) == [0.0, 0.0]           # no signal, as the loss sees it
    cfg = config_mod.load(None, ["rollout.group_size=2", "learner.batch_size=2", "learner.dynamic_sampling=true"])
    learner = object.__new__(ln.Learner)
    learner.ctx = SimpleNamespace(cfg=cfg, log=None)
    learner.cfg = cfg.learner
    learner.ahead = InHand(0)
    learner.lineage, learner.version, learner.judged_ids = Lineage(), 0, {}
    g = _group("p", [2, 3], [_traj(i, [4, 5], [1, 1], [-2.0, -2.0], r) for i, r in enumerate(rewards)])
    learner.ahead.add(b"1-0", g, b"")
    batch = ln.Batch()
    learner.take_in_hand(batch, lambda: batch.counted(True) >= cfg.learner.batch_size)
    assert batch.groups == [g]
    rows = update.group_rows(batch.groups, batch.staleness, cfg.learner.advantage)
    assert update.active_rows(rows) == []
    assert batch.no_signal == 2, "a group with zero advantages was counted towards batch_size as signal"
