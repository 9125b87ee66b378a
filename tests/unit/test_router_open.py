"""Open-set routing on the real MiniLM: a named domain only for queries that resemble it.

The router is trained on the shipped labelled examples of some sources only (bench/data/
router_train.jsonl) and judged on records of other sources and of domains no label names
(bench/data/open.jsonl), as ``osd route --open`` does at full size. The typicality check itself
is tested on synthetic embeddings, where the held-out rates are known."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from config import RouterConfig
from router.router import GENERAL, Router
from router.cli import _outcome, open_set_report
from router.domains import BACKGROUND, DomainClassifier
from router_settings import router_config
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
    return Router(router_config(**cfg), extractor).fit([r.text for r in train], [r.domain for r in train])


def _outcomes(router, records) -> Counter:
    return Counter(_outcome(x) for x in router.route_batch([r.text for r in records]))


def test_a_new_source_of_a_named_domain_is_still_routed_to_it(extractor, train, held_out):
    """HumanEval prompts and DB-GPT's text-to-SQL format were never trained on: code / sql."""
    router = _router(extractor, train)
    for source, domain in (("humaneval", "code"), ("dbgpt-example", "sql")):
        went = _outcomes(router, held_out[source])
        assert went[domain] >= 8, (source, went)


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


def test_general_traffic_goes_to_a_cluster_served_first_by_the_likeliest_named_draft(extractor):
    """A query the classifier calls general traffic goes to its cluster, and the draft of the
    named domain it is likeliest to be (here code) is its first candidate, as for an atypical
    query: a code request that reads like a general one still starts from the code draft."""
    router = Router(RouterConfig(), extractor)
    router.register_draft("d:code", "code")
    f = extractor.extract(["Write a function that reverses a string."])[0]
    route = router._route_one(f, BACKGROUND, 0.9, None, "code")
    assert route.cluster is not None and route.reason == "cluster" and route.draft_id == "d:code"
    assert router._route_one(f, BACKGROUND, 0.9, None, "chat").draft_id == GENERAL  # chat has no draft here


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
    """The typicality fallback (embeddings only: on these 80 examples a source, the character
    n-grams call some of Verne's paragraphs math)."""
    router = _router(extractor, train, mode="supervised", lexical=False)
    routes = router.route_batch([r.text for r in held_out["verne-2889"]])
    fallback = [x for x in routes if x.reason.startswith("fallback: atypical of chat")]
    assert len(fallback) >= 7 and all(x.draft_id == GENERAL for x in fallback)


def test_classifier_state_round_trips(extractor, train, tmp_path):
    router = _router(extractor, train)
    router.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r", extractor)
    assert loaded.classifier.thresholds == router.classifier.thresholds
    assert loaded.classifier.lexical_model is not None  # the n-gram gate comes back with it
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


def test_a_label_of_one_example_has_no_threshold_and_two_calibrate_on_each_other():
    """One example: nothing held out to calibrate on, every query is typical (-1 is the lowest
    cosine). Two: each is scored against the other (two folds), so the threshold is their cosine,
    and a score at exactly the threshold is typical."""
    u = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    v = np.array([0.6, 0.8, 0.0], dtype=np.float32)  # cos(u, v) = 0.6
    X = np.stack([u, v, -u])
    clf = DomainClassifier(typical_quantile=0.2).fit(X, ["pair", "pair", "single"])
    assert clf.thresholds["single"] == -1.0
    assert clf.thresholds["pair"] == pytest.approx(0.6, abs=1e-6)
    assert clf.typical("pair", clf.thresholds["pair"]) and not clf.typical("pair", clf.thresholds["pair"] - 1e-6)
    assert clf.typical("single", -1.0)  # even the farthest query
    w = np.array([[0.0, 0.0, 1.0]], dtype=np.float32)  # cosine 0 to both pair examples: atypical of it
    assert not clf.typical("pair", float(clf.typicality(w, ["pair"])[0]))
    assert clf.typical("single", float(clf.typicality(w, ["single"])[0]))


