"""Open-set routing on the real MiniLM: a named domain only for queries that resemble it.

The router is trained on the shipped labelled examples of some sources only (bench/data/
router_train.jsonl) and judged on records of other sources and of domains no label names
(bench/data/open.jsonl), as ``osd route --open`` does at full size. The typicality check itself
is tested on synthetic embeddings, where the held-out rates are known."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from config import RouterConfig
from router import GENERAL, Router
from router.cli import _outcome, open_set_report
from router.domains import DomainClassifier
from workloads import WorkloadRecord, load_workload

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"
#: the sources the router is trained on here; the others of router_train / open are never seen
TRAIN_SOURCES = {"python-stdlib", "codeio", "spider-dev", "champ", "gsm-symbolic", "chatterbot", "alice"}
PER_SOURCE = 80


def _by_source(records, per: int) -> dict[str, list[WorkloadRecord]]:
    out: dict[str, list[WorkloadRecord]] = {}
    for r in records:
        src = r.source.split(":")[0]
        if len(out.setdefault(src, [])) < per:
            out[src].append(r)
    return out


@pytest.fixture(scope="module")
def train() -> list[WorkloadRecord]:
    by = _by_source(load_workload(DATA / "router_train.jsonl"), PER_SOURCE)
    return [r for s, rs in by.items() if s in TRAIN_SOURCES for r in rs]


@pytest.fixture(scope="module")
def held_out() -> dict[str, list[WorkloadRecord]]:
    """Ten records of each source or kind of the open file (never in router_train)."""
    return _by_source(load_workload(DATA / "open.jsonl"), 10)


def _router(extractor, train, **cfg) -> Router:
    return Router(RouterConfig(**cfg), extractor).fit([r.text for r in train], [r.domain for r in train])


def _outcomes(router, records) -> Counter:
    return Counter(_outcome(x) for x in router.route_batch([r.text for r in records]))


def test_a_new_source_of_a_named_domain_is_still_routed_to_it(extractor, train, held_out):
    """HumanEval prompts and DB-GPT's text-to-SQL format were never trained on: code / sql."""
    router = _router(extractor, train)
    for source, domain in (("humaneval", "code"), ("dbgpt-example", "sql")):
        went = _outcomes(router, held_out[source])
        assert went[domain] >= 9, (source, went)


def test_unnamed_domains_go_to_clusters_not_to_chat(extractor, train, held_out):
    router = _router(extractor, train)
    for kind in ("verne-2889", "quotes", "words"):  # fiction, quotes, spelling questions
        went = _outcomes(router, held_out[kind])
        assert went["cluster"] >= 7, (kind, went)


def test_without_the_typicality_check_chat_takes_them(extractor, train, held_out):
    """The same router with no open domain: its logistic regression calls that traffic chat (the
    check above is what sends it to clusters), while in-domain chat is routed the same way."""
    router = _router(extractor, train, open_domains=())
    went = _outcomes(router, held_out["verne-2889"] + held_out["quotes"])
    assert went["chat"] >= 12, went
    assert _outcomes(router, held_out["alice"])["chat"] >= 9


def test_in_domain_chat_still_named(extractor, train):
    """Unseen chatterbot queries (in the workload, not in router_train) stay chat mostly."""
    chat = [r for r in load_workload(DATA / "workload.jsonl") if r.source.startswith("chatterbot")]
    went = _outcomes(_router(extractor, train), chat)
    assert went["chat"] >= 0.7 * len(chat), went


def test_a_cluster_keeps_the_named_draft_among_its_candidates(extractor, train, held_out):
    """A query the classifier calls chat but finds atypical goes to a cluster, served first by the
    chat draft (the bandit then compares it with the general draft by acceptance)."""
    router = _router(extractor, train)
    router.register_draft("d:chat", "chat")
    routes = router.route_batch([r.text for r in held_out["quotes"]])
    atypical = [x for x in routes if x.topic == "chat" and x.cluster is not None]
    assert atypical, [(x.topic, x.domain) for x in routes]
    assert all(x.draft_id == "d:chat" and x.typicality < router.classifier.thresholds["chat"] for x in atypical)
    assert "d:chat" in router.candidates("chat") and GENERAL in router.candidates(atypical[0].domain)


def test_supervised_mode_falls_back_for_atypical_queries(extractor, train, held_out):
    router = _router(extractor, train, mode="supervised")
    routes = router.route_batch([r.text for r in held_out["verne-2889"]])
    fallback = [x for x in routes if x.reason.startswith("fallback: atypical of chat")]
    assert len(fallback) >= 7 and all(x.draft_id == GENERAL for x in fallback)


def test_classifier_state_round_trips(extractor, train, tmp_path):
    router = _router(extractor, train)
    router.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r", extractor)
    assert loaded.classifier.thresholds == router.classifier.thresholds
    texts = ["What did Einstein mean by this?", "SELECT name FROM singer", "Hello, how are you?"]
    assert [x.domain for x in loaded.route_batch(texts)] == [x.domain for x in router.route_batch(texts)]


