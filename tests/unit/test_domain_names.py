"""Readable names for discovered domains: class-based TF-IDF over the words of the queries each
cluster took, by hand on counted words, then on the real MiniLM router with queries of known kinds;
and the names as the metrics replica exports them."""

from __future__ import annotations

import itertools
import random
from collections import Counter, defaultdict

import numpy as np

from config import MetricsConfig, RouterConfig
from router.router import Router
from router.domains import Cluster, name_clusters
from telemetry import Meter
from telemetry.hub import Hub


def _cluster(i: int, terms: dict[str, int]) -> Cluster:
    return Cluster(i, "en", np.zeros(4, np.float32), born=0, terms=Counter(terms))


def test_a_name_is_the_clusters_most_characteristic_words_of_at_least_two_queries():
    sql = _cluster(0, {"select": 9, "table": 7, "customers": 5, "python": 1, "data": 8})
    code = _cluster(1, {"python": 9, "function": 8, "list": 6, "data": 8, "once": 1})
    names = name_clusters([sql, code], words=3)
    # "data" is in both clusters as often as their own words: c-TF-IDF ranks it below them
    assert names == {0: "select table customers", 1: "python function list"}
    # words of a single query never make a name, so no name repeats one query
    lone = _cluster(2, {"my": 1, "secret": 1, "password": 1})
    assert name_clusters([sql, code, lone])[2] is None


# four kinds of queries, each with words of its own (and words every kind shares)
KINDS = {
    "sql": ("SELECT {a}, {b} FROM {t} WHERE {b} > {n} ORDER BY {a}; the query should join the {t} table",
            dict(a=["name", "price", "city"], b=["total", "amount", "stock"], t=["orders", "customers", "invoices"])),
    "python": ("Write a Python function that takes a list of {a} and returns the {b} using a {t} loop",
               dict(a=["integers", "strings", "floats"], b=["maximum", "average", "reversed list"], t=["for", "while"])),
    "cooking": ("How long should I bake {a} in the oven at {n} degrees, and which {b} goes well with {t}?",
                dict(a=["bread", "chicken", "potatoes"], b=["sauce", "spice", "herb"], t=["garlic", "butter", "lemon"])),
    "travel": ("What is the cheapest way to travel from {a} to {b} by {t}, and do I need a visa for {n} days?",
               dict(a=["Paris", "Berlin", "Madrid"], b=["Rome", "Vienna", "Lisbon"], t=["train", "bus", "plane"])),
}


def _queries(kind: str, n: int, rng: random.Random) -> list[str]:
    template, fills = KINDS[kind]
    return [template.format(n=rng.randint(2, 400), **{k: rng.choice(v) for k, v in fills.items()}) for _ in range(n)]


def test_each_discovered_cluster_is_named_by_words_of_its_kind_and_never_by_a_whole_prompt(extractor):
    rng = random.Random(0)
    router = Router(RouterConfig(mode="clusters"), extractor=extractor)
    queries = [(kind, q) for kind in KINDS for q in _queries(kind, 12, rng)]
    rng.shuffle(queries)
    kinds_of = defaultdict(Counter)
    for kind, q in queries:
        kinds_of[router.route(q).domain][kind] += 1
    router.clusters.refresh_names()  # as the operator's views do before they read names
    named = 0
    for c in router.clusters.clusters.values():
        if c.count < 3:
            continue
        kind = kinds_of[c.key].most_common(1)[0][0]
        template, fills = KINDS[kind]
        vocabulary = {w.lower().strip(",.;?") for w in template.split()} | {w.lower() for v in fills.values() for w in v}
        assert c.name and set(c.name.split()) & vocabulary, (c.key, c.name, kind)
        assert c.name not in {q.lower() for _, q in queries} and len(c.name.split()) <= 3
        named += 1
    assert named >= len(KINDS)  # every kind has a named cluster at least
    assert router.summary()["clusters"][c.key]["name"] == c.name


