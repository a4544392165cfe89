"""``libra-ctl bench rollout`` end to end, CI-sized: a real rollout worker on an embedded Redis beside the
same engine called directly, then a run with weights published after every step.

Slow: three vLLM engines load one after the other (~10-25 s each on 2 cores);
16 prompts in calls of 4 groups keep the generation itself to seconds. Only
the figures' presence and sign are checked, never their size (that depends on
the machine); exactness is checked in full: the sink received every issued
group once, and both paths generated the same tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
# about 60 s quiet; beside another full suite and a CPU hog (load 11-14) the bench outlasted 280 s, so the
# limits only catch a bench that hangs
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, PER_CALL, GROUP, BATCH = 16, 4, 8, 32


def test_bench_rollout_reports_both_paths_and_the_switch(tmp_path):
    out = tmp_path / "rollout.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "bench", "rollout", "--prompts", str(PROMPTS), "--rounds", "1",
         "--set", f"rollout.groups_per_call={PER_CALL}", "--set", f"learner.batch_size={BATCH}",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1140)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    assert "ratio pipeline/direct" in proc.stdout
    res = json.loads(out.read_text())

    (rd,) = res["rounds"]
    for name in ("direct", "pipeline"):
        run = rd[name]
        # the first of the 4 engine calls is a warm-up: 3 calls of PER_CALL groups are measured
        assert run["trajectories"] == (PROMPTS - PER_CALL) * GROUP
        assert run["tokens"] > 0 and run["seconds"] > 0 and run["tokens_per_s"] > 0
    assert res["ratio"] > 0 and res["direct_tokens_per_s"] > 0 and res["pipeline_tokens_per_s"] > 0
    assert res["same_tokens"], "the pipeline and the direct loop generated different tokens from the same prompts"
    assert res["step"]["batch_size"] == BATCH and res["step"]["seconds"] > 0

    sw = res["switch"]
    # published after 32, 64 and 96 of the 128 trajectories; each reload lands between two engine calls
    assert sw["versions"] == 3
    assert 1 <= sw["reloads"] <= 3
    assert sw["reload_s_mean"] > 0 and sw["share_of_step"] > 0 and sw["publish_s_mean"] > 0

    eo = res["exactly_once"]
    assert eo["ok"] and eo["dead_lettered"] == 0
    assert eo["issued_groups"] == eo["received_groups"] == 2 * PROMPTS   # the pipeline run and the switch run
    assert eo["distinct_trajectories"] == 2 * PROMPTS * GROUP and eo["duplicate_trajectories"] == 0


def test_the_pipeline_run_ends_when_its_groups_are_at_the_sink_or_dead_lettered(tmp_path):
    """A group the environment's error dead-letters never reaches the sink: the pipeline run counts it and
    ends, instead of waiting out ``--timeout`` (900 s) for it."""
    import threading
    import time as clock

    from pipeline.bench_rollout import Sink, wait_done

    out = Sink()
    out.groups.update({"p0", "p1", "p2"})          # three of four groups at the sink, the fourth dead-lettered
    proc = type("Running", (), {"poll": lambda self: None})()
    done = threading.Event()
    threading.Thread(target=lambda: (wait_done(out, 4, proc, tmp_path / "w.log", clock.perf_counter() + 60,
                                               lambda _m: None, False, dead=lambda: 1), done.set()),
                     daemon=True).start()
    assert done.wait(10), "still waiting for a dead-lettered group"
