"""The mutation tool's bookkeeping across runs: a re-run of an earlier run's survivors must find
each survivor again, even where a line holds several mutants that read the same."""

from tools.mutate import _occurrence


def test_mutants_alike_in_text_are_told_apart_by_their_order():
    like = dict(file="telemetry/hub.py", function="Hub.stats", before='{"alpha": v[1] / v[0] if v[0] else None}',
                kind="index+1", after="v[0] -> v[0 + 1]")
    earlier: dict = {}
    killed, survived = {**like, "status": "killed"}, {**like, "status": "survived"}
    _occurrence(killed, earlier)
    _occurrence(survived, earlier)
    now: dict = {}
    assert earlier[_occurrence(dict(like), now)]["status"] == "killed"  # the first of them now is the first then
    assert earlier[_occurrence(dict(like), now)]["status"] == "survived"
    assert _occurrence({**like, "before": "another line"}, now)[-1] == 0


def test_the_equivalent_mutants_are_data_each_with_its_file_function_line_and_reason():
    from tools.mutate import EQUIVALENT_FILE, ROOT, Mutant, _equivalent, load_equivalent

    known = load_equivalent(EQUIVALENT_FILE)
    assert len(known) > 100 and all(len(k) in (3, 4) and why.strip() for k, why in known.items())
    assert all((ROOT / k[0]).exists() for k in known)  # every entry names a file of the tree
    (file, function, line, *form), _ = next((k, w) for k, w in known.items() if len(k) == 4)
    other = dict(file=file, function=function, line=1, before=line, kind="k", status="survived")
    assert _equivalent(Mutant(**other, after=form[0]))  # that mutated form of the line
    assert not _equivalent(Mutant(**other, after=form[0] + " (another form)"))