def test_lexical_features_name_what_the_embedding_cannot_see():
    """Embeddings that carry nothing (the same random cloud for both labels) and texts that differ
    in their symbols: with the character n-grams the classifier names fresh texts right; without
    them it is at chance."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "theta", "kappa"]
    def text(kind: str) -> str:
        w = " ".join(rng.choice(words, 4))
        return f"def f(x): return x  # {w}" if kind == "code" else f"Let $x = \\frac{{1}}{{2}}$, {w}"
    kinds = ["code", "math"] * 100
    X = _cloud(rng, np.eye(16)[0], len(kinds), 0.5)
    texts = [text(k) for k in kinds]
    fresh = ["code", "math"] * 25
    Xf, tf = _cloud(rng, np.eye(16)[0], len(fresh), 0.5), [text(k) for k in fresh]
    lexical = DomainClassifier(lexical=True).fit(X, kinds, texts)
    assert lexical.predict(Xf, tf)[0] == fresh
    plain = DomainClassifier(lexical=False).fit(X, kinds, texts)
    assert 0.2 < np.mean(np.array(plain.predict(Xf)[0]) == np.array(fresh)) < 0.8
    with pytest.raises(ValueError, match="texts"):
        lexical.predict(Xf)
    # texts with no n-gram in two of them: the embeddings alone, no error
    tiny = DomainClassifier(lexical=True).fit(X[:2], ["code", "math"], ["x", "y"])
    assert tiny.vectorizer is None and tiny.predict(Xf[:1])[0][0] in ("code", "math")
    # the logits summed block by block are sklearn's own probabilities, with two classes and more
    three = DomainClassifier(lexical=True).fit(X, [k if i % 3 else "sql" for i, k in enumerate(kinds)], texts)
    for clf in (lexical, three):
        want = clf.model.predict_proba(clf._features(Xf, tf))
        np.testing.assert_allclose(clf._proba(Xf, tf), want, rtol=1e-4, atol=1e-6)


def test_the_ngrams_are_2_to_4_characters_within_words_seen_in_two_examples():
    """The lexical features: character n-grams of 2-4 characters inside word boundaries, kept when
    at least two examples have them; the gate names a text whose n-gram probability is exactly its
    threshold."""
    rng = np.random.default_rng(7)
    texts = ["select from where", "select rows", "lambda xs", "lambda ys", "qqqqqq zz"]
    kinds = ["sql", "sql", "code", "code", "code"]
    clf = DomainClassifier(lexical=True).fit(_cloud(rng, np.eye(8)[0], 5, 0.5), kinds, texts)
    vocab = set(clf.vectorizer.get_feature_names_out())
    assert {len(g) for g in vocab} == {2, 3, 4}
    assert {" se", "sele", "lamb", "da "} <= vocab  # in two texts, at a word's edge too
    assert not vocab & {"qq", "qqq", "zz", "rows", "row", " xs"}  # in one text only
    assert not any(" " in g.strip() for g in vocab)  # never across two words
    probe = ["select lambda", "lambda"]
    top = clf.lexical_model.predict_proba(clf.vectorizer.transform(probe)).max(axis=1)
    labels, got = clf.sure(probe, float(top[1]), ["sql", "code"])
    np.testing.assert_array_equal(got, top)
    assert labels[1] == "code"  # at exactly the threshold: sure


def test_the_router_classifies_the_text_it_routes(extractor, train, held_out):
    """The features carry the cleaned text, and the router's classifier reads it: the same
    embeddings with the text blanked get other probabilities."""
    from dataclasses import replace

    assert extractor.extract(["  SELECT name\x00FROM singer "])[0].text == "SELECT name FROM singer"
    router = _router(extractor, train)
    feats = extractor.extract([r.text for r in held_out["dbgpt-example"]])
    with_text = router.route_features(feats)
    blank = router.route_features([replace(f, text="") for f in feats])
    assert all(x.topic == "sql" for x in with_text)
    assert all(abs(x.confidence - b.confidence) > 1e-3 for x, b in zip(with_text, blank))


def test_the_ngram_model_is_sure_only_of_the_labels_asked_for_above_the_threshold():
    """``sure``: the n-gram model's label where it is one of ``labels`` at >= ``threshold``, else None."""
    rng = np.random.default_rng(2)
    kinds = ["code", "math", "chat"] * 60
    texts = [{"code": "def f(x): return x[::-1]  # reverse", "math": "Let $x = \\frac{1}{2}$, find $x^2$",
              "chat": "hello there, how are you doing today"}[k] + f" {rng.integers(1000)}" for k in kinds]
    X = _cloud(rng, np.eye(16)[0], len(kinds), 0.5)
    clf = DomainClassifier(lexical=True).fit(X, kinds, texts)
    probe = ["def g(y): return y[::-1]", "Let $y = \\frac{3}{4}$, find $y^2$", "hello, how are you today", "zzzz"]
    labels, p = clf.sure(probe, 0.9, ["code", "math"])
    assert labels[:3] == ["code", "math", None] and p[2] >= 0.9  # chat is sure, but not asked for
    assert clf.sure(probe, 0.999999, ["code", "math"])[0] == [None] * 4
    assert DomainClassifier(lexical=False).fit(X, kinds, texts).sure(probe, 0.9, ["code"])[0] == [None] * 4


