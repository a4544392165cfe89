"""The feeder: prompt ids unique per issue, the prompt file its cursor counts in, one draw per epoch.

A prompt file that repeats an id has the repeated line reported and skipped
(issued twice in one epoch, the second group would be dropped downstream as
a duplicate while the feeder still counts it in flight, until it stops). A
resume over a prompt file that gained, lost or reordered lines is refused,
by the feeder and by ``libra-ctl resume`` before anything starts. An
epoch's order is drawn once, not once per prompt issued.
"""

from __future__ import annotations

import json
import random

import pytest
import structlog

from pipeline import config as config_mod
from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.streams import ensure_groups
from pipeline.dataplane.worker import WorkerContext
from pipeline.run import RunFailed, check_prompts_unchanged
from workers import feeder
from workers.envs import env_from_config
from workers.envs.base import BadLine, Task

JOB = "rvs"


def _cfg(tmp_path, lines: list[dict], *extra: str):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return config_mod.load(None, [f"job.name={JOB}", "rollout.group_size=2", "learner.batch_size=4",
                                  f"job.train_prompts={path}", *extra]), path


def _ctx(cfg, r, tmp_path) -> WorkerContext:
    return WorkerContext(cfg=cfg, run_dir=tmp_path, keys=JobKeys(cfg.job.name), r=r, worker_id="feeder-0",
                         role="feeder", log=structlog.get_logger())


def _prompt_ids(r, keys) -> list[str]:
    return [m.decode(f[m.FIELD], 1 << 20).prompt_id for _i, f in r.xrange(keys.prompts)]


def test_a_repeated_prompt_id_is_a_bad_line_and_an_epoch_issues_each_id_once(r, tmp_path):
    cfg, path = _cfg(tmp_path, [{"prompt_id": "a", "prompt": "Q:1+1\n", "answer": 2},
                                {"prompt_id": "b", "prompt": "Q:2+2\n", "answer": 4},
                                {"prompt_id": "a", "prompt": "Q:3+3\n", "answer": 6}])
    problems, bad = feeder.load_prompts(env_from_config(cfg), str(path))
    assert [p.prompt_id for p in problems] == ["a", "b"]
    assert bad == [BadLine(3, "prompt_id 'a' is already the id of line 1 (ids must be unique)")]
    ctx = _ctx(cfg, r, tmp_path)
    ensure_groups(r, ctx.keys)
    for _ in range(4):   # two epochs
        feeder.issue_one(ctx, problems, cfg.rollout.group_size)
    assert sorted(_prompt_ids(r, ctx.keys)) == ["a@0", "a@1", "b@0", "b@1"]


@pytest.mark.parametrize("change", ["grown", "reordered", "same"])
def test_a_resume_over_another_prompt_file_is_refused_before_an_id_is_issued_twice(r, tmp_path, change):
    """Cursor 6 of a 4-prompt file is epoch 1; over the file grown to 8 prompts it would be epoch 0 again,
    and ids of epochs 0 and 1 would be issued a second time. The same file resumes."""
    lines = [{"prompt_id": f"p{i}", "prompt": f"Q:{i}+1\n", "answer": i + 1} for i in range(8)]
    cfg, path = _cfg(tmp_path, lines[:4])
    ctx = _ctx(cfg, r, tmp_path)
    ensure_groups(r, ctx.keys)
    first = feeder.load_prompts(env_from_config(cfg), str(path))[0]
    feeder.check_prompts(ctx, first)
    for _ in range(6):   # epoch 0 whole, two prompts of epoch 1; then the run stops
        feeder.issue_one(ctx, first, cfg.rollout.group_size)
    resumed = {"grown": lines, "reordered": lines[:4][::-1], "same": lines[:4]}[change]
    path.write_text("".join(json.dumps(x) + "\n" for x in resumed))
    problems = feeder.load_prompts(env_from_config(cfg), str(path))[0]
    if change == "same":
        check_prompts_unchanged(r, cfg)
        feeder.check_prompts(ctx, problems)
        for _ in range(2):
            feeder.issue_one(ctx, problems, cfg.rollout.group_size)
        ids = _prompt_ids(r, ctx.keys)
        assert len(ids) == len(set(ids)) == 8
        return
    with pytest.raises(RunFailed, match="is not the prompt file this job issued 6 prompts from"):
        check_prompts_unchanged(r, cfg)
    with pytest.raises(SystemExit, match="put that file back to resume, or start a new run"):
        feeder.check_prompts(ctx, problems)


def test_an_epochs_order_is_drawn_once_not_once_per_prompt(r, tmp_path, monkeypatch):
    """Drawing the permutation of every prompt for each one issued made the feeder O(prompts) per prompt
    (about 3 prompts/s on a 400k-prompt file); the order is drawn once per epoch, and it is the same order."""
    cfg, _path = _cfg(tmp_path, [{"prompt_id": "x", "prompt": "Q:1+1\n", "answer": 2}])
    ctx = _ctx(cfg, r, tmp_path)
    ensure_groups(r, ctx.keys)
    problems = [Task(f"p{i}", "Q", i) for i in range(1000)]
    order = random.Random(cfg.job.seed * 1_000_003).sample(range(1000), 1000)   # epoch 0's, as before
    expected = [problems[i].prompt_id for i in order[:10]]
    draws = []
    real = feeder.random.Random

    class Counted(real):
        def sample(self, *a, **k):
            draws.append(1)
            return super().sample(*a, **k)

    monkeypatch.setattr(feeder.random, "Random", Counted)
    feeder.epoch_order.cache_clear()
    for _ in range(10):
        feeder.issue_one(ctx, problems, cfg.rollout.group_size)
    assert len(draws) == 1
    assert _prompt_ids(r, ctx.keys) == [f"{p}@0" for p in expected]
