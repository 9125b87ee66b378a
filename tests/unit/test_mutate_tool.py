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