def test_the_ngram_gate_routes_clear_topical_queries_without_embedding_them(extractor, train, held_out):
    """Unseen code, SQL and math queries, and unnamed kinds and chat: the queries whose n-grams alone are sure of
    a topical domain are routed there unembedded (the embedder is asked for the others only), to the
    same domain the router without the gate gives them; nothing unnamed, and no chat, is gated;
    ``route_features`` on the full features takes the same decisions as ``route_batch``."""
    topical = held_out["codeio"] + held_out["gsm-symbolic"] + held_out["dbgpt-example"] + held_out["humaneval"]
    other = held_out["quotes"] + held_out["verne-2889"] + held_out["alice"]
    texts = [r.text for r in topical + other]
    gate = _router(extractor, train)
    assert gate.cfg.classifier.lexical_gate == 0.9
    before = extractor.cache_info()
    routes = gate.route_batch(texts)
    after = extractor.cache_info()
    gated = [x.reason == "classifier: n-grams" for x in routes]
    asked = after["hits"] + after["misses"] - before["hits"] - before["misses"]
    assert asked == len(texts) - sum(gated)
    assert sum(gated[: len(topical)]) >= 12 and not any(gated[len(topical):]), gated
    assert all(x.confidence >= 0.9 and x.domain in ("code", "sql", "math") for x, g in zip(routes, gated) if g)
    plain = _router(extractor, train, lexical_gate=None)
    ungated = plain.route_batch(texts)
    assert all(x.reason != "classifier: n-grams" for x in ungated)
    assert [_outcome(x) for x in routes] == [_outcome(x) for x in ungated]  # gated or not, every query
    again = _router(extractor, train).route_features(extractor.extract(texts))
    assert [(x.domain, x.reason) for x in again] == [(x.domain, x.reason) for x in routes]
    # a gated query is routed by its label, so the gate is never below the confidence threshold
    strict_router = _router(extractor, train, confidence_threshold=0.99)
    before = extractor.cache_info()
    strict = strict_router.route_batch(texts)
    after = extractor.cache_info()
    strict_gated = sum(x.reason == "classifier: n-grams" for x in strict)
    assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == len(texts) - strict_gated
    assert all(x.confidence >= 0.99 for x in strict if x.reason == "classifier: n-grams")
    assert strict_gated < sum(gated)


def test_arithmetic_without_letters_goes_to_math_when_its_ngrams_are_sure(extractor, train):
    """A text without letters falls back to the general draft, unless the n-gram gate is sure of a
    topical domain: LaTeX arithmetic drills (mathgenerator, trained on; the routed ones unseen) are
    math, digits or emoji alone are not."""
    mathgen = [r for r in load_workload(DATA / "router_train.jsonl") if r.source.startswith("mathgenerator")]
    drills = [r for r in mathgen if not any(c.isalpha() for c in r.text)]
    assert len(drills) >= 5
    router = _router(extractor, train + mathgen[:PER_SOURCE] + drills)
    fresh = [r.text for r in load_workload(DATA / "open.jsonl") if not any(c.isalpha() for c in r.text)]
    routes = router.route_batch(fresh)
    assert sum(x.domain == "math" and x.reason == "classifier: n-grams" and x.lang == "und" for x in routes) >= 3, routes
    others = router.route_batch(["12345", "\U0001f642\U0001f642", "", "!!!"])
    assert [x.reason for x in others] == ["fallback: no letters"] * 2 + ["fallback: empty text", "fallback: no letters"]
    assert all(x.draft_id == GENERAL for x in others)


