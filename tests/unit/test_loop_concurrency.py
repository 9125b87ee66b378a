"""`python -m bench.loop_concurrency`'s level: clients driving the engine replica's class in this
process at a concurrency, on the tiny model. Its outputs do not depend on the concurrency (greedy,
continuous batching is lossless), and what it reports of the target's forwards adds up."""

from __future__ import annotations

import pytest

from bench.loop_concurrency import _level
from inprocess import LocalPool, app_config, save_tiny_model
from router.router import GENERAL

TEXTS = ["one two three four", "def f(x): return", "select name from users where", "hello there my friend",
         "a b c d e f g", "the quick brown fox"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, make_llama, make_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), make_llama, make_tokenizer)


def test_a_level_reports_its_forwards_and_concurrency_changes_no_output(folder, loop):
    pool = LocalPool(app_config(folder, quantize="int4"))  # the engine loop over the pooled fast path
    try:
        engine = loop.run(pool.engine_for(GENERAL))
        one = loop.run(_level(pool, engine, TEXTS, 1, 8))
        three = loop.run(_level(pool, engine, TEXTS, 3, 8))
    finally:
        pool.loop.stop()
    assert one["outputs"] == three["outputs"] and all(one["outputs"])
    assert one["output_tokens"] == sum(len(o) for o in one["outputs"])
    for level in (one, three):
        log = level["forward_log"]
        assert level["forwards"] == len(log) > 0
        assert level["seqs_per_forward"] == pytest.approx(sum(s for s, _, _ in log) / len(log))
        assert level["tokens_per_forward"] == pytest.approx(sum(t for _, t, _ in log) / len(log))
        assert 0 < level["target_share_of_wall"] <= 1
    assert max(s for s, _, _ in one["forward_log"]) == 1  # one client: one sequence a forward
    assert max(s for s, _, _ in three["forward_log"]) > 1  # three: forwards shared
