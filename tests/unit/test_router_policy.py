"""Router policy without a model: clustering, bandit, draft life cycle, state round trip.

Queries are synthetic: a stub extractor maps "<lang> <mode> <i>" to a unit vector near the
mode's centre (cosine about 0.9), "<lang> noise <i>" to a random direction (near-orthogonal to
everything in 384 dimensions).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from config import RouterConfig, ValidationError
from router.bandit import AcceptanceBandit
from router.domains import OnlineClusters
from router.features import QueryFeatures
from router.router import GENERAL, UNKNOWN, Router
from router.domains import BACKGROUND, Cluster
from router_settings import router_config

D = 384
CENTRES = {m: v / np.linalg.norm(v) for m, v in
           zip("ABC", np.random.default_rng(123).standard_normal((3, D)).astype(np.float32))}


def synthetic(mode: str, i: int) -> np.ndarray:
    rng = np.random.default_rng([sum(map(ord, mode)), i])
    if mode == "noise":
        v = rng.standard_normal(D)
    else:
        v = CENTRES[mode] + 0.025 * rng.standard_normal(D)
    return (v / np.linalg.norm(v)).astype(np.float32)


class StubExtractor:
    """``"<lang> <mode> <i>"`` -> synthetic features; ``""`` -> empty."""

    def clean(self, text):
        return text.strip()

    def extract(self, texts, embed=None):
        out = []
        for t, e in zip(texts, embed if embed is not None else [True] * len(texts)):
            if not t.strip():
                out.append(QueryFeatures(np.zeros(D, np.float32), "und", 0.0, empty=True))
                continue
            lang, mode, i = t.split()
            out.append(QueryFeatures(synthetic(mode, int(i)) if e else np.zeros(D, np.float32), lang, 0.99,
                                     text=t.strip()))
        return out

    def embed(self, texts):
        return np.stack([f.embedding for f in self.extract(texts)])


def cfg(**kw) -> RouterConfig:
    base = dict(mode="clusters", min_cluster_size=3, noise_ttl=20, spawn_min_records=5, spawn_window=50,
                spawn_min_tokens=10, spawn_alpha=0.5, idle_retire_records=30, max_drafts=4, explore_rate=0.0)
    return router_config(**{**base, **kw})


def stream(router: Router, mode: str, n: int, start: int = 0, accepted: int = 1, proposed: int = 4, lang: str = "en"):
    """Route n queries of a mode, reporting the given acceptance for each; returns the routes."""
    routes = []
    for i in range(start, start + n):
        r = router.route(f"{lang} {mode} {i}")
        router.observe(r, accepted, proposed)
        routes.append(r)
    return routes


# ---------------------------------------------------------------------------- clustering


def unit(*xs: float) -> np.ndarray:
    v = np.zeros(D, np.float32)
    v[: len(xs)] = xs
    return v


def test_a_cluster_is_numbered_from_0_and_joined_at_exactly_its_threshold():
    """Leader clustering by hand: ids 0, 1, 2 in order of creation; a query at cosine distance
    exactly ``cluster_threshold`` from a centroid joins it, farther starts a cluster; the centroid is
    the running mean, renormalised; no cluster of a language: (None, -1)."""
    oc = OnlineClusters(cfg(cluster_threshold=0.5))
    assert oc.nearest(unit(1.0), "en") == (None, -1.0)
    c0, sim = oc.assign(unit(1.0), "en", t=0)
    assert (c0.id, sim, c0.count) == (0, 0.0, 1) and np.array_equal(c0.centroid, unit(1.0))
    c, sim = oc.assign(unit(0.5, 0.75 ** 0.5), "en", t=1)  # cosine 0.5: distance exactly 0.5
    assert c is c0 and sim == 0.5 and c0.count == 2
    mean = unit(0.75, 0.75 ** 0.5 / 2)
    np.testing.assert_allclose(c0.centroid, mean / np.linalg.norm(mean), atol=1e-6)
    c1, _ = oc.assign(unit(0.0, 0.0, 1.0), "en", t=2)  # cosine about 0: a new cluster
    c2, _ = oc.assign(unit(1.0), "fr", t=3)  # another language: its own clusters
    assert (c1.id, c2.id, oc.next_id) == (1, 2, 3) and len(oc) == 3
    assert oc.nearest(unit(1.0), "fr") == (c2, 1.0)


def test_cluster_acceptance_decays_and_ignores_empty_steps():
    oc = OnlineClusters(cfg(decay=0.5))
    c, _ = oc.assign(unit(1.0), "en", t=0)
    assert c.alpha is None  # nothing served yet
    oc.observe(c.id, 1, 1)
    oc.observe(c.id, 0, 2)  # accepted 1 * 0.5 + 0, proposed 1 * 0.5 + 2
    assert (c.accepted, c.proposed) == (0.5, 2.5) and c.alpha == pytest.approx(0.2)
    oc.observe(c.id, 0, 0)  # a k = 0 step: no decay either
    assert (c.accepted, c.proposed) == (0.5, 2.5)
    oc.observe(99, 1, 4)  # an expired cluster: ignored
    c.accepted, c.proposed = 0.25, 0.5  # a decayed fraction of a token still gives a rate
    assert c.alpha == 0.5


def clusters_with(members: int, first_t: int = 0, **kw) -> tuple[OnlineClusters, Cluster]:
    """One English cluster of ``members`` identical queries at clocks first_t, first_t + 1, ... (second 1.0)."""
    base = dict(min_cluster_size=3, noise_ttl=10, idle_retire_records=20, idle_retire_s=100.0, spawn_min_records=3,
                spawn_window=50, spawn_min_tokens=4, spawn_alpha=0.5)
    oc = OnlineClusters(cfg(**{**base, **kw}))
    for i in range(members):
        c, _ = oc.assign(unit(1.0), "en", t=first_t + i, now_s=1.0)
    return oc, c


def test_cluster_life_cycle_boundaries():
    """Noise: fewer than ``min_cluster_size`` members when ``noise_ttl`` records old, not a record
    before; idle: ``idle_retire_records`` records or ``idle_retire_s`` seconds unseen, to the record
    and the second; a cluster of exactly ``min_cluster_size`` members is no noise and may earn a draft."""
    oc, c = clusters_with(2)  # born at 0, two members
    assert oc.maintain(t=9, now_s=1.0) == [] and len(oc) == 1
    assert [(e.kind, e.reason) for e in oc.maintain(t=10, now_s=1.0)] == [("expire", "noise")]
    oc, c = clusters_with(3)
    assert oc.maintain(t=10, now_s=1.0) == [] and len(oc) == 1  # exactly min_cluster_size: kept
    oc, c = clusters_with(3, first_t=3)  # last seen at 5
    assert oc.maintain(t=24, now_s=50.0) == []
    assert [(e.kind, e.reason) for e in oc.maintain(t=25, now_s=50.0)] == [("expire", "idle")]
    oc, c = clusters_with(3)  # last seen at second 1.0
    assert oc.maintain(t=3, now_s=100.5) == []
    assert [(e.kind, e.reason) for e in oc.maintain(t=3, now_s=101.0)] == [("expire", "idle")]
    oc, c = clusters_with(3)  # exactly min_cluster_size (= spawn_min_records) members, served poorly
    oc.observe(c.id, 1, 4)
    (ev,) = oc.maintain(t=3, now_s=1.0)
    assert (ev.kind, ev.cluster.id) == ("spawn", c.id)  # with exactly spawn_min_tokens proposed
    oc, c = clusters_with(3, idle_retire_records=1000)  # its first recent record at 0
    oc.observe(c.id, 1, 4)
    assert oc.maintain(t=50, now_s=1.0) == []  # spawn_window (50) records ago: too old to count
    assert [e.kind for e in oc.maintain(t=49, now_s=1.0)] == ["spawn"]
    oc, c = clusters_with(3)
    oc.observe(c.id, 2, 4)  # alpha exactly spawn_alpha: served well enough
    assert oc.maintain(t=3, now_s=1.0) == []


def test_a_full_set_of_clusters_evicts_the_longest_unseen_one_without_a_draft():
    oc = OnlineClusters(cfg(max_clusters=2))
    old, _ = oc.assign(unit(1.0), "en", t=0)
    new, _ = oc.assign(unit(0.0, 1.0), "en", t=1)
    old.draft = "c0-en"  # the older one has a draft of its own: the newer one goes
    oc.assign(unit(0.0, 0.0, 1.0), "en", t=2)
    assert set(oc.clusters) == {old.id, 2}
    assert [(e.kind, e.cluster.id, e.reason) for e in oc.maintain(t=2)] == [("expire", new.id, "evicted (max_clusters)")]


def test_clusters_split_two_modes_and_drop_noise():
    oc = OnlineClusters(cfg(noise_ttl=30, idle_retire_records=1000))
    order = [("A", i) for i in range(40)] + [("B", i) for i in range(40)] + [("noise", i) for i in range(10)]
    np.random.default_rng(0).shuffle(order)
    ids = {}
    for t, (mode, i) in enumerate(order):
        c, _ = oc.assign(synthetic(mode, i), "en", t)
        ids[(mode, i)] = c.id
    a = {ids[("A", i)] for i in range(40)}
    b = {ids[("B", i)] for i in range(40)}
    assert len(a) == 1 and len(b) == 1 and a != b
    assert len(oc) == 12  # two modes + ten singletons of noise
    events = oc.maintain(t=len(order) + 30)
    assert sorted(e.reason for e in events) == ["noise"] * 10
    assert {c.id for c in oc.clusters.values()} == a | b
    assert sorted(c.count for c in oc.clusters.values()) == [40, 40]
    centre_a = oc.clusters[a.pop()].centroid
    assert float(centre_a @ CENTRES["A"]) > 0.97  # the centroid found the mode's centre


def test_language_is_a_hard_split():
    oc = OnlineClusters(cfg())
    en, _ = oc.assign(synthetic("A", 0), "en", 0)
    fr, sim = oc.assign(synthetic("A", 0), "fr", 1)
    assert en.id != fr.id and sim == 0.0
    again, sim = oc.assign(synthetic("A", 1), "fr", 2)
    assert again.id == fr.id and sim > 0.7 and again.key == f"c{fr.id}/fr"


def test_max_clusters_evicts_the_longest_unseen():
    oc = OnlineClusters(cfg(max_clusters=3))
    for t in range(4):
        oc.assign(synthetic("noise", t), "en", t)
    assert len(oc) == 3
    (ev,) = oc.maintain(4)
    assert ev.kind == "expire" and ev.cluster.born == 0 and "max_clusters" in ev.reason


def test_idle_in_seconds_expires_a_cluster():
    oc = OnlineClusters(cfg(idle_retire_s=10.0, idle_retire_records=1000, min_cluster_size=1))
    c, _ = oc.assign(synthetic("A", 0), "en", t=0, now_s=100.0)
    assert oc.maintain(t=1, now_s=105.0) == []
    (ev,) = oc.maintain(t=2, now_s=111.0)
    assert (ev.kind, ev.reason, ev.cluster.id) == ("expire", "idle", c.id) and len(oc) == 0


# ---------------------------------------------------------------------------- bandit


def test_bandit_prefers_better_acceptance_and_still_explores():
    bandit = AcceptanceBandit(RouterConfig(bandit={"seed": 7, "explore_rate": 0.05}))
    rng = np.random.default_rng(0)
    for _ in range(300):  # steps of 4 tokens: d-good keeps 70%, d-poor 30%
        bandit.observe("code", "d-good", int(rng.binomial(4, 0.7)), 4)
        bandit.observe("code", "d-poor", int(rng.binomial(4, 0.3)), 4)
    picks = [bandit.choose("code", ["d-poor", "d-good"], default=GENERAL) for _ in range(2000)]
    counts = Counter(p for p, _ in picks)
    assert counts["d-good"] > 1800  # exploits ...
    assert 10 <= counts["d-poor"] <= 150  # ... and explores (epsilon 0.05 / 2 = 2.5% expected)
    assert all(explored == (p == "d-poor") for p, explored in picks)
    assert bandit.mean("code", "d-good") == pytest.approx(0.7, abs=0.05)
    # seeded: the same observations and seed give the same choices
    def replay(seed: int) -> list:
        b = AcceptanceBandit(RouterConfig(bandit={"seed": seed, "explore_rate": 0.05}))
        b.counts = {k: list(v) for k, v in bandit.counts.items()}
        return [b.choose("code", ["d-poor", "d-good"], GENERAL) for _ in range(300)]

    assert replay(3) == replay(3) != replay(4)


def test_bandit_thompson_alone_explores_uncertain_draft():
    bandit = AcceptanceBandit(RouterConfig(bandit={"seed": 1, "explore_rate": 0.0}))
    for _ in range(50):
        bandit.observe("math", GENERAL, 1, 4)  # general: 25%, well known
    picks = Counter(bandit.choose("math", [GENERAL, "new"], GENERAL)[0] for _ in range(500))
    assert picks["new"] > 300  # unseen draft: prior mean 0.5 > 0.25, sampled most of the time
    assert picks[GENERAL] > 0


def test_bandit_default_for_unseen_domain_and_bad_counts():
    bandit = AcceptanceBandit(RouterConfig())
    bandit.observe("code", "d1", 4, 4)
    assert bandit.choose("sql", [GENERAL, "d1"], default=GENERAL) == (GENERAL, False)
    with pytest.raises(ValueError):
        bandit.observe("code", "d1", 5, 4)
    bandit.observe("code", "d1", 0, 0)  # k = 0 step: nothing learnt
    assert bandit.counts[("code", "d1")] == [4.0, 0.0]


def test_bandit_forgets_old_observations():
    bandit = AcceptanceBandit(RouterConfig(bandit={"decay": 0.9}))
    for _ in range(100):
        bandit.observe("chat", "d", 4, 4)
    for _ in range(100):
        bandit.observe("chat", "d", 0, 4)
    assert bandit.mean("chat", "d") < 0.05  # the recent (bad) acceptance dominates


def test_bandit_posterior_adds_the_prior_to_the_decayed_counts():
    bandit = AcceptanceBandit(RouterConfig(bandit={"prior": (2.0, 5.0), "decay": 0.5}))
    assert bandit.posterior("sql", "d") == (2.0, 5.0)  # never observed: the prior alone
    bandit.observe("sql", "d", 3, 4)
    bandit.observe("sql", "d", 1, 4)  # counts: accepted 3 * 0.5 + 1, rejected 1 * 0.5 + 3
    assert bandit.posterior("sql", "d") == (2.0 + 2.5, 5.0 + 3.5)
    assert bandit.mean("sql", "d") == pytest.approx(4.5 / 13.0)


def test_bandit_with_one_candidate_takes_it_even_in_an_unseen_domain():
    bandit = AcceptanceBandit(RouterConfig(bandit={"explore_rate": 1.0}))
    assert bandit.choose("new", ["own"], default=GENERAL) == ("own", False)
    bandit.observe("new", "other", 4, 4)
    assert all(bandit.choose("new", ["own"], default=GENERAL) == ("own", False) for _ in range(20))


@pytest.mark.parametrize("domain, draft_id, left", [
    ("a", None, {("b", "x")}),  # a domain: all its drafts
    (None, "x", {("a", "y")}),  # a draft: in every domain
    ("a", "x", {("a", "y"), ("b", "x")}),  # both: that pair only
    (None, None, set()),  # neither: everything
])
def test_bandit_forgets_a_domain_a_draft_or_the_pair(domain, draft_id, left):
    bandit = AcceptanceBandit(RouterConfig())
    for key in [("a", "x"), ("a", "y"), ("b", "x")]:
        bandit.observe(*key, 2, 4)
    bandit.forget(domain, draft_id)
    assert set(bandit.counts) == left
    assert all(bandit.counts[k] == [2.0, 2.0] for k in left)


# ---------------------------------------------------------------------------- draft life cycle


def test_busy_cluster_with_poor_acceptance_spawns_a_draft_and_quiet_one_retires_it():
    router = Router(cfg(), extractor=StubExtractor())
    routes = stream(router, "A", 8, accepted=1, proposed=4)  # alpha 0.25 < 0.5
    events = router.events()
    assert [(e.kind, e.parent) for e in events] == [("spawn", GENERAL)]
    spawned, key = events[0].draft_id, routes[-1].domain
    assert events[0].domain == key and key.endswith("/en") and router.drafts[spawned] == key
    # the new draft now serves its cluster (bandit: unseen there, prior mean 0.5 > 0.25)
    later = stream(router, "A", 10, start=8, accepted=3, proposed=4)
    assert Counter(r.draft_id for r in later)[spawned] >= 7
    # a busy cluster with good acceptance gets no draft ...
    stream(router, "B", 40, accepted=4, proposed=4)
    events = router.events()
    assert not [e for e in events if e.kind == "spawn"]
    # ... and mode A, unseen for idle_retire_records queries, gives its draft back
    assert [(e.kind, e.draft_id) for e in events] == [("retire", spawned)]
    assert spawned not in router.drafts and not any(d == spawned for _, d in router.bandit.counts)


def test_good_acceptance_spawns_nothing():
    router = Router(cfg(), extractor=StubExtractor())
    stream(router, "A", 30, accepted=3, proposed=4)
    assert router.events() == [] and list(router.drafts) == [GENERAL]


def test_max_drafts_respected_least_used_makes_room():
    router = Router(cfg(max_drafts=2, idle_retire_records=1000), extractor=StubExtractor())
    stream(router, "A", 8)  # spawns a draft for A
    (a_draft,) = [e.draft_id for e in router.events()]
    for i in range(20):  # B is busy at poor acceptance too, but A's draft is used more: no room
        stream(router, "A", 2, start=8 + 2 * i)
        stream(router, "B", 1, start=i)
        assert list(router.drafts) == [GENERAL, a_draft]
    assert router.events() == []
    stream(router, "B", 200, start=20)  # A goes quiet: its draft's use decays below B's traffic
    events = [(e.kind, e.draft_id) for e in router.events()]
    assert events[0] == ("retire", a_draft) and events[1][0] == "spawn" and len(router.drafts) == 2
    # an explicit registration when full retires the least used draft
    (victim,) = [d for d in router.drafts if d != GENERAL]
    router.register_draft("code-draft", domain="code")
    assert list(router.drafts) == [GENERAL, "code-draft"]
    assert [(e.kind, e.draft_id) for e in router.events()] == [("retire", victim)]
    with pytest.raises(ValueError):
        router.retire_draft(GENERAL)


def test_general_only_when_max_drafts_is_one():
    router = Router(cfg(max_drafts=1), extractor=StubExtractor())
    stream(router, "A", 30)
    assert list(router.drafts) == [GENERAL] and router.events() == []


def test_domain_keys_candidates_and_fallbacks():
    router = Router(RouterConfig(mode="supervised"), extractor=StubExtractor())
    assert router.domain_key("chat", "fr") == "chat/fr"
    assert router.domain_key("chat", "en") == "chat"
    assert router.domain_key("code", "fr") == "code"
    router.register_draft("chat-draft", domain="chat")
    router.register_draft("free")
    assert router.candidates("chat/fr") == [GENERAL, "chat-draft", "free"]
    assert router.candidates("code") == [GENERAL, "free"]
    assert router.own_draft("chat/fr") == "chat-draft" and router.own_draft("code") is None
    r = router.route("en A 0")  # supervised without a trained classifier
    assert (r.domain, r.draft_id, r.reason) == (UNKNOWN, GENERAL, "fallback: no classifier")
    r = router.route("")
    assert (r.domain, r.draft_id, r.reason, r.lang) == (UNKNOWN, GENERAL, "fallback: empty text", "und")
    router.observe(r, 3, 4)  # fallback routes teach the bandit nothing
    assert router.bandit.counts == {}


def test_a_label_exactly_at_the_confidence_threshold_is_named():
    """The classifier's probability is compared with ``confidence_threshold`` inclusively: a query
    given its label with exactly that probability is routed to the label, just below goes to a
    cluster (the classifier is the same seeded fit each time, so the probability can be hit)."""
    texts = [f"en {m} {i}" for m in "AB" for i in range(30)]
    labels = ["code"] * 30 + ["sql"] * 30
    def fitted(threshold: float) -> Router:
        r = Router(cfg(mode="both", lexical=False, lexical_gate=None, confidence_threshold=threshold),
                   extractor=StubExtractor())
        return r.fit(texts, labels)
    query = "en A 99"
    (_, p, _) = fitted(0.5).classifier.classify(StubExtractor().embed([query]))
    p = float(p[0])
    assert 0.5 < p < 1.0
    at = fitted(p).route(query)
    assert (at.domain, at.reason, at.confidence) == ("code", "classifier", pytest.approx(p))
    above = fitted(float(np.nextafter(p, 1.0))).route(query)
    assert above.cluster is not None and above.topic == "code"


def test_the_background_filter_drops_general_examples_like_topical_domains_not_like_open_ones():
    """``fit_embeddings`` tells the classifier which labels are topical (named and not open-ended):
    general examples like code are dropped from the background, those like chat (open) stay."""
    a, b, c = CENTRES["A"], CENTRES["B"], CENTRES["C"]
    def near(centre, n, seed):
        rng = np.random.default_rng(seed)
        v = centre + 0.02 * rng.standard_normal((n, D))
        return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
    code_like, chat_like = 0.8 * a + 0.6 * c, 0.8 * b + 0.6 * c
    X = np.concatenate([near(a, 30, 1), near(b, 30, 2), near(code_like, 15, 3), near(chat_like, 15, 4)])
    labels = ["code"] * 30 + ["chat"] * 30 + [BACKGROUND] * 30
    router = Router(cfg(mode="both", lexical=False, lexical_gate=None), extractor=StubExtractor())
    router.fit_embeddings(X, labels)
    assert router.classifier.background_dropped == 15
    got, _ = router.classifier.predict(np.concatenate([near(code_like, 5, 5), near(chat_like, 5, 6)]))
    assert got == ["code"] * 5 + [BACKGROUND] * 5


def test_route_batch_reports_its_time_per_query(monkeypatch):
    import router.router as rr
    clock = iter([10.0, 10.012])  # the batch's start and end: 12 ms
    monkeypatch.setattr(rr.time, "perf_counter", lambda: next(clock))
    router = Router(cfg(), extractor=StubExtractor())
    routes = router.route_batch(["en A 0", "en A 1", "en B 0"])
    assert [r.latency_ms for r in routes] == [pytest.approx(4.0)] * 3
    clock = iter([5.0, 5.003])
    (one,) = router.route_batch(["en A 2"])
    assert one.latency_ms == pytest.approx(3.0)
    clock = iter([1.0, 1.0])
    assert router.route_batch([]) == []


def test_draft_usage_counts_routed_queries_and_a_draft_used_as_much_as_needed_stays():
    router = Router(cfg(max_drafts=3, spawn_window=1000), extractor=StubExtractor())
    router.register_draft("free")
    router._use("free")
    assert router.value("free") == 1.0  # one routed query
    router.register_draft("other", domain="code")
    assert list(router.drafts) == [GENERAL, "free", "other"]  # full
    router.register_draft("free", domain="chat")  # known: re-bound, nothing retired for it
    assert router.drafts == {GENERAL: None, "free": "chat", "other": "code"} and router.events() == []
    router.usage = {"free": (3.0, router.t), "other": (5.0, router.t)}
    assert router._make_room(need=3.0, reason="test") is False  # the least used has exactly what is needed
    assert "free" in router.drafts and router.events() == []
    assert router._make_room(need=3.5, reason="test") is True
    assert "free" not in router.drafts and [e.draft_id for e in router.events()] == ["free"]


def test_making_room_and_spawning_happen_on_the_same_query():
    router = Router(cfg(max_drafts=2, idle_retire_records=1000), extractor=StubExtractor())
    router.register_draft("free")  # full: the general draft and an unused one
    batches = []
    for i in range(12):
        stream(router, "A", 1, start=i)  # poor acceptance: A earns a draft
        batches.append([(e.kind, e.draft_id) for e in router.events()])
    (batch,) = [b for b in batches if b]
    assert batch[0] == ("retire", "free") and batch[1][0] == "spawn" and len(batch) == 2
    assert list(router.drafts) == [GENERAL, batch[1][1]]


def test_a_retired_draft_leaves_its_cluster_and_no_other():
    router = Router(cfg(idle_retire_records=1000), extractor=StubExtractor())
    stream(router, "A", 8)
    stream(router, "B", 8)
    spawned = {e.domain: e.draft_id for e in router.events() if e.kind == "spawn"}
    assert len(spawned) == 2
    by_draft = {c.draft: c for c in router.clusters.clusters.values() if c.draft}
    assert set(by_draft) == set(spawned.values())
    gone, kept = sorted(by_draft)
    router.retire_draft(gone)
    assert by_draft[gone].draft is None and by_draft[kept].draft == kept


def test_config_refuses_bad_values():
    for bad in ({"mode": "magic"}, {"drafts": {"max_drafts": 0}}, {"bandit": {"prior": (0.0, 1.0)}},
                {"bandit": {"explore_rate": 2.0}}, {"typo": 1}, {"explore_rate": 0.1}, {"bandit": {"typo": 1}}):
        with pytest.raises(ValidationError):  # (a section's field at the top is unknown there)
            RouterConfig(**bad)
    with pytest.raises(ValidationError, match=r"router.threads is now router.embedder.threads"):
        RouterConfig(threads=2)  # the flat form of before the sections says where it went


# ---------------------------------------------------------------------------- state


def test_state_round_trip_gives_identical_routes(tmp_path):
    router = Router(cfg(explore_rate=0.2), extractor=StubExtractor())
    stream(router, "A", 8)
    stream(router, "B", 8, accepted=3)
    router.register_draft("free")
    router.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r", extractor=StubExtractor())
    assert loaded.cfg == router.cfg and loaded.drafts == router.drafts and loaded.t == router.t
    assert loaded.events() == router.events()
    queries = [f"en {m} {i}" for i in range(20, 40) for m in "AB"] + ["fr C 1", ""]

    def run(r: Router):
        out = []
        for q in queries:
            route = r.route(q)
            r.observe(route, 2, 4)
            out.append({k: v for k, v in route.to_dict().items() if k != "latency_ms"})
        return out, r.events(), r.summary()

    first, second = run(router), run(loaded)
    assert first == second
    assert len({r["draft_id"] for r in first[0]}) >= 2  # exploration among several drafts was exercised
