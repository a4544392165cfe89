"""The layout rules of docs/architecture.md, read from the source with ``ast`` (scripts/import_graph.py).

No import loops; arrows only from a plane to one below it; a worker process
never loads the control plane, not even through another module; nothing
imports the CLI. The planted-loop tests show the checks fail, and name the
culprits, when a rule is broken.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_checker():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


graph = _load_checker()


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the project's Python sources to plant bad imports in."""
    for pkg in graph.PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return tmp_path


def plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")


def test_the_project_has_no_import_loop():
    modules, edges = graph.build_graph()
    assert graph.loops(modules, edges) == []


def test_every_arrow_points_down_and_none_reaches_the_cli():
    _, edges = graph.build_graph()
    bad = [f"{e.src} -> {e.dst} (line {e.line}): {why}" for e, why in graph.forbidden_arrows(edges)]
    assert bad == []


def test_no_worker_module_loads_the_control_plane_through_another():
    modules, edges = graph.build_graph()
    assert graph.forbidden_reach(modules, edges) == []


def test_every_module_sits_in_a_plane():
    modules, _ = graph.build_graph()
    assert [m for m in modules if graph.plane_of(m) == "other"] == []


def test_a_planted_loop_is_found_and_named(tree):
    plant(tree, "pipeline.dataplane.keys", "from pipeline.dataplane import streams")
    modules, edges = graph.build_graph(tree)
    found = graph.loops(modules, edges)
    assert found == [["pipeline.dataplane.keys", "pipeline.dataplane.streams"]]
    assert graph.summary(tree)["loops"] == 1
    assert graph.main(["--root", str(tree)]) == 1


def test_a_planted_forbidden_arrow_is_named(tree):
    plant(tree, "pipeline.dataplane.streams", "from pipeline.observe.status import job_status")
    plant(tree, "workers.reward", "from pipeline.control.loop import Controller")
    plant(tree, "pipeline.observe.top", "from pipeline.cli import main")
    _, edges = graph.build_graph(tree)
    named = {(e.src, e.dst) for e, _why in graph.forbidden_arrows(edges)}
    assert named == {("pipeline.dataplane.streams", "pipeline.observe.status"),
                     ("workers.reward", "pipeline.control.loop"),
                     ("pipeline.observe.top", "pipeline.cli")}


def test_a_control_plane_module_loaded_through_observe_is_caught(tree):
    # observe -> control is allowed, workers -> observe too; the chain worker -> ... -> control is not
    plant(tree, "workers.learner", "from pipeline.observe.status import job_status")
    modules, edges = graph.build_graph(tree)
    assert graph.forbidden_arrows(edges) == []
    reach = graph.forbidden_reach(modules, edges)
    # the package pipeline.control (its __init__ runs first) and the module
    assert len(reach) == 1 and reach[0].startswith("workers.learner loads pipeline.control, pipeline.control.allocation")


def test_relative_and_package_imports_resolve(tree):
    plant(tree, "pipeline.control.events", "from ..dataplane import keys")
    plant(tree, "pipeline.control.events", "from . import job")
    modules, edges = graph.build_graph(tree)
    arrows = {(e.src, e.dst) for e in edges if e.src == "pipeline.control.events"}
    assert {("pipeline.control.events", "pipeline.dataplane.keys"),
            ("pipeline.control.events", "pipeline.control.job")} <= arrows
