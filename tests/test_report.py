"""``libra-ctl report``: a self-contained report.html whose plots render in headless Chromium.

Under ``CI=true`` a missing Chromium fails the test instead of skipping it
(Debian's ``chromium`` package; ``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from pipeline.observe.charts import nice_ticks
from pipeline.observe.report import dump_dom, find_chromium, load_run, render, screenshot, write_report

ROOT = Path(__file__).resolve().parent.parent
T0 = 1.7e9


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def make_run(root: Path, *, samples: bool = True, events: bool = True, steps: int = 40) -> Path:
    """A run directory as libra-ctl run leaves it: manifest, summary, metrics, events and logs."""
    run = root / "20260101-000000-demo"
    (run / "logs").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({
        "run_id": run.name, "created_at": T0, "argv": ["libra-ctl", "run", "examples/quickstart.toml"],
        "config": {"job": {"name": "demo", "steps": steps}, "rollout": {"group_size": 8},
                   "learner": {"max_staleness": 2}}, "packages": {"torch": "2.13.0"}, "git_commit": "abc"}))
    (run / "summary.json").write_text(json.dumps({
        "run_id": run.name, "job": "demo", "success_rate_start": 0.31, "success_rate_end": 0.62,
        "trajectories_trained": 64 * steps, "trajectories_per_s": 6.1, "wall_s": 15.0 * steps,
        "dropped_stale": 48, "dead_lettered": 0, "policy_version": steps}))
    lines, logs, trained = [], [], 0
    for i in range(1, steps + 1):
        at = T0 + 15 * i
        trained += 64
        lines.append({"kind": "learner_step", "step": i, "policy_version": i, "at": at, "loss": 0.05 / i,
                      "reward_mean": 0.3 + 0.3 * (1 - math.exp(-i / 12)), "reward_std": 0.45,
                      "success_rate": 0.3 + 0.3 * (1 - math.exp(-i / 12)), "entropy": 0.9,
                      "staleness_hist": {"0": 24, "1": 32, "2": 8}, "staleness_mean": 0.75, "staleness_max": 2,
                      "trajectories": 64, "groups": 8, "zero_signal_groups": 2 + i % 3,
                      "dropped_stale": 8 if i % 7 == 0 else 0, "wait_s": 4.0 if i < 14 else 1.0, "train_s": 9.0,
                      "trained_total": trained,
                      **({"diversity_groups": 8, "diversity_distinct_rate": 0.9 - i / 200,
                          "diversity_similarity": 0.35 + i / 300, "diversity_equal_reward_share": 0.3}
                         if i % 5 == 0 else {})})
        logs.append({"event": "trained", "timestamp": iso(at), "level": "info", "job": "demo", "role": "learner",
                     "worker": "learner-0", "step": i, "train_s": 9.0, "wait_s": 4.0 if i < 14 else 1.0})
        if i % 10 == 0:
            logs.append({"event": "checkpointed", "timestamp": iso(at + 0.5), "level": "info", "role": "learner",
                         "worker": "learner-0", "step": i})
    if samples:
        for k in range(1, steps * 15 // 10):
            at = T0 + 10 * k
            alloc = {"rollout": 1 if at < T0 + 200 else 2, "reward": 1, "learner": 1}
            lines.append({"kind": "sample", "schema": 1, "at": at, "job": "demo", "dt_s": 10.0,
                          "allocation": alloc, "policy_version": k * 10 // 15,
                          "throughput": {"trajectories_per_min": 60 * (4.0 if at < T0 + 200 else 7.0),
                                         "scored_per_s": 4.0 if at < T0 + 200 else 6.8,
                                         "learner_samples_per_s": 4.2 if at < T0 + 200 else 6.5,
                                         "rollout_tokens_per_s": 900.0 + 10 * (k % 4)},
                          "resources": {"by_role": {r: {"cpu_percent": 95.0 - 20 * (r == "reward"),
                                                        "rss_bytes": (900 + 5 * k) * 2**20, "workers": n}
                                                    for r, n in alloc.items()},
                                        "gpus": [{"index": 0, "util_percent": 80.0 + k % 5}], "node": {"host": "n"}},
                          "queues": {"stages": {"rollout": {"backlog": 20 - k % 3},
                                                "reward": {"backlog": k % 2},
                                                "learner": {"backlog": 1 + k % 4}},
                                     "learner_wait_ratio": 0.3 if at < T0 + 200 else 0.1, "dead_letters": 0},
                          "quality": {}})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in sorted(lines, key=lambda x: x["at"])))
    for k in range(1, steps * 15 // 6):
        at = T0 + 6 * k
        logs.append({"event": "generated", "timestamp": iso(at), "level": "info", "role": "rollout",
                     "worker": "rollout-n-0", "groups": 4, "trajectories": 32, "tokens": 5400, "gen_s": 5.8})
    logs.append({"event": "redis_full_waiting", "timestamp": iso(T0 + 333), "level": "warning",
                 "role": "rollout", "worker": "rollout-n-0", "delay_s": 0.1})
    with open(run / "logs" / "learner-0.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in logs if x["worker"] == "learner-0")
    with open(run / "logs" / "rollout-n-0.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in logs if x["worker"] == "rollout-n-0")
    if events:
        (run / "events.jsonl").write_text(json.dumps({
            "at": T0 + 200, "job": "demo", "kind": "decision", "mode": "auto", "reason": "learner_waits",
            "summary": "learner waits 30% > 20%: rollout short", "from": {"rollout": 1, "reward": 1, "learner": 1},
            "to": {"rollout": 2, "reward": 1, "learner": 1}}) + "\n")
    return run


def need_chromium() -> None:
    if find_chromium() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (apt-get install chromium); CI must run the report test")
        pytest.skip("chromium is not installed (apt-get install chromium)")


# --- without a browser ---------------------------------------------------------------------------------


def test_nice_ticks():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 7) == [0, 2, 4, 6, 8]
    assert nice_ticks(5, 5)[0] <= 5 <= nice_ticks(5, 5)[-1]


def test_report_is_self_contained_and_has_every_section(tmp_path):
    run = make_run(tmp_path)
    page = render(load_run(run))
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched
    assert "<link" not in page and "@import" not in page
    for key in ("throughput", "reward", "diversity", "allocation", "queues", "wait", "staleness", "tokens",
                "cpu", "rss", "gpu"):
        assert f'data-chart="{key}"' in page, key
    allocation = page.split('data-chart="allocation"')[1].split("</figure>")[0]
    assert 'class="decision"' in allocation and "learner waits 30%" in allocation
    assert "rollout 1→2" in allocation
    staleness = page.split('data-chart="staleness"')[1].split("</figure>")[0]
    assert staleness.count('class="bar"') == 4  # versions 0, 1, 2 and the dropped ones
    assert "redis_full_waiting" in page and "checkpointed" in page  # the run's events
    assert "&quot;git_commit&quot;: &quot;abc&quot;" in page  # the manifest


def test_report_without_sampler_or_controller_falls_back(tmp_path):
    run = make_run(tmp_path, samples=False, events=False)
    page = render(load_run(run))
    tp = page.split('data-chart="throughput"')[1].split("</figure>")[0]
    assert "trained /s" in tp and "generated /s" in tp and "learner steps and logs" in tp
    tokens = page.split('data-chart="tokens"')[1].split("</figure>")[0]
    assert 'class="series"' in tokens  # tokens/s from the rollout workers' "generated" lines
    assert 'data-chart="queues"' in page and "the sampler was not running" in page


def test_report_of_a_sim_run_whose_steps_carry_no_group_figures(tmp_path):
    """The sim learner's step records have no zero_signal_groups or diversity fields."""
    run = make_run(tmp_path, samples=False, events=False)
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row.pop("zero_signal_groups", None)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    page = render(load_run(run))
    assert 'data-chart="diversity"' in page


