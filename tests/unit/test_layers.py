"""The import layers: config -> core (speculative) -> drafts / learner / router / telemetry ->
deployments -> the CLI and the bench, with no import back up, and no circle between modules.
Imports inside functions count: a lazy import is still an arrow between layers."""

from __future__ import annotations

from tools.imports import ROOT, against_layers, circles, import_graph


def test_no_package_imports_a_layer_above_it():
    bad = against_layers(import_graph())
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_import_circle_between_modules():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_find_a_circle_and_an_import_against_the_layers():
    made = {"speculative.a": {"speculative.b"}, "speculative.b": {"speculative.a"}, "config.x": {"speculative.a"}}
    assert circles(made) == [["speculative.a", "speculative.b"]]
    assert against_layers(made) == ["config.x -> speculative.a"]


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
