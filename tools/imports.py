"""``python -m tools.imports``: the project's import graph by layer, and its import circles.

The layers read config -> core (``speculative``) -> drafts / learner / router / telemetry ->
deployments -> the CLI and the bench, with no import back up (:data:`ALLOWED`). Imports inside
functions count: a lazy import is still an arrow between layers. Prints each package's arrows
(``--modules``: each module's), the imports against the layers and the circles between modules;
``--dot`` writes the package graph for Graphviz. ``tests/unit/test_layers.py`` keeps both lists
empty."""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: each package and the packages it may import (its own always)
ALLOWED = {
    "config": set(),
    "workloads": set(),
    "speculative": {"config"},
    "telemetry": {"config"},
    "router": {"config", "workloads"},
    "drafts": {"config", "speculative"},
    "learner": {"config", "speculative", "drafts", "workloads"},
    "deployments": {"config", "speculative", "drafts", "learner", "router", "telemetry", "workloads"},
    "bench": {"config", "speculative", "drafts", "learner", "router", "telemetry", "workloads", "deployments"},
    "osd": {"config", "speculative", "drafts", "learner", "router", "telemetry", "workloads", "deployments", "bench"},
}


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file)."""
    files = {_module(p, root): p for pkg in ALLOWED for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # the longest prefix that is a project module
                    name = name.rpartition(".")[0]
                if name and name != mod and name.split(".")[0] in ALLOWED:
                    graph[mod].add(name)
    return graph


def against_layers(graph: dict[str, set[str]]) -> list[str]:
    """The imports from a package to one its layer may not import: ``a -> b``."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other, directly or around a circle (Tarjan's strongly connected
    components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the other packages its modules import."""
    out: dict[str, set[str]] = {p: set() for p in ALLOWED}
    for a, targets in graph.items():
        out[a.split(".")[0]] |= {b.split(".")[0] for b in targets} - {a.split(".")[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.imports", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", action="store_true", help="each module's imports, not each package's")
    ap.add_argument("--dot", default=None, help="write the package graph here (Graphviz dot)")
    args = ap.parse_args(argv)
    graph = import_graph()
    shown = graph if args.modules else packages(graph)
    for name in sorted(shown):
        print(f"{name} -> {', '.join(sorted(shown[name])) or '(nothing of the project)'}")
    bad, loops = against_layers(graph), circles(graph)
    print(f"\n{len(graph)} modules; imports against the layers: {len(bad)}; import circles: {len(loops)}")
    for line in bad + [" <-> ".join(c) for c in loops]:
        print("  " + line)
    if args.dot:
        edges = "".join(f'  "{a}" -> "{b}";\n' for a, bs in sorted(packages(graph).items()) for b in sorted(bs))
        Path(args.dot).write_text(f"digraph imports {{\n  rankdir=LR;\n{edges}}}\n")
        print(f"wrote {args.dot}")
    return 1 if bad or loops else 0


if __name__ == "__main__":
    raise SystemExit(main())