def test_libra_ctl_report(tmp_path):
    run = make_run(tmp_path)
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "report", str(run)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (run / "report.html").stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "pipeline.cli", "report", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2


# --- in headless Chromium -------------------------------------------------------------------------------


@pytest.mark.slow
def test_plots_render_in_headless_chromium(tmp_path):
    need_chromium()
    run = make_run(tmp_path)
    page = write_report(run)
    dom = dump_dom(page)
    charts = int(re.search(r'data-charts="(\d+)"', dom).group(1))
    rendered = int(re.search(r'data-rendered-charts="(\d+)"', dom).group(1))
    assert charts == 11 and rendered == charts, (rendered, charts)
    assert dom.count('class="series"') >= 20
    assert f"{charts} of {charts} charts rendered" in dom

    png = screenshot(page, tmp_path / "report.png", 1400, 1600)
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] >= 1500 and img.shape[1] >= 1300
    assert len({tuple(px) for px in img[::20, ::20].reshape(-1, img.shape[2]).round(2).tolist()}) > 20


@pytest.mark.slow
def test_report_screenshot_script(tmp_path):
    need_chromium()
    run = make_run(tmp_path)
    out = subprocess.run([sys.executable, "scripts/report_screenshot.py", str(run), str(tmp_path / "shot.png")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "shot.png").stat().st_size > 20_000