# ---------------------------------------------------------------------- calibration, synthetic


def _cloud(rng, centre: np.ndarray, n: int, spread: float) -> np.ndarray:
    x = centre + spread * rng.standard_normal((n, len(centre)))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("k,q", [(1, 0.2), (5, 0.1)])
def test_threshold_is_calibrated_on_held_out_examples(k, q):
    """Fresh draws of a label's distribution are called atypical at about the configured rate
    (a threshold from the training examples themselves would call almost all of them atypical
    with k=1); draws of another region almost always."""
    rng = np.random.default_rng(0)
    d = 32
    a, b, far = (np.eye(d)[i] for i in range(3))
    X = np.concatenate([_cloud(rng, a, 400, 0.15), _cloud(rng, b, 400, 0.15)])
    y = ["a"] * 400 + ["b"] * 400
    clf = DomainClassifier(typical_k=k, typical_quantile=q).fit(X, y)
    fresh = _cloud(rng, a, 4000, 0.15)
    rate = 1 - np.mean([clf.typical("a", s) for s in clf.typicality(fresh, ["a"] * len(fresh))])
    n_train = 400 * (1 - 1 / 5)  # each fold is scored against 4/5 of the examples
    assert abs(rate - q) < 0.05, (rate, q, n_train)
    outside = _cloud(rng, 0.6 * a + 0.8 * far, 500, 0.15)
    assert np.mean([clf.typical("a", s) for s in clf.typicality(outside, ["a"] * 500)]) < 0.05


def test_typicality_is_the_mean_of_the_k_nearest():
    ex = np.eye(4, dtype=np.float32)
    clf = DomainClassifier(typical_k=2, typical_quantile=0.0)
    clf.fit(np.concatenate([ex, -ex]), ["p"] * 4 + ["n"] * 4)
    q = np.array([[0.8, 0.6, 0.0, 0.0]], dtype=np.float32)
    assert clf.typicality(q, ["p"])[0] == pytest.approx(0.7)  # (0.8 + 0.6) / 2
    assert clf.typicality(q, ["n"])[0] == pytest.approx(0.0)  # its nearest two "n" are at 0


# ---------------------------------------------------------------------- osd route's report


def test_open_set_report_on_a_small_pool(extractor):
    rd = load_workload(DATA / "router_train.jsonl")
    op = load_workload(DATA / "open.jsonl")
    by, ob = _by_source(rd, 12), _by_source(op, 6)
    train = [r for s in ("python-stdlib", "codeio", "spider-dev", "champ", "chatterbot") for r in by[s]]
    extra = [r for s in ("humaneval", "gsm-symbolic", "quotes", "verne-2889") for r in ob[s]]
    general = [WorkloadRecord("Write me an essay on the history of print.", "chat", "en", "sharegpt:x")]
    rep = open_set_report(RouterConfig(), extractor, train + general, [], extra, lang_prior=False)  # shared extractor: no prior
    assert set(rep["loso"]) == {"code:codeio", "code:humaneval", "code:python-stdlib", "math:champ",
                                "math:gsm-symbolic"}  # sql and chat have one source here
    assert rep["loso"]["code:humaneval"]["n"] == 6 and set(rep["lodo"]) == {"chat", "code", "math", "sql"}
    assert set(rep["unnamed"]) == {"quotes", "fiction", "general"}  # sharegpt is not trained on
    for v in [*rep["loso"].values(), *rep["lodo"].values(), *rep["unnamed"].values()]:
        assert sum(v["went"].values()) == v["n"]
    assert rep["lodo"]["sql"]["went"].get("sql", 0) == 0  # a router without sql never names it


def test_the_router_deployment_fits_its_examples_at_start(train, held_out, tmp_path):
    """``RouterConfig.examples`` gives the served router its named domains when it starts without a
    saved state (its general sources left out); a saved state wins over it."""
    from deployments.router import RouterServer
    from workloads import save_workload

    examples = tmp_path / "examples.jsonl"
    save_workload(train + [WorkloadRecord("Write an essay on print.", "chat", "en", "sharegpt:1")], examples)
    server = RouterServer(RouterConfig(mode="both", examples=str(examples)), state_dir=str(tmp_path / "state"))
    assert server.router.classifier.classes == ["chat", "code", "math", "sql"]
    assert len(server.router.classifier.examples["chat"]) == sum(r.domain == "chat" for r in train)  # no ShareGPT
    routes = server.router.route_batch([r.text for r in held_out["dbgpt-example"]])
    assert sum(x.domain == "sql" for x in routes) >= 9
    assert not RouterServer(RouterConfig(mode="clusters", examples=str(examples))).router.classifier.fitted
    server.save()
    examples.write_text("")  # a saved router is reloaded, the examples not read again
    again = RouterServer(RouterConfig(mode="both", examples=str(examples)), state_dir=str(tmp_path / "state"))
    assert again.router.t == server.router.t and again.router.classifier.classes == ["chat", "code", "math", "sql"]
