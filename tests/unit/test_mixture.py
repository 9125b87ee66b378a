"""The mixture experiment on the tiny engine with the real router features (MiniLM + py3langid):
per-domain drafts are forked and trained, routes are recorded, every method serves the same stream."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from workloads import WorkloadRecord
from config import RouterConfig
from drafts.build import truncated_draft
from learner.trainer import LearnerConfig

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SQL = ["Write the SQL query: how many singers are there?", "Write the SQL query: list the names of all stadiums.",
       "Write the SQL query: count the concerts in 2014.", "Write the SQL query: show the average age of singers.",
       "Write the SQL query: which stadium has the most concerts?", "Write the SQL query: list all song names.",
       "Write the SQL query: show name and country of every singer.", "Write the SQL query: the oldest singer's age."]
EN = ["Hello, how are you today?", "What is artificial intelligence?", "Do you have feelings of your own?",
      "What is your favourite colour?", "I really like classical music.", "Where do you live right now?",
      "Good morning, how is work going?", "Can you tell me a short joke?"]
ES = ["Hola, ¿cómo estás hoy?", "¿Qué es la inteligencia artificial?", "¿Tienes sentimientos propios?",
      "¿Cuál es tu color favorito?", "Me gusta mucho la música clásica.", "¿Dónde vives ahora mismo?",
      "Buenos días, ¿qué tal el trabajo?", "¿Puedes contarme un chiste corto?"]


def _recs(texts, domain, lang, tag):
    return [WorkloadRecord(t + tag, domain, lang, "test") for t in texts]


@pytest.fixture(scope="module")
def extractor():
    from router.features import FeatureExtractor

    return FeatureExtractor(RouterConfig())


def test_mixture_forks_per_domain_drafts_and_serves_every_record(target, make_engine, draft_proposer, extractor, tmp_path):
    from bench.mixture import format_mixture, label_of, mixed_stream, plot_mixture, run_mixture

    start = truncated_draft(target, 1)

    def factory():
        return make_engine(draft_proposer(copy.deepcopy(start)), k=3)

    # chat in Spanish is its own mode, apart from chat in English
    stream = _recs(SQL[:6], "sql", "en", "") + _recs(EN[:6], "chat", "en", "") + _recs(ES[:6], "chat", "es", "")
    train = (_recs(SQL, "sql", "en", " (train)") + _recs(EN, "chat", "en", " (train)") + _recs(ES, "chat", "es", " (train)")
             + stream[:2])  # overlap is dropped
    lcfg = LearnerConfig(train_every=3, batch_records=4, steps_per_round=2, lr=1e-3, holdout_fraction=0.0, positions="all")
    rcfg = RouterConfig(spawn_min_records=3, spawn_window=20, spawn_alpha=1.0, spawn_min_tokens=1, min_cluster_size=2)
    res = run_mixture(factory, stream, train, lcfg, rcfg, n_per_label=6, max_tokens=6, k=3, window=4,
                      extractor=extractor, log=None)
    assert res["labels"] == {"sql": 6, "chat/en": 6, "chat/es": 6} and res["train_records"] == 24
    m = res["methods"]
    for e in m.values():
        assert [r["label"] for r in e["rows"]] == [label_of(r) for r in mixed_stream(stream, 6, 0)]
        assert e["rounds"] == 18 // 3
    assert m["single"]["drafts_final"] == ["general"] and not m["single"]["spawned"]
    sup = m["supervised"]
    assert {s["domain"] for s in sup["spawned"]} == {"sql", "chat", "chat/es"}
    # a domain's own draft serves its queries (beside the general one, which the bandit may pick
    # too: here the forks are equally useless) and never the other domain's
    # (the "chat" draft may also serve chat/es, its sub-domain, when the bandit finds it better)
    for dom, must, may in (("sql", "sql", {"sql"}), ("chat", "chat/en", {"chat/en", "chat/es"}), ("chat/es", "chat/es", {"chat/es"})):
        served = {r["label"] for r in sup["rows"] if r["draft"] == f"d:{dom}"}
        assert must in served and served <= may, (dom, served)
    assert m["clusters"]["spawned"], m["clusters"]["router"]  # spawn_alpha 1.0: every busy cluster gets a draft
    assert "supervised" in format_mixture(res)
    assert plot_mixture(res, tmp_path / "m.png").stat().st_size > 0


def test_unknown_method_rejected(extractor):
    from bench.mixture import run_mixture

    with pytest.raises(ValueError):
        run_mixture(lambda: None, _recs(SQL, "sql", "en", ""), [], methods=["bogus"], extractor=extractor, log=None)


def test_mixture_with_the_controller_drafts_from_each_drafts_suffix_tree(target, make_engine, draft_proposer, extractor):
    """--controller: every routed draft runs beside a suffix tree of its own; a stream that repeats
    its queries gets them drafted from the first answers, and alpha counts those steps."""
    from bench.mixture import run_mixture

    start = truncated_draft(target, 1)

    def factory():
        return make_engine(draft_proposer(copy.deepcopy(start)), k=3)

    stream = _recs(SQL[:4], "sql", "en", "") * 2
    lcfg = LearnerConfig(train_every=4, batch_records=4, steps_per_round=1, lr=1e-3, holdout_fraction=0.0, positions="all")
    res = run_mixture(factory, stream, [], lcfg, RouterConfig(), methods=["single"], n_per_label=None, max_tokens=8,
                      k=3, window=4, extractor=extractor, log=None, controller=True)
    rows = res["methods"]["single"]["rows"]
    assert res["controller"] and len(rows) == 8
    assert sum(r["accepted"] for r in rows[4:]) > sum(r["accepted"] for r in rows[:4])
