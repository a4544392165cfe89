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


# --- links and the workload format page ---------------------------------------------------------------


def _slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_in_the_docs_names_a_file_and_heading_that_exist():
    """A link such as [x](bench.md#modes) points at a file of the repository and, with an anchor, at one of
    its headings (the workload format lived outside the repository, so its links led nowhere)."""
    bad = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{doc.name}: {target} (no such heading)")
    assert not bad, bad


def _workload_doc_blocks() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "workloads.md").read_text(), flags=re.S)


def _keys_table() -> list[tuple[str, str, bool]]:
    """(table, key, required) rows of workloads.md's one-job keys table; a blank table cell repeats the last."""
    text = (ROOT / "docs" / "workloads.md").read_text()
    section = text[text.index("### Keys"):text.index("### Lengths")]
    rows, table = [], ""
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[1].startswith("`"):
            continue
        table = cells[0] or table
        rows.append((table.strip("`[]"), cells[1].strip("`"), cells[3] == "yes" or cells[3].startswith("when")))
    return rows


def test_the_workload_page_example_is_a_workload_and_its_keys_table_says_what_is_required():
    """docs/workloads.md's example parses, every key it lists is one the parser knows, a key marked required
    is refused when missing (naming the key), and one marked optional may be left out."""
    import tomllib

    from pipeline.sim.workload import WorkloadError, parse_workload

    example = tomllib.loads(_workload_doc_blocks()[0])
    parse_workload(example, "example")
    rows = _keys_table()
    assert len(rows) == 22
    for table, key, required in rows:
        doc = tomllib.loads(_workload_doc_blocks()[0])
        where = doc if table == "top" else (doc["phase"][0] if table == "phase" else doc[table])
        assert key in where, (table, key)       # the example shows every key the table lists
        del where[key]
        if table == "reward" and key == "cpu_workers":
            doc["reward"]["gpu"] = False
        if required:
            try:
                parse_workload(doc, "example")
            except WorkloadError as exc:
                assert key in str(exc), (table, key, str(exc))
            else:
                raise AssertionError(f"[{table}] {key} is marked required but a workload without it parses")
        else:
            parse_workload(doc, "example")
    # and a key the table does not list is refused
    doc = tomllib.loads(_workload_doc_blocks()[0])
    doc["cluster"]["gpu"] = 8
    try:
        parse_workload(doc, "example")
    except WorkloadError as exc:
        assert "unknown key 'gpu'" in str(exc)
    else:
        raise AssertionError("a misspelt key parsed")


def test_the_workload_page_multi_job_example_runs_as_a_pool_with_the_defaults_it_states():
    """The [[jobs]] example, with the shared tables of the one-job example, parses, and a job that leaves
    out min_gpus, max_gpus, priority and name gets the defaults the page states."""
    import tomllib

    from pipeline.sim.workload import parse_workload

    one, multi = (tomllib.loads(b) for b in _workload_doc_blocks())
    doc = {k: one[k] for k in ("cluster", "rollout", "reward", "learner")} | multi
    second = {k: v for k, v in multi["jobs"][0].items() if k not in ("name", "min_gpus", "max_gpus", "priority")}
    doc["jobs"].append(second)
    wl = parse_workload(doc, "example")
    a, b = wl.jobs
    assert (a.name, a.min_gpus, a.max_gpus, a.priority) == ("reasoning", 16, 48, 1)
    assert (b.name, b.min_gpus, b.max_gpus, b.priority) == ("job1", 0, None, None)
