"""The docs say what the code does: names, event kinds, run directories and dead-letter reasons they quote.

Each test reads a statement of README.md or docs/*.md and checks it against the
code it describes.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _resolves(dotted: str) -> bool:
    """Whether ``pipeline.x.y.name`` names a module, or an attribute of one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            if not hasattr(obj, p):
                return False
            obj = getattr(obj, p)
        return True
    return False


def test_every_dotted_pipeline_or_workers_name_in_the_docs_resolves():
    """Every `pipeline.…` / `workers.…` dotted name the docs quote imports (observability.md quoted three
    modules by their names before they moved under pipeline.observe)."""
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for code in re.findall(r"`([^`]+)`", line):
                for m in re.finditer(r"\b((?:pipeline|workers)\.[A-Za-z_][\w.]*\w)", code):
                    if not _resolves(m.group(1)):
                        bad.append(f"{doc.relative_to(ROOT)}:{n}: {m.group(1)}")
    assert not bad, "dotted names in the docs that do not import:\n" + "\n".join(bad)


def test_every_event_kind_the_controller_records_is_in_the_elastic_docs_list():
    """docs/elastic.md ("Events") lists every kind of event the controller records (``publish``, the
    publish cadence's, was left out)."""
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "elastic.md").read_text())
    m = re.search(r'"kind": ([a-z_|]+),', text)
    assert m, "docs/elastic.md no longer lists the event kinds"
    documented = set(m.group(1).split("|"))
    src = (ROOT / "pipeline" / "control" / "loop.py").read_text()
    recorded = set(re.findall(r'"kind":\s*"(\w+)"', src))
    assert recorded <= documented, f"kinds recorded but not documented: {sorted(recorded - documented)}"


def test_an_experiment_run_directory_is_named_as_the_readme_says(tmp_path):
    """README ("Baselines and experiments"): each run's directory is `runs/<key>-<value>-seed<s>/` of the
    experiment's directory (it said `runs/<value>-seed<s>/`)."""
    from pipeline.experiment import plan_runs

    readme = (ROOT / "README.md").read_text()
    assert "`runs/<key>-<value>-seed<s>/`" in readme
    key, value = "learner.batch_size", "128"
    specs = plan_runs(str(ROOT / "examples" / "quickstart.toml"), [], [(f"{key}={value}", value, [f"{key}={value}"])],
                      1, "exp", tmp_path, 1)
    seed = specs[0].seed
    assert specs[0].home.parent.name == "runs"
    assert specs[0].home.name == f"{key}-{value}-seed{seed}", specs[0].home


def test_a_failing_verifier_is_dead_lettered_with_the_reason_the_guarantees_doc_shows():
    """docs/guarantees.md ("Bad input is contained") shows a failing verifier's dead-letter reason as
    score_group writes it (it showed ``verifier error``, the code writes ``reward error``)."""
    from pipeline.dataplane import messages
    from workers.reward import Reject, score_group

    doc = (ROOT / "docs" / "guarantees.md").read_text()
    m = re.search(r"^(\w+ error) after 3 attempts on sample 5: \.\.\.$", doc, re.M)
    assert m, "docs/guarantees.md no longer shows a verifier's reason"
    z = np.zeros(1, dtype=np.int32)
    trajs = tuple(messages.Trajectory(sample_idx=i, completion=z + 5, mask=z.astype(np.uint8) + 1,
                                      logprobs=z.astype(np.float32), text="t", finish="stop", turns=1,
                                      tool_calls=0, tool_latency_s=(), tool_timeouts=0) for i in (5, 6))
    group = messages.Group(prompt_id="p@0", prompt="q", answer=1, prompt_tokens=z, version=0, worker="w",
                           generated_at=0.0, gen_s=0.0, trajectories=trajs)

    def unreachable(task, transcript):
        raise ConnectionError("judge unreachable")

    out = score_group(group, retries=2, reward=unreachable, timeout_s=5.0)
    assert isinstance(out, Reject)
    assert out.reason.startswith(f"{m.group(1)} after 3 attempts on sample 5: "), out.reason