def test_names_reach_the_metrics_as_an_info_gauge_that_follows_renames():
    meter, hub = Meter("Router"), Hub(MetricsConfig())
    meter.replace("osd_domain_info", {("c0/en", "select table customers"): 1, ("c1/en", "python function list"): 1})
    hub.merge(meter.snapshot())
    assert 'osd_domain_info{domain="c0/en",name="select table customers"} 1.0' in hub.exposition().decode()
    for i in itertools.count():  # renamed as it grows: the old name's series goes
        meter.replace("osd_domain_info", {("c0/en", f"select table orders{i}"): 1})
        if i == 2500:  # more renames than a family's series cap: still the current name
            break
    hub.merge(meter.snapshot())
    text = hub.exposition().decode()
    assert 'name="select table orders2500"' in text and "customers" not in text and "c1/en" not in text
    assert hub.stats()["domain_names"] == {}  # no traffic counted yet: nothing in scope
    pool = Meter("DraftPool")
    for tenant in ("alice", "bob"):
        pool.inc("osd_spec_decode_num_draft_tokens_total", 8, tenant=tenant, domain="c0/en" if tenant == "alice" else "c7/en",
                 language="en", draft="general")
        pool.inc("osd_spec_decode_num_accepted_tokens_total", 4, tenant=tenant, domain="c0/en" if tenant == "alice" else "c7/en",
                 language="en", draft="general")
    hub.merge(pool.snapshot())
    assert hub.stats()["acceptance"]["c0/en"]["name"] == "select table orders2500"
    assert hub.stats(tenant="alice", admin=False)["domain_names"] == {"c0/en": "select table orders2500"}
    assert hub.stats(tenant="bob", admin=False)["domain_names"] == {}  # another tenant's domain: not its name


def test_a_cluster_close_to_a_named_domain_carries_its_name_and_one_far_from_every_named_domain_does_not(extractor):
    """Mode clusters with a classifier fitted on examples of two kinds (sql, python): routing stays
    by clusters, and each cluster of those kinds is named as near its kind; clusters of the two
    kinds the classifier never saw (cooking, travel) are near none."""
    rng = random.Random(1)
    router = Router(RouterConfig(mode="clusters", classifier={"lexical": False, "background": False}), extractor=extractor)
    examples = [(kind, q) for kind in ("sql", "python") for q in _queries(kind, 16, rng)]
    router.fit([q for _, q in examples], [kind for kind, _ in examples], ["en"] * len(examples))
    queries = [(kind, q) for kind in KINDS for q in _queries(kind, 10, rng)]
    rng.shuffle(queries)
    kinds_of = defaultdict(Counter)
    for kind, q in queries:
        route = router.route(q)
        assert route.domain.startswith("c")  # still routed by cluster
        kinds_of[route.domain][kind] += 1
    router.refresh_names()
    seen = Counter()
    for c in router.clusters.clusters.values():
        if c.count < 3:
            continue
        kind = kinds_of[c.key].most_common(1)[0][0]
        assert c.name is not None
        if kind in ("sql", "python"):
            assert c.name.endswith(f"(near {kind})"), (c.key, c.name)
        else:
            assert "near" not in c.name, (c.key, c.name, kind)
        seen[kind] += 1
    assert all(seen[k] for k in KINDS), seen


def test_the_nearest_typical_label_by_hand():
    from router.domains import DomainClassifier

    clf = DomainClassifier()
    e = np.eye(4, dtype=np.float32)
    clf.examples = {"a": e[[0]], "b": e[[1]]}
    clf.thresholds = {"a": 0.9, "b": 0.5}
    rows = np.array([[1, 0, 0, 0], [0.6, 0.8, 0, 0], [0.8, 0.6, 0, 0], [0, 0, 1, 0]], np.float32)
    # row 2: closer to a (0.8) than to b (0.6), but a wants 0.9: b (0.6 >= 0.5) is the typical one
    assert clf.nearest_typical(rows) == ["a", "b", "b", None]
    assert DomainClassifier().nearest_typical(rows) == [None] * 4  # no examples: no named domain
