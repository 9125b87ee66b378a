"""The import layers: config -> core (speculative) -> drafts / learner / router / telemetry ->
deployments -> the CLI and the bench, with no import back up, and no circle between modules.
Imports inside functions count: a lazy import is still an arrow between layers."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file)."""
    files = {_module(p): p for pkg in ALLOWED for p in (ROOT / pkg).rglob("*.py")}
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


def test_no_package_imports_a_layer_above_it():
    bad = sorted(f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
                 if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]])
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_import_circle_between_modules():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
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
                circles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_what_the_ingress_receives_from_the_router_unpickles_without_the_router():
    """The ingress unpickles each ``Route`` the router answers: that must import the light
    ``router.route`` only, not ``router.router`` with scikit-learn and SciPy behind it (a second of
    imports on the first request, and their memory in the ingress for good)."""
    import pickle
    import subprocess
    import sys

    from router.router import Route

    blob = pickle.dumps(Route("c3/en", "en", "general", 0.8, "cluster"))
    probe = ("import pickle, sys; r = pickle.loads(sys.stdin.buffer.read()); "
             "print(r.draft_id, sorted(m for m in ('router.router', 'sklearn', 'scipy', 'numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], input=blob, capture_output=True, cwd=ROOT, check=True)
    assert out.stdout.decode().split() == ["general", "[]"], out
