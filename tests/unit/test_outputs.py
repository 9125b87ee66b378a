"""What an engine replica keeps besides its engines (``drafts.outputs``), hand-made cases without
Ray or models: kept outputs bounded per draft and in drafts, whose they are, the outbox, a
tenant's deletion; published weights kept by version and bounded beyond the loaded drafts."""

from __future__ import annotations

import numpy as np

from drafts.outputs import KeptOutputs, PublishedWeights


def test_kept_outputs_are_bounded_per_draft_and_in_drafts_least_recently_used_first():
    kept = KeptOutputs(max_requests=2, max_scopes=2, max_owners=100)
    for i in range(3):
        kept.finished("d1", f"x{i}", "code", [i, i + 1], "alice")
    assert [item[0] for item in kept.of("d1")] == ["x1", "x2"]
    assert kept.of("d1")[0][2].dtype == np.int32 and kept.of("d1")[0][2].tolist() == [1, 2]
    kept.finished("d2", "y", "sql", [5])
    kept.finished("d1", "x3", "code", [6])  # d1 used again: d2 is now the least recently used
    kept.finished("d3", "z", "chat", [7])
    assert list(kept.served) == ["d1", "d3"] and kept.of("d2") == []
    assert [t[:2] for t in kept.all()] == [("d1", "x2"), ("d1", "x3"), ("d3", "z")]
    assert kept.outbox == []  # nothing shared: no peers


def test_shared_outputs_wait_in_the_outbox_the_newest_when_peers_are_gone():
    kept = KeptOutputs(max_requests=2, max_scopes=4, max_owners=100)
    for i in range(3):
        kept.finished("d", f"x{i}", "s", [i], "bob", share=True)
    assert [item[1] for item in kept.outbox] == ["x1", "x2"]
    batch = kept.take_outbox()
    assert [item[:2] for item in batch] == [("d", "x1"), ("d", "x2")] and kept.outbox == []
    kept.remember("d", ("from-peer", "s", np.array([9], dtype=np.int32), "carol"))  # received: kept, not re-sent
    assert kept.outbox == [] and kept.of("d")[-1][0] == "from-peer"


def test_a_tenants_deletion_reaches_kept_outputs_the_outbox_and_the_owners_of_tree_only_outputs():
    kept = KeptOutputs(max_requests=8, max_scopes=4, max_owners=3)
    kept.finished("d", "al1", "s", [1], "alice", share=True)
    kept.finished("d", "bo1", "s", [2], "bob", share=True)
    kept.own("al2", "alice")  # served by a draft without kept outputs: only its suffix trees hold it
    kept.finished("e", "al3", "s", [3], "alice")
    assert list(kept.owners) == ["bo1", "al2", "al3"]  # max_owners 3: the oldest owner forgotten
    removed, ids = kept.forget_tenant("alice")
    assert removed == 2 and ids == {"al2", "al3"}  # al1's owner was forgotten, its kept output not
    assert [t[1] for t in kept.all()] == ["bo1"] and [item[1] for item in kept.outbox] == ["bo1"]
    assert "alice" not in kept.owners.values()


def test_published_weights_keep_the_newest_version_and_few_drafts_beyond_the_loaded_ones():
    loaded = {"a"}
    pub = PublishedWeights(keep=2, loaded=lambda d: d in loaded)
    assert pub.offer("a", {"w": 1}, 2) and pub.version("a") == 2
    assert not pub.offer("a", {"w": 0}, 1) and pub.get("a") == ({"w": 1}, 2)  # older: ignored
    assert not pub.offer("a", {"w": 2}, 2)  # the same version again: ignored
    assert pub.offer("b", {}, 1) and pub.offer("c", {}, 1)  # beyond keep: b, not loaded, published longest ago, goes
    assert list(pub.weights) == ["a", "c"] and pub.version("b") == 0 and pub.get("b") is None
    loaded |= {"c", "d"}
    assert pub.offer("d", {}, 3)  # all loaded: kept beyond the bound
    assert list(pub.weights) == ["a", "c", "d"]
