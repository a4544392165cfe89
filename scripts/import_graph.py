#!/usr/bin/env python3
"""The project's import graph: modules, loops, layers and forbidden arrows.

Parses every module under `pipeline/` and `workers/` with `ast` (no code is
imported or run), follows the imports between them, deferred imports inside
functions included, and checks the layout rules of `docs/architecture.md`.
`tests/test_imports.py` runs the same checks; this script prints the figures:

    python scripts/import_graph.py            # counts, loops, layers, forbidden arrows
    python scripts/import_graph.py --json     # the same as JSON
    python scripts/import_graph.py --edges    # every arrow, one per line

It exits 1 when there is a loop or a forbidden arrow.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "workers")

# The planes, by module prefix; a module belongs to the longest prefix it starts with.
PLANES = {
    "common": ("pipeline", "pipeline.config", "pipeline.logs", "pipeline.manifest"),
    "dataplane": ("pipeline.dataplane",),
    "control": ("pipeline.control",),
    "observe": ("pipeline.observe",),
    "sim": ("pipeline.sim",),
    "workers": ("workers",),
    "top": ("pipeline.cli", "pipeline.run", "pipeline.chaos", "pipeline.verify_resume", "pipeline.experiment",
            "pipeline.bench_rollout"),
}

# What each plane may import besides itself (see docs/architecture.md). Arrows point down:
#   top -> sim -> observe -> control -> dataplane -> common;  workers -> dataplane, common, observe's probes.
# control/ reaches the worker modules only through the agent's command table, which names them as
# strings for `python -m` and never imports them.
ALLOWED = {
    "common": {"common"},
    "dataplane": {"common"},
    "control": {"dataplane", "common"},
    "observe": {"control", "dataplane", "common"},
    "sim": {"observe", "control", "dataplane", "common"},
    "workers": {"observe", "dataplane", "common"},
    "top": {"sim", "observe", "control", "dataplane", "common", "workers"},
}
# Planes a module must not load even through others: a worker process never imports the control plane.
NEVER_REACHES = {"workers": {"control", "sim"}}
# Modules that no other module may import: the command line is the top of the house.
ENTRY_ONLY = {"pipeline.cli"}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            modules[module_name(path, root)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that `name` names or lies inside."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_package(mod: str, modules: dict[str, Path]) -> bool:
    return modules[mod].name == "__init__.py"


def imports_of(mod: str, modules: dict[str, Path]) -> list[Edge]:
    """Every project module that `mod` imports, with the line of the import."""
    tree = ast.parse(modules[mod].read_text(), filename=str(modules[mod]))
    package = mod if _is_package(mod, modules) else mod.rpartition(".")[0]
    edges = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import submodule` imports the submodule; `from mod import name` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        for target in targets:
            dst = _resolve(target, modules)
            if dst is not None and dst != mod:
                edges.append(Edge(mod, dst, node.lineno))
    return edges


def build_graph(root: Path = ROOT) -> tuple[dict[str, Path], list[Edge]]:
    modules = find_modules(root)
    edges = [e for mod in modules for e in imports_of(mod, modules)]
    return modules, edges


def _adjacency(modules, edges) -> dict[str, set[str]]:
    adj: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        adj[e.src].add(e.dst)
    return adj


def strongly_connected(modules, edges) -> list[list[str]]:
    """Tarjan's components, iteratively (the graph is small, recursion would do, but why risk it)."""
    adj = _adjacency(modules, edges)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(adj):
        if start in index:
            continue
        work = [(start, iter(sorted(adj[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(adj[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def loops(modules, edges) -> list[list[str]]:
    """The import loops: every strongly connected component of more than one module."""
    return sorted((c for c in strongly_connected(modules, edges) if len(c) > 1), key=lambda c: (-len(c), c))


def layers(modules, edges) -> dict[str, int]:
    """Each module's layer: 0 imports nothing of ours, n imports at most layer n-1 (loops collapsed)."""
    components = strongly_connected(modules, edges)
    comp_of = {m: i for i, c in enumerate(components) for m in c}
    adj = _adjacency(modules, edges)
    depth: dict[int, int] = {}
    # Tarjan emits components in reverse topological order: dependencies first.
    for i, component in enumerate(components):
        below = {comp_of[d] for m in component for d in adj[m]} - {i}
        depth[i] = 1 + max((depth[j] for j in below), default=-1)
    return {m: depth[comp_of[m]] for m in modules}


def plane_of(mod: str) -> str:
    best, plane = -1, "other"
    for name, prefixes in PLANES.items():
        for prefix in prefixes:
            if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > best:
                best, plane = len(prefix), name
    return plane


def forbidden_arrows(edges: list[Edge]) -> list[tuple[Edge, str]]:
    """Arrows that break a rule: into the CLI, or from a plane to one it may not import."""
    bad = []
    for e in edges:
        src, dst = plane_of(e.src), plane_of(e.dst)
        if e.dst in ENTRY_ONLY:
            bad.append((e, "no module imports the CLI"))
        elif src != dst and dst not in ALLOWED.get(src, set()):
            bad.append((e, f"{src} may import only {', '.join(sorted(ALLOWED.get(src, ()))) or 'nothing'}"))
    return bad


def reaches(modules, edges) -> dict[str, set[str]]:
    """Every module each module loads, directly or through others.

    Loading a module first runs its parent packages' ``__init__``: those
    count as loaded too (not as arrows, which would make every package and
    its modules a loop).
    """
    adj = _adjacency(modules, edges)
    out = {}
    for start in modules:
        seen, todo = set(), [start, *_parents(start, modules)]
        while todo:
            for nxt in adj[todo.pop()]:
                for m in (nxt, *_parents(nxt, modules)):
                    if m not in seen:
                        seen.add(m)
                        todo.append(m)
        out[start] = seen - {start}
    return out


def _parents(mod: str, modules) -> list[str]:
    """The packages above ``mod`` that are modules of the graph (``a.b.c``: ``a.b``, ``a``)."""
    parts = mod.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in modules]


def forbidden_reach(modules, edges) -> list[str]:
    """Modules of a plane that load, through any chain, a plane they must never load."""
    bad = []
    for mod, loaded in sorted(reaches(modules, edges).items()):
        banned = NEVER_REACHES.get(plane_of(mod), set())
        hits = sorted(m for m in loaded if plane_of(m) in banned)
        if hits:
            bad.append(f"{mod} loads {', '.join(hits)}")
    return bad


def summary(root: Path = ROOT) -> dict:
    modules, edges = build_graph(root)
    found = loops(modules, edges)
    layer = layers(modules, edges)
    bad = forbidden_arrows(edges)
    return {
        "forbidden_reach": forbidden_reach(modules, edges),
        "modules": len(modules),
        "edges": len({(e.src, e.dst) for e in edges}),
        "layers": 1 + max(layer.values(), default=-1),
        "loops": len(found),
        "modules_in_loops": sum(len(c) for c in found),
        "loop_members": found,
        "forbidden": [f"{e.src} -> {e.dst} (line {e.line}): {why}" for e, why in bad],
        "by_layer": {str(n): sorted(m for m, k in layer.items() if k == n)
                     for n in sorted(set(layer.values()))},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--edges", action="store_true", help="print every import arrow")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository to read (default: this one)")
    args = ap.parse_args(argv)
    s = summary(args.root)
    if args.edges:
        _, edges = build_graph(args.root)
        for src, dst in sorted({(e.src, e.dst) for e in edges}):
            print(f"{src} -> {dst}")
    elif args.json:
        print(json.dumps(s, indent=2))
    else:
        print(f"modules: {s['modules']}  import arrows: {s['edges']}  layers: {s['layers']}  "
              f"loops: {s['loops']} ({s['modules_in_loops']} modules)")
        for component in s["loop_members"]:
            print("  loop: " + " <-> ".join(component))
        for line in s["forbidden"]:
            print("  forbidden: " + line)
        for line in s["forbidden_reach"]:
            print("  forbidden reach: " + line)
        for n, members in s["by_layer"].items():
            print(f"  layer {n}: {', '.join(members)}")
    return 1 if s["loops"] or s["forbidden"] or s["forbidden_reach"] else 0


if __name__ == "__main__":
    sys.exit(main())