def test_background_examples_like_a_topical_domain_are_dropped():
    """General traffic holds requests of the named topical domains: those background examples a
    classifier of the named examples gives to a topical label are dropped, the others kept; a
    query of that domain is then still named, and one like the kept background is not."""
    rng = np.random.default_rng(1)
    a, b, e = (np.eye(32)[i] for i in range(3))
    c = 0.6 * b + 0.8 * e  # general requests: nearer small talk (b) than code (a), but not small talk
    X = np.concatenate([_cloud(rng, a, 200, 0.1), _cloud(rng, b, 200, 0.1),
                        _cloud(rng, a, 100, 0.1), _cloud(rng, c, 100, 0.1)])  # background: 100 like a, 100 like c
    y = ["code"] * 200 + ["chat"] * 200 + [BACKGROUND] * 200
    clf = DomainClassifier().fit(X, y, topical=["code"])
    assert clf.background_dropped == 100 and clf.classes == ["chat", "code"]
    assert set(clf.thresholds) == {"chat", "code"}  # no typicality for the background
    labels, _ = clf.predict(np.concatenate([_cloud(rng, a, 50, 0.1), _cloud(rng, c, 50, 0.1)]))
    assert labels == ["code"] * 50 + [BACKGROUND] * 50
    labels, _, named = clf.classify(_cloud(rng, c, 20, 0.1))
    assert labels == [BACKGROUND] * 20 and named == ["chat"] * 20  # general requests nearest small talk
    kept_all = DomainClassifier().fit(X, y)  # nothing topical: every background example stays
    assert kept_all.background_dropped == 0
    assert np.mean(np.array(kept_all.predict(_cloud(rng, a, 50, 0.1))[0]) == "code") < 0.9


def test_a_classifier_needs_two_named_domains_and_counts_no_drop_before_fitting():
    rng = np.random.default_rng(4)
    assert DomainClassifier().background_dropped == 0
    X = np.concatenate([_cloud(rng, np.eye(8)[0], 20, 0.1), _cloud(rng, np.eye(8)[1], 20, 0.1)])
    with pytest.raises(ValueError, match="two domains"):  # the background is not a domain
        DomainClassifier().fit(X, ["code"] * 20 + [BACKGROUND] * 20, topical=["code"])
    assert DomainClassifier().fit(X, ["code"] * 20 + ["chat"] * 20).classes == ["chat", "code"]


def test_the_background_filter_and_relabel_thresholds_include_their_value():
    """A background example given a topical label with a probability exactly at ``background_filter``
    is dropped, and exactly at ``background_relabel`` joins the label (the first-stage classifier is
    the same seeded logistic regression, so the probability can be hit exactly)."""
    rng = np.random.default_rng(5)
    a, b = np.eye(16)[0], np.eye(16)[1]
    X = np.concatenate([_cloud(rng, a, 60, 0.2), _cloud(rng, b, 60, 0.2), _cloud(rng, 0.7 * a + 0.7 * b, 40, 0.3)])
    y = np.array(["code"] * 60 + ["chat"] * 60 + [BACKGROUND] * 40)
    named = y != BACKGROUND
    first = DomainClassifier()._logreg().fit(X[named], y[named])
    proba = first.predict_proba(X[~named])  # [40, 2]
    to_code = proba[:, list(first.classes_).index("code")]  # the topical label's probability
    order = np.sort(to_code[to_code > 0.5])
    p = float(order[len(order) // 2])  # a probability one example has exactly
    assert 0.5 < p < 1.0 and (to_code == p).sum() == 1
    clf = DomainClassifier(background_filter=p).fit(X, y, topical=["code"])
    assert clf.background_dropped == int((to_code >= p).sum())
    joined = DomainClassifier(background_filter=0.5, background_relabel=p).fit(X, y, topical=["code"])
    assert len(joined.examples["code"]) == 60 + int((to_code >= p).sum())


def test_probabilities_stay_exact_for_a_very_sure_classifier():
    """The logits are shifted by their maximum before the softmax: logits in the thousands give
    sklearn's probabilities, not inf / inf."""
    rng = np.random.default_rng(6)
    X = np.concatenate([_cloud(rng, np.eye(16)[i], 30, 0.1) for i in range(3)])
    texts = [f"{w} example {i}" for w in ("code", "math", "chat") for i in range(30)]
    clf = DomainClassifier(lexical=True).fit(X, ["code"] * 30 + ["math"] * 30 + ["chat"] * 30, texts)
    clf.model.coef_ *= 2000.0
    got = clf._proba(X, texts)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, clf.model.predict_proba(clf._features(X, texts)), atol=1e-6)


def test_background_examples_sure_to_be_topical_can_join_their_domain_instead():
    """With ``background_relabel`` the filtered background examples given their topical domain with
    at least that probability become its examples (the rest of the filtered ones are dropped as
    before): a domain whose own examples are narrow then also names what general traffic asks of it."""
    rng = np.random.default_rng(2)
    a, b, e, w = (np.eye(32)[i] for i in range(4))
    near = 0.8 * a + 0.6 * w  # general traffic's code requests: code-like, in a direction code's examples lack
    X = np.concatenate([_cloud(rng, a, 200, 0.05), _cloud(rng, b, 200, 0.05), _cloud(rng, near, 100, 0.05),
                        _cloud(rng, 0.6 * b + 0.8 * e, 100, 0.05)])  # the rest: nearer small talk, kept
    y = ["code"] * 200 + ["chat"] * 200 + [BACKGROUND] * 200
    dropped = DomainClassifier().fit(X, y, topical=["code"])
    joined = DomainClassifier(background_relabel=0.5).fit(X, y, topical=["code"])
    assert dropped.background_dropped == joined.background_dropped == 100
    assert len(dropped.examples["code"]) == 200 and len(joined.examples["code"]) == 300
    assert len(joined.examples["chat"]) == 200  # only topical labels take background examples
    strict = DomainClassifier(background_relabel=1.0).fit(X, y, topical=["code"])  # none that sure: all dropped
    assert len(strict.examples["code"]) == 200
    asks = _cloud(rng, near, 50, 0.05)  # new code requests like general traffic's: named code, and surer of it
    (lj, pj), (ld, pd) = joined.predict(asks), dropped.predict(asks)
    assert lj == ld == ["code"] * 50 and pj.mean() > pd.mean(), (pj.mean(), pd.mean())
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        joined.save(f"{d}/c")
        assert DomainClassifier.load(f"{d}/c").background_relabel == 0.5


def test_a_router_with_the_background_class_sends_a_domain_it_was_not_told_of_to_clusters(extractor, train, held_out):
    """Leave math out of the named domains: with general traffic as a background class, math word
    problems are not forced into code, SQL or chat but go to clusters; without it they are named."""
    general = [r for r in load_workload(DATA / "router_train.jsonl") if r.source.startswith("sharegpt:")][:300]
    no_math = [r for r in train if r.domain != "math"]
    texts = [r.text for r in no_math + general]
    labels = [r.domain for r in no_math] + [BACKGROUND] * len(general)
    by = _by_source(load_workload(DATA / "open.jsonl"), 30)
    math = by["gsm-symbolic"] + by["mathgenerator"]
    with_bg = Router(RouterConfig(), extractor).fit(texts, labels)
    without = Router(RouterConfig(classifier={"background": False}), extractor).fit([r.text for r in no_math], [r.domain for r in no_math])
    went_with, went_without = _outcomes(with_bg, math), _outcomes(without, math)
    n = len(math)  # 60: measured 58 against 38 to clusters
    assert went_with["cluster"] >= 0.85 * n and went_with["cluster"] >= went_without["cluster"] + 0.2 * n, (
        went_with, went_without)
    assert with_bg.classifier.background_dropped > 0  # ShareGPT's code and SQL requests
    assert _outcomes(with_bg, held_out["dbgpt-example"])["sql"] >= 9  # a new source of a named domain still named


# ---------------------------------------------------------------------- osd route's report


def test_open_set_report_on_a_small_pool(extractor):
    rd = load_workload(DATA / "router_train.jsonl")
    op = load_workload(DATA / "open.jsonl")
    by, ob = _by_source(rd, 12), _by_source(op, 6)
    train = [r for s in ("python-stdlib", "codeio", "spider-dev", "champ", "chatterbot") for r in by[s]]
    extra = [r for s in ("humaneval", "gsm-symbolic", "quotes", "verne-2889") for r in ob[s]]
    general = [WorkloadRecord(t, "chat", "en", f"sharegpt:{i}") for i, t in enumerate(
        ["Write me an essay on the history of print.", "Give me three names for a bakery.",
         "Draft a polite email declining a meeting.", "What should I pack for a week in Norway?"])]
    served = [WorkloadRecord("Plan a birthday party for a ten-year-old.", "chat", "en", "sharegpt:y")]
    # an "unnamed" kind that is plainly SQL (training questions again): named, never a cluster
    extra = extra + [WorkloadRecord(r.text, "copies", r.lang, "copies") for r in by["spider-dev"][:3]]
    # the general traffic of the training file is the background class; the workload's is judged
    rep = open_set_report(RouterConfig(), extractor, train + general, served, extra, lang_prior=False)  # shared extractor: no prior
    assert rep["pool"]["background"] == 4 and rep["unnamed"]["general"]["n"] == 1
    assert set(rep["loso"]) == {"code:codeio", "code:humaneval", "code:python-stdlib", "math:champ",
                                "math:gsm-symbolic"}  # sql and chat have one source here
    assert rep["loso"]["code:humaneval"]["n"] == 6 and set(rep["lodo"]) == {"chat", "code", "math", "sql"}
    assert set(rep["unnamed"]) == {"quotes", "fiction", "copies", "general"}  # sharegpt is not trained on
    assert rep["unnamed"]["copies"]["went"] == {"sql": 3}
    for v in [*rep["loso"].values(), *rep["lodo"].values(), *rep["unnamed"].values()]:
        assert sum(v["went"].values()) == v["n"]
    assert rep["lodo"]["sql"]["went"].get("sql", 0) == 0  # a router without sql never names it
    # every figure is its share of what went where, and the summaries are those figures
    for key, v in rep["loso"].items():
        assert v["recall"] == v["went"].get(v["domain"], 0) / v["n"] and key == f"{v['domain']}:{v['source']}"
    for v in [*rep["lodo"].values(), *rep["unnamed"].values()]:
        assert v["to_clusters"] == v["went"].get("cluster", 0) / v["n"]
    assert rep["loso_min_recall"] == {"chat": None, "sql": None,
                                      "code": min(rep["loso"][f"code:{s}"]["recall"] for s in ("codeio", "humaneval", "python-stdlib")),
                                      "math": min(rep["loso"][f"math:{s}"]["recall"] for s in ("champ", "gsm-symbolic"))}
    kinds = [v for k, v in rep["unnamed"].items() if k != "general"]  # the five kinds, not general traffic
    assert rep["unnamed_to_clusters"] == sum(v["went"].get("cluster", 0) for v in kinds) / sum(v["n"] for v in kinds)
    assert rep["pool"]["n"] == len(train) + 12 and rep["pool"]["sources"]["code"] == ["codeio", "humaneval", "python-stdlib"]
    assert rep["lodo"]["code"]["n"] == 3 * 12 - 6 and rep["unnamed"]["quotes"]["n"] == 6
    # --keep-general: ShareGPT's turns are chat examples (the training file's and the workload's), no
    # background; extra's first three records given twice are still one text each
    # (and without unnamed kinds in the open file: nothing unnamed, a share of nothing is 0)
    named_extra = [r for r in extra if r.domain in ("code", "math")]
    again = open_set_report(RouterConfig(), extractor, train + general, served, named_extra + named_extra[:3],
                            lang_prior=False, keep_general=True)
    assert again["pool"]["n"] == rep["pool"]["n"] + 5 and again["pool"]["background"] == 0
    assert again["unnamed"] == {} and again["unnamed_to_clusters"] == 0.0


def test_the_router_deployment_fits_its_examples_at_start(train, held_out, tmp_path):
    """``RouterConfig.examples`` gives the served router its named domains when it starts without a
    saved state (its general sources are the background, not a domain); a saved state wins over it."""
    from deployments.router import RouterServer
    from workloads import save_workload

    examples = tmp_path / "examples.jsonl"
    save_workload(train + [WorkloadRecord("Write an essay on print.", "chat", "en", "sharegpt:1")], examples)
    server = RouterServer(RouterConfig(mode="both", examples=str(examples)), state_dir=str(tmp_path / "state"))
    assert server.router.classifier.classes == ["chat", "code", "math", "sql"]
    assert len(server.router.classifier.examples["chat"]) == sum(r.domain == "chat" for r in train)  # no ShareGPT
    routes = server.router.route_batch([r.text for r in held_out["dbgpt-example"]])
    assert sum(x.domain == "sql" for x in routes) >= 9
    # mode clusters: the examples only name the clusters close to them; every query is routed by cluster
    clusters = RouterServer(RouterConfig(mode="clusters", examples=str(examples))).router
    assert clusters.classifier.classes == ["chat", "code", "math", "sql"]
    assert all(x.domain not in clusters.classifier.classes for x in clusters.route_batch([r.text for r in held_out["dbgpt-example"]]))
    server.save()
    examples.write_text("")  # a saved router is reloaded, the examples not read again
    again = RouterServer(RouterConfig(mode="both", examples=str(examples)), state_dir=str(tmp_path / "state"))
    assert again.router.t == server.router.t and again.router.classifier.classes == ["chat", "code", "math", "sql"]


def test_osd_route_trains_the_background_and_reports_it(extractor, train, tmp_path, capsys):
    """``osd route`` end to end on small files: the training file's general traffic is the
    background (never a text of the evaluated workload), and the report says how much of it was
    kept; with --keep-general it is chat instead, as routers were trained before."""
    from router.cli import main
    from workloads import save_workload

    wl = [r for r in load_workload(DATA / "workload.jsonl") if not r.source.startswith("sharegpt")][::12]
    general = [r for r in load_workload(DATA / "router_train.jsonl") if r.source.startswith("sharegpt:")][:40]
    save_workload(train[::4] + general + wl[:2], tmp_path / "train.jsonl")  # 2 workload texts: left out
    save_workload(wl, tmp_path / "wl.jsonl")
    args = ["--workload", str(tmp_path / "wl.jsonl"), "--train", str(tmp_path / "train.jsonl"), "--open", "none",
            "--lang-corpus", "none", "--warmup", "2", "--json", str(tmp_path / "r.json")]
    assert main(args) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["train"]["excluded_as_in_workload"] == 2 and rep["train"]["domains"][BACKGROUND] == 40
    assert f"40 of general traffic as the background, {rep['train']['background_dropped']} of them dropped" in capsys.readouterr().out
    assert set(rep["topic"]["routed_to_domain"]) == {r.domain for r in wl}  # the background is not a domain
    assert main([*args, "--keep-general"]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert BACKGROUND not in rep["train"]["domains"] and rep["train"]["domains"]["chat"] == sum(
        r.domain == "chat" for r in train[::4] + general)


def test_the_reports_small_pieces_by_hand():
    from router.cli import _lang_scores, _percentiles
    from router.router import Route

    p = _percentiles([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (p["n"], p["p50"], p["mean"]) == (5, 3.0, 22.0) and p["p90"] == pytest.approx(61.6) and p["p99"] == pytest.approx(96.16)
    assert _percentiles([]) == {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None}
    s = _lang_scores(["en", "en", "fr", "fr", "fr"], ["en", "fr", "fr", "en", "en"])
    assert s["n"] == 5 and s["accuracy"] == 0.4
    assert s["per_label"] == {"en": {"accuracy": 0.5, "n": 2}, "fr": {"accuracy": 1 / 3, "n": 3}}
    assert s["errors"] == {"fr->en": 2, "en->fr": 1}
    assert _lang_scores([], [])["accuracy"] is None
    many = _lang_scores([f"t{i}" for i in range(25)], [f"p{i}" for i in range(25)])
    assert len(many["errors"]) == 20 and many["accuracy"] == 0.0  # the 20 most common confusions
    kw = dict(lang="en", reason="x", confidence=1.0, draft_id="general")
    assert _outcome(Route(domain="chat/fr", cluster=None, **kw)) == "chat"
    assert _outcome(Route(domain="c3/en", cluster=3, **kw)) == "cluster"
    assert _outcome(Route(domain="unknown", cluster=None, **kw)) == "fallback"
